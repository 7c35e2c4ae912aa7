"""One conformance suite for every storage backend: local disk, memory:// and S3 (a moto server over HTTP),
bare and behind a user's wrapper.

Each test runs once per backend through the ``backend`` fixture (conftest.py). What is checked is what a
user relies on whatever the backend: round trips, overwrite rules, crash leftovers being invisible and
swept, retention really deleting, corruption being caught, lazy byte-range reads, check_storage, and a
failed save leaving the previous checkpoint whole with nothing stray beside it. Then the contract itself:
a wrapper that forwards the capabilities keeps the locking, sweeping, renames and read parallelism of what
it wraps, and one that forgets them is slower or untidier, never wrong.
"""

from __future__ import annotations

import errno
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import trainstate
from helpers import assert_same
from trainstate._format.manifest import MANIFEST_NAME
from trainstate._manager import catalog
from trainstate._storage import Capabilities, FileInfo, Storage
from trainstate.errors import StorageError

from .conftest import Backend
from .wrapping import Minimal, Wrapping


def numpy_state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": rng.standard_normal((32, 16)).astype(np.float32),
            "b": rng.standard_normal(16),  # float64
            "h": rng.standard_normal(7).astype(np.float16),
            "bf": rng.standard_normal(9).astype(ml_dtypes.bfloat16),
        },
        "ids": rng.integers(-(2**40), 2**40, size=11, dtype=np.int64),
        "bytes": rng.integers(0, 255, size=13, dtype=np.uint8),
        "mask": rng.random(5) > 0.5,
        "scalar": np.float32(2.5),
        "zero_d": np.array(3, dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "step": 1200 + seed,
        "lr": 1e-3,
        "name": "exp1",
        "blob": b"\x00\xffraw",
        "nothing": None,
        "nan": float("nan"),
        "betas": (0.9, 0.999),
        "history": [1, 2.0, True, "x"],
        "by_int": {0: "zero", 7: {"nested": [None, (1, 2)]}},
    }


def data_files(backend: Backend, url: str) -> set[str]:
    return {n for n in backend.listdir(url) if n.endswith(".safetensors")}


def referenced_files(backend: Backend, url: str) -> set[str]:
    with trainstate.open(url, storage=backend.storage) as ck:
        return {f.path for f in ck.manifest.files}


def assert_no_strays(backend: Backend, url: str) -> None:
    """The checkpoint holds its manifest and exactly the data files it names; no staging siblings."""
    assert set(backend.listdir(url)) == {MANIFEST_NAME} | referenced_files(backend, url)
    parent, name = url.rsplit("/", 1)
    assert [n for n in backend.listdir(parent) if name in n] == [name]


# -- round trip --------------------------------------------------------------------------------------


def test_round_trip(backend: Backend) -> None:
    state = numpy_state()
    url = backend.url("step_1")
    result = trainstate.save(url, state, metadata={"run": "exp1", "n": 3}, storage=backend.storage)
    assert result.nbytes > 0

    assert_same(state, trainstate.load(url, storage=backend.storage))
    with trainstate.open(url, storage=backend.storage) as ck:
        assert ck.metadata == {"run": "exp1", "n": 3}
        assert "model.w" in ck and "ids" in ck
        assert ck.info("model.w").shape == (32, 16) and ck.info("model.w").dtype == "F32"
        assert_same(state["model"]["bf"], np.array(ck.read("model.bf")))
        assert_same(state["ids"], np.array(ck.read("ids")))
        ck.verify()
    assert_no_strays(backend, url)


# -- overwrite -----------------------------------------------------------------------------------


def test_overwrite_is_refused_then_allowed_and_drops_old_files(backend: Backend) -> None:
    url = backend.url("ck")
    first, second = numpy_state(0), numpy_state(1)
    trainstate.save(url, first, storage=backend.storage)
    old_files = referenced_files(backend, url)

    with pytest.raises(trainstate.CheckpointExistsError):
        trainstate.save(url, second, storage=backend.storage)
    assert_same(first, trainstate.load(url, storage=backend.storage))

    trainstate.save(url, second, overwrite=True, storage=backend.storage)
    assert_same(second, trainstate.load(url, storage=backend.storage))
    assert_no_strays(backend, url)
    if backend.storage.capabilities.in_place:  # new unique names; the old ones are gone from the store
        assert not (old_files & data_files(backend, url))


# -- crash leftovers -----------------------------------------------------------------------------


def test_incomplete_checkpoint_is_refused_invisible_and_swept(backend: Backend, monkeypatch: Any) -> None:
    run = backend.url("run")
    state = {"w": np.arange(64, dtype=np.float32), "v": np.ones(8), "step": 0}
    with trainstate.CheckpointManager(run, storage=backend.storage, capture_rng=False, save_on_preemption=False) as mgr:
        for step in (1, 2):
            state["step"] = step
            mgr.save(step, state, force=True)
    crashed = backend.url("run", "step_00000002")
    backend.remove(crashed + "/" + MANIFEST_NAME)  # data files written, manifest never PUT
    assert data_files(backend, crashed)

    with pytest.raises(trainstate.IncompleteCheckpointError):
        trainstate.open(crashed, storage=backend.storage)
    with pytest.raises(trainstate.IncompleteCheckpointError):
        trainstate.load(crashed, storage=backend.storage)

    reader = trainstate.CheckpointManager(run, storage=backend.storage, read_only=True)
    assert [c.step for c in reader.list()] == [1]
    assert reader.latest().step == 1
    assert "step_00000002" in backend.listdir(run)  # a read-only manager sweeps nothing

    if not backend.storage.capabilities.locking:  # no lock: only leftovers left alone for a while go
        with trainstate.CheckpointManager(
            run, storage=backend.storage, capture_rng=False, save_on_preemption=False
        ) as mgr:
            assert mgr.swept == []  # could be another process's save in flight
        monkeypatch.setattr(catalog, "REMOTE_SWEEP_AGE", -1.0)  # as if an hour had passed
    with trainstate.CheckpointManager(run, storage=backend.storage, capture_rng=False, save_on_preemption=False) as mgr:
        assert mgr.swept == ["step_00000002"]
        assert not data_files(backend, crashed)
        assert "step_00000002" not in backend.listdir(run)
        fresh = {"w": np.zeros(64, dtype=np.float32), "v": np.zeros(8), "step": -1}
        assert mgr.restore_latest(fresh) == 2
        assert fresh["step"] == 1 and np.array_equal(fresh["w"], state["w"])


# -- the manager -----------------------------------------------------------------------------------


def test_manager_retention_deletes_on_the_backend_and_resumes(backend: Backend) -> None:
    run = backend.url("run")
    state = {"w": np.zeros(256, dtype=np.float32), "step": 0}
    with trainstate.CheckpointManager(
        run, every_steps=2, keep_last=2, storage=backend.storage, capture_rng=False, save_on_preemption=False
    ) as mgr:
        for step in range(1, 10):
            state["w"][:] = step
            state["step"] = step
            mgr.save(step, state)
        assert [c.step for c in mgr.list()] == [6, 8]
        assert mgr.latest().step == 8
        assert [r.step for r in mgr.history()] == [2, 4, 6, 8]
    kept = {"step_00000006", "step_00000008"}
    on_backend = {n for n in backend.listdir(run) if not n.startswith(".trainstate.lock")}
    assert on_backend - {"_history"} == kept, "retention must really delete on the backend"
    fates = [(e.step, e.status) for e in trainstate.history(run, storage=backend.storage)]
    if backend.storage.capabilities.makedirs or backend.kind != "local":
        assert fates == [(2, "deleted"), (4, "deleted"), (6, "kept"), (8, "kept")]  # each save's record is there
    else:  # a wrapper that hides a local disk's makedirs: _history/ cannot be made, the checkpoints still list
        assert fates == [(6, "kept"), (8, "kept")]
    for gone in ("step_00000002", "step_00000004"):
        assert not backend.exists(backend.url("run", gone))
    for name in kept:
        assert_no_strays(backend, backend.url("run", name))

    fresh = {"w": np.full(256, -1, dtype=np.float32), "step": -1}
    with trainstate.CheckpointManager(run, storage=backend.storage, capture_rng=False, save_on_preemption=False) as mgr:
        assert mgr.restore_latest(fresh) == 9
    assert fresh["step"] == 8 and np.all(fresh["w"] == 8)


# -- corruption ------------------------------------------------------------------------------------


def test_a_flipped_tensor_byte_is_caught(backend: Backend) -> None:
    url = backend.url("ck")
    state = {"w": np.arange(1000, dtype=np.float32), "v": np.arange(10, dtype=np.int64)}
    trainstate.save(url, state, storage=backend.storage)
    with trainstate.open(url, storage=backend.storage) as ck:
        chunk = ck.manifest.tensors["w"].chunks[0]
    target = url + "/" + chunk.file
    data = bytearray(backend.read_bytes(target))
    data[(chunk.byte_range[0] + chunk.byte_range[1]) // 2] ^= 0x01
    backend.write_bytes(target, bytes(data))  # for S3: the whole object PUT again, one byte changed

    with pytest.raises(trainstate.CorruptCheckpointError, match="tensor w"):
        trainstate.load(url, storage=backend.storage)
    with trainstate.open(url, storage=backend.storage) as ck:
        with pytest.raises(trainstate.CorruptCheckpointError):
            ck.read("w")
        with pytest.raises(trainstate.CorruptCheckpointError):
            ck.verify()
        assert np.array_equal(ck.read("v"), state["v"])  # the undamaged tensor still reads


# -- lazy reads ------------------------------------------------------------------------------------


class Unmapped(Wrapping):
    """Forwards everything but memory maps: every byte read goes through ``read_into`` on every backend
    (local reads would otherwise page in through mmap)."""

    @property
    def capabilities(self) -> Capabilities:
        return replace(self.inner.capabilities, memory_map=False)


class CountingStorage(Unmapped):
    """Forwards to another storage, never maps, and records every ``read_into``."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.reads: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    @property
    def bytes_read(self) -> int:
        return sum(n for _, _, n in self.reads)

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        n = self.inner.read_into(path, offset, out)
        with self._lock:
            self.reads.append((path, offset, n))
        return n


def test_lazy_reads_fetch_only_the_byte_ranges_they_need(backend: Backend) -> None:
    url = backend.url("ck")
    big = np.arange(4 << 20, dtype=np.float32)  # 16 MiB
    small = np.arange(16, dtype=np.int32)
    trainstate.save(url, {"big": big, "small": small, "step": 3}, storage=backend.storage)

    counting = CountingStorage(backend.storage)
    with trainstate.open(url, storage=counting) as ck:
        total = ck.nbytes
        big_range = ck.manifest.tensors["big"].chunks[0]
        after_open = counting.bytes_read
        assert np.array_equal(ck.read("small"), small)
    assert total > big.nbytes
    assert after_open < 16 << 10, f"open() read {after_open} bytes: the manifest only"
    assert small.nbytes <= counting.bytes_read - after_open < 4096
    assert counting.bytes_read < total / 1000, f"{counting.bytes_read} of {total} bytes fetched"
    big_file = big_range.file
    for path, offset, n in counting.reads:  # nothing of the big tensor's bytes was touched
        if path.endswith(big_file):
            assert offset + n <= big_range.byte_range[0] or offset >= big_range.byte_range[1]


# -- check_storage -------------------------------------------------------------------------------


def test_check_storage_passes_on_a_good_location(backend: Backend) -> None:
    run = backend.url("run")
    trainstate.check_storage(run, storage=backend.storage)
    assert not [n for n in backend.listdir(run) if "probe" in n], "the probe must be cleaned up"


def test_check_storage_raises_a_clear_error_on_a_bad_location(backend: Backend, tmp_path: Any) -> None:
    if backend.kind == "local":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        bad, storage, reason = str(blocker / "run"), backend.storage, "directory"
    elif backend.kind == "s3":
        bad = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
        storage, reason = backend.storage, "bucket does not exist"
    else:  # memory:// cannot fail by itself: a store that refuses writes
        from trainstate._storage.fsspec import FsspecStorage

        from .test_remote import FlakyFS

        storage = backend.wrap(FsspecStorage(FlakyFS(backend.fs, failures=1, error=PermissionError), backoff=0.001))
        bad, reason = backend.url("run"), "PermissionError"
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        trainstate.check_storage(bad, storage=storage)
    message = str(info.value)
    assert bad in message and "not usable for checkpoints" in message
    assert reason.lower() in message.lower(), message
    assert time.monotonic() - start < 5, "a permanent error must not be retried with backoff"


# -- failed saves ----------------------------------------------------------------------------------


def failing_on_write(storage: Storage, nth: int) -> Storage:
    """The same storage (same class, same state) except that its ``nth`` ``write`` call raises."""
    base = type(storage)

    class FailingWrite(base):  # type: ignore[misc, valid-type]
        def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
            with self._count_lock:
                self.writes += 1
                mine = self.writes
            if mine == nth:
                raise StorageError(errno.EIO, f"injected failure writing {path}")
            return super().write(path, views, fsync=fsync)

    failing = FailingWrite.__new__(FailingWrite)
    failing.__dict__.update(storage.__dict__)
    failing.writes = 0
    failing._count_lock = threading.Lock()
    return failing


def two_file_state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal(5000).astype(np.float32), "b": rng.standard_normal(5000), "step": seed}


def test_a_failed_overwrite_leaves_the_previous_checkpoint_and_no_strays(backend: Backend) -> None:
    url = backend.url("ck")
    before = two_file_state(1)
    trainstate.save(url, before, storage=backend.storage)
    failing = failing_on_write(backend.storage, 2)
    with pytest.raises(StorageError, match="injected"):
        trainstate.save(url, two_file_state(2), overwrite=True, storage=failing)
    assert failing.writes >= 2
    assert_same(before, trainstate.load(url, storage=backend.storage))
    assert_no_strays(backend, url)


def test_a_failed_new_save_leaves_nothing(backend: Backend) -> None:
    url = backend.url("ck")
    with pytest.raises(StorageError, match="injected"):
        trainstate.save(url, two_file_state(2), storage=failing_on_write(backend.storage, 2))
    assert backend.listdir(url) == []
    with pytest.raises(trainstate.CheckpointNotFoundError):
        trainstate.open(url, storage=backend.storage)
    parent = url.rsplit("/", 1)[0]
    assert backend.listdir(parent) == [], "no staging leftovers beside it either"


# -- gaps this suite found, fixed; kept as regression tests ---------------------------------------


def test_a_second_manager_does_not_destroy_an_in_flight_save(backend: Backend, request: Any) -> None:
    """Local disks refuse a second manager (a directory lock). Remote stores have no lock; there the
    start-up sweep leaves recent leftovers alone, so an in-flight save is never taken for a crash."""
    run = backend.url("run")
    release, blocked = threading.Event(), threading.Event()
    base = type(backend.storage)

    class SlowCommit(base):  # type: ignore[misc, valid-type]
        def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
            if path.endswith(MANIFEST_NAME):  # every data file is written; the commit is pending
                blocked.set()
                assert release.wait(20)
            return super().write(path, views, fsync=fsync)

    slow = SlowCommit.__new__(SlowCommit)
    slow.__dict__.update(backend.storage.__dict__)
    state = {"w": np.arange(1000, dtype=np.float32), "step": 1}
    first = trainstate.CheckpointManager(
        run, storage=slow, async_save=True, capture_rng=False, save_on_preemption=False
    )
    try:
        first.save(1, state, force=True)
        assert blocked.wait(20)
        try:
            second = trainstate.CheckpointManager(
                run, storage=backend.storage, capture_rng=False, save_on_preemption=False
            )
            second.close()
        except trainstate.CheckpointError:
            pass  # refusing the second manager is a fine answer
    finally:
        release.set()
        first.close()
    assert_same(state, trainstate.load(backend.url("run", "step_00000001"), storage=backend.storage))


def test_a_checkpoint_committed_by_another_process_is_seen(backend: Backend, request: Any) -> None:
    """Two clients of one store (a trainer and an evaluator): the reader must see what the writer committed
    after the reader last listed the directory (s3fs caches listings; stat must not answer from them)."""
    from trainstate._storage.fsspec import FsspecStorage

    if backend.kind == "local":
        reader_storage = backend.storage
    elif backend.kind == "memory":
        reader_storage = backend.wrap(FsspecStorage(backend.fs))  # one process-wide store: nothing to go stale
    else:
        server = request.getfixturevalue("moto_server")
        reader_storage = backend.wrap(FsspecStorage(server.filesystem(skip_instance_cache=True)))
    run = backend.url("run")
    state = {"w": np.arange(10, dtype=np.float32)}
    trainstate.save(backend.url("run", "step_00000001"), state, storage=backend.storage)
    reader = trainstate.CheckpointManager(run, storage=reader_storage, read_only=True)
    assert [c.step for c in reader.list()] == [1]
    trainstate.save(backend.url("run", "step_00000002"), state, storage=backend.storage)  # the other process
    assert_same(state, trainstate.load(backend.url("run", "step_00000002"), storage=reader_storage))


# -- the contract: named capabilities, and wrappers that forward them (or forget to) ----------------


def with_hooks(storage: Storage, **hooks: Any) -> Storage:
    """The same storage (same class, same state) with ``hooks`` run before the method of the same name."""
    base = type(storage)

    class Hooked(base):  # type: ignore[misc, valid-type]
        pass

    for method, hook in hooks.items():

        def hooked(self: Any, *args: Any, _method: str = method, _hook: Any = hook, **kwargs: Any) -> Any:
            _hook(*args)
            return getattr(base, _method)(self, *args, **kwargs)

        setattr(Hooked, method, hooked)
    hooked_storage = Hooked.__new__(Hooked)
    hooked_storage.__dict__.update(storage.__dict__)
    return hooked_storage


def test_an_incomplete_backend_fails_when_it_is_built() -> None:
    class NoCommit(Storage):
        def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
            return 0

        def read_into(self, path: str, offset: int, out: memoryview) -> int:
            return 0

        def stat(self, path: str) -> FileInfo | None:
            return None

        def list(self, path: str) -> list[str]:
            return []

        def delete(self, path: str) -> None:
            pass

        def begin(self, final: str, *, overwrite: bool) -> str:
            return final

    with pytest.raises(TypeError, match="commit"):
        NoCommit()  # type: ignore[abstract]


def test_capabilities_are_the_wrapped_backends_or_the_conservative_defaults(backend: Backend) -> None:
    caps = backend.storage.capabilities
    with pytest.raises(AttributeError):
        caps.locking = not caps.locking  # type: ignore[misc]
    if backend.wrapper == "forgetful":
        assert caps == Capabilities()
        assert (caps.locking, caps.atomic_rename, caps.memory_map, caps.in_place) == (False, False, False, True)
    elif backend.wrapper == "wrapped":
        assert caps == backend.storage.inner.capabilities  # type: ignore[attr-defined]
    if backend.kind == "local" and backend.wrapper != "forgetful":
        assert caps.locking and caps.atomic_rename and caps.memory_map and not caps.in_place
    if backend.kind != "local" and backend.wrapper != "forgetful":
        assert caps.in_place and not caps.atomic_rename and not caps.locking and caps.read_parallelism > 1


def test_one_writing_manager_per_directory_where_the_store_can_lock(backend: Backend) -> None:
    """A wrapper around the local disk keeps its lock: before capabilities, only a LocalStorage took one."""
    run = backend.url("run")
    options: dict[str, Any] = {"storage": backend.storage, "capture_rng": False, "save_on_preemption": False}
    with trainstate.CheckpointManager(run, **options):
        if backend.storage.capabilities.locking:
            with pytest.raises(trainstate.CheckpointError, match="another CheckpointManager"):
                trainstate.CheckpointManager(run, **options)
        else:  # no lock to take: a second writer is allowed, and the sweep keeps off recent leftovers
            trainstate.CheckpointManager(run, **options).close()
    assert (".trainstate.lock" in backend.listdir(run)) == backend.storage.capabilities.locking


def test_retention_puts_back_a_checkpoint_pinned_while_it_is_taken_away(backend: Backend) -> None:
    """Where the store renames, retention hides the checkpoint in one step and unhides it for a late pin;
    elsewhere it un-commits by removing the manifest and writes it back. Either way the pin wins."""
    run = backend.url("run")
    calls: list[str] = []
    pinned: list[bool] = []

    def pin_now(what: str) -> None:  # another process pins step 1 just as retention takes it away
        calls.append(what)
        if not pinned:
            pinned.append(trainstate.CheckpointManager(run, read_only=True, storage=backend.storage).pin(1, "keep"))

    storage = with_hooks(
        backend.storage,
        hide=lambda path: pin_now("hide"),
        unhide=lambda hidden, path: calls.append("unhide"),
        delete=lambda path: path.endswith(MANIFEST_NAME) and pin_now("uncommit"),
    )
    state = {"w": np.arange(100, dtype=np.float32), "step": 1}
    with trainstate.CheckpointManager(
        run, every_steps=1, keep_last=1, storage=storage, capture_rng=False, save_on_preemption=False
    ) as mgr:
        mgr.save(1, state)
        mgr.save(2, {"w": np.zeros(100, dtype=np.float32), "step": 2})
    assert pinned == [True]
    reader = trainstate.CheckpointManager(run, read_only=True, storage=backend.storage)
    assert [(c.step, c.pinned) for c in reader.list()] == [(1, True), (2, False)]
    assert_same(state, trainstate.load(backend.url("run", "step_00000001"), storage=backend.storage))
    if backend.storage.capabilities.atomic_rename:
        assert calls == ["hide", "unhide"]
    else:
        assert calls == ["uncommit"]


def test_a_restore_keeps_as_many_reads_in_flight_as_the_store_asks_for(backend: Backend) -> None:
    """Each reader lane's first read waits until all the lanes the store asks for are reading at once."""
    caps = backend.storage.capabilities
    lanes = max(2, caps.read_parallelism)  # 2: load()'s own default
    url = backend.url("ck")
    state = {f"t{i:02d}": np.full(512, i, dtype=np.float32) for i in range(2 * lanes)}
    trainstate.save(url, state, storage=backend.storage)
    together = threading.Barrier(lanes, timeout=30)
    readers: set[str] = set()
    guard = threading.Lock()

    def first_read_waits(path: str, offset: int, out: memoryview) -> None:
        me = threading.current_thread().name
        if not me.startswith("trainstate-read"):
            return
        with guard:
            first = me not in readers
            readers.add(me)
        if first:
            together.wait()  # BrokenBarrierError if fewer lanes than asked for ever read at once

    gated = Unmapped(with_hooks(backend.storage, read_into=first_read_waits))  # every byte through read_into
    assert_same(state, trainstate.load(url, storage=gated))
    assert len(readers) == lanes


class Scrambling(Unmapped):  # a map would show the scrambled bytes
    """Stores every byte XOR 0x5A: a stand-in for an encrypting wrapper. The store it wraps cannot read
    the manifest it holds, so it must never need to."""

    KEY = 0x5A

    def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
        scrambled = [memoryview((np.frombuffer(bytes(v), np.uint8) ^ self.KEY).tobytes()) for v in views]
        return self.inner.write(path, scrambled, fsync=fsync)

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        n = self.inner.read_into(path, offset, out)
        view = np.frombuffer(out, np.uint8, count=n)
        view ^= self.KEY
        return n


def test_an_overwrite_through_a_byte_transforming_wrapper_drops_the_replaced_files(backend: Backend) -> None:
    """The backend learns which files to keep from the saver, not by parsing a manifest it may not read."""
    storage = Scrambling(backend.storage)
    url = backend.url("ck")
    first, second = numpy_state(0), numpy_state(1)
    trainstate.save(url, first, storage=storage)
    trainstate.save(url, second, overwrite=True, storage=storage)
    assert_same(second, trainstate.load(url, storage=storage))
    assert not backend.read_bytes(url + "/" + MANIFEST_NAME).startswith(b"{")  # really scrambled
    with trainstate.open(url, storage=storage) as ck:
        named = {f.path for f in ck.manifest.files}
    assert set(backend.listdir(url)) == {MANIFEST_NAME} | named


def test_a_wrapper_of_only_the_abstract_methods_never_writes_over_a_committed_file(backend: Backend) -> None:
    """A backend that declares nothing may write in place: the saver then names files uniquely, so a failed
    overwrite cannot have touched the checkpoint it was replacing (a staging leftover is fine)."""
    url = backend.url("ck")
    before = two_file_state(1)
    trainstate.save(url, before, storage=backend.storage)
    failing = failing_on_write(Minimal(backend.storage), 2)
    with pytest.raises(StorageError, match="injected"):
        trainstate.save(url, two_file_state(2), overwrite=True, storage=failing)
    assert_same(before, trainstate.load(url, storage=backend.storage))
    with trainstate.open(url, storage=backend.storage) as ck:
        ck.verify()
