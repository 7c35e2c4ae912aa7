"""Remote-only behaviour: s3:// URLs with credentials from the environment, and retries.

Retries are exercised with a wrapper filesystem around fsspec's memory filesystem that fails on purpose:
transient errors (ConnectionError) must be retried until the operation succeeds; permanent ones
(PermissionError) must not be retried and must surface as StorageError.
"""

from __future__ import annotations

import errno
import logging
import threading
import uuid
from collections import Counter
from typing import Any

import numpy as np
import pytest

import trainstate
import trainstate._storage
from helpers import assert_same
from trainstate._format.manifest import MANIFEST_NAME
from trainstate.errors import StorageError

from .conftest import BUCKET, S3_REGION, MotoServer

fsspec = pytest.importorskip("fsspec")
from trainstate._storage.fsspec import FsspecStorage  # noqa: E402 - only once fsspec is known to exist


class _FlakyFile:
    """A writable file whose ``write`` calls fail on purpose (a connection reset mid-upload)."""

    def __init__(self, inner: Any, fs: FlakyFS) -> None:
        self._inner, self._fs = inner, fs

    def write(self, data: Any) -> int:
        self._fs._maybe_fail("write")
        return self._inner.write(data)

    def __enter__(self) -> _FlakyFile:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._inner.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class FlakyFS:
    """Wraps an fsspec filesystem; the first ``failures`` calls of each method in ``methods`` raise ``error``.

    Only the wrapper's own entry points fail, so one retried operation sees exactly the injected errors,
    whatever the wrapped filesystem calls internally. Everything else is passed through.
    """

    def __init__(
        self,
        inner: Any,
        *,
        failures: int = 2,
        error: type[BaseException] = ConnectionError,
        methods: tuple[str, ...] = ("cat_file", "open"),
    ) -> None:
        self.inner = inner
        self.failures = failures
        self.error = error
        self.methods = methods
        self.calls: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _maybe_fail(self, method: str) -> None:
        with self._lock:  # files are written from several threads
            self.calls[method] += 1
            n = self.calls[method]
            fail = method in self.methods and n <= self.failures
            if fail:
                self.failed[method] += 1
        if fail:
            raise self.error(f"injected {self.error.__name__} #{n} in {method}")

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any) -> bytes:
        self._maybe_fail("cat_file")
        return self.inner.cat_file(path, start=start, end=end, **kw)

    def open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        self._maybe_fail("open")
        f = self.inner.open(path, mode, **kw)
        return _FlakyFile(f, self) if "w" in mode else f

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def memory_root() -> Any:
    fs = fsspec.filesystem("memory")
    root = f"memory://flaky-{uuid.uuid4().hex[:12]}"
    yield fs, root
    if fs.exists(fs._strip_protocol(root)):
        fs.rm(fs._strip_protocol(root), recursive=True)


def small_state() -> dict[str, Any]:
    return {
        "a": np.arange(1000, dtype=np.float32),
        "b": np.arange(50, dtype=np.int64),
        "step": 7,
        "opt": {"lr": 0.1, "betas": (0.9, 0.99)},
    }


# -- retries -----------------------------------------------------------------------------------------


def test_transient_errors_are_retried_until_the_operation_succeeds(memory_root: Any, caplog: Any) -> None:
    fs, root = memory_root
    flaky = FlakyFS(fs, failures=2, error=ConnectionError)
    storage = FsspecStorage(flaky, backoff=0.001)
    url = root + "/ck"
    state = small_state()
    with caplog.at_level(logging.WARNING, logger="trainstate"):
        trainstate.save(url, state, storage=storage)
        assert flaky.failed["open"] == 2
        assert_same(state, trainstate.load(url, storage=storage))
        assert flaky.failed["cat_file"] == 2
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 4
    assert_same(state, trainstate.load(url, storage=FsspecStorage(fs)))  # what landed is whole


def test_a_connection_reset_mid_upload_restarts_the_file(memory_root: Any) -> None:
    fs, root = memory_root
    flaky = FlakyFS(fs, failures=1, error=ConnectionResetError, methods=("write",))
    storage = FsspecStorage(flaky, backoff=0.001)
    url = root + "/ck"
    state = small_state()
    trainstate.save(url, state, storage=storage, threads=1)
    assert flaky.failed["write"] == 1
    with trainstate.open(url, storage=FsspecStorage(fs)) as ck:
        ck.verify()
    assert_same(state, trainstate.load(url, storage=FsspecStorage(fs)))


def test_too_many_transient_errors_become_storage_error(memory_root: Any) -> None:
    fs, root = memory_root
    flaky = FlakyFS(fs, failures=100, error=TimeoutError, methods=("open",))
    storage = FsspecStorage(flaky, retries=3, backoff=0.001)
    with pytest.raises(StorageError, match="TimeoutError"):
        trainstate.save(root + "/ck", small_state(), storage=storage, threads=1)  # one data file
    assert flaky.calls["open"] == 4  # the first attempt and three retries
    assert not fs.exists(fs._strip_protocol(root + "/ck"))


def test_permission_error_is_not_retried_and_becomes_storage_error(memory_root: Any) -> None:
    fs, root = memory_root
    url = root + "/ck"
    trainstate.save(url, small_state(), storage=FsspecStorage(fs))

    denied_write = FlakyFS(fs, failures=1, error=PermissionError, methods=("open",))
    with pytest.raises(StorageError) as info:
        trainstate.save(root + "/other", small_state(), storage=FsspecStorage(denied_write, backoff=0.001))
    assert info.value.errno == errno.EACCES and "PermissionError" in str(info.value)
    assert denied_write.calls["open"] == 1

    denied_read = FlakyFS(fs, failures=1, error=PermissionError, methods=("cat_file",))
    with pytest.raises(StorageError) as info:
        trainstate.load(url, storage=FsspecStorage(denied_read, backoff=0.001))
    assert info.value.errno == errno.EACCES
    assert denied_read.calls["cat_file"] == 1


# -- a checkpoint deleted while it is read -----------------------------------------------------------


class _Part:
    """A stateful part of the state. Given ``delete=(storage, url)``, its state_dict() deletes that
    checkpoint: during a restore, a deletion (retention in another process, a user) that lands after the
    load opened the checkpoint and before it reads the tensors."""

    def __init__(self, a: np.ndarray, delete: tuple[FsspecStorage, str] | None = None) -> None:
        self.a, self.delete = a, delete

    def state_dict(self) -> dict[str, Any]:
        if self.delete is not None:
            storage, url = self.delete
            storage.delete(storage.strip(url))
        return {"a": self.a}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_checkpoint_deleted_while_it_is_read_is_not_found(memory_root: Any) -> None:
    fs, root = memory_root
    storage = FsspecStorage(fs)
    url = root + "/ck"
    for how in ("read", "read_into", "verify", "load"):
        trainstate.save(
            url, {"part": _Part(np.arange(1000, dtype=np.float32)), "b": np.arange(50)}, storage=storage, overwrite=True
        )
        with pytest.raises(trainstate.CheckpointNotFoundError, match="deleted while it was being read") as info:
            if how == "load":
                target = {
                    "part": _Part(np.zeros(1000, dtype=np.float32), delete=(storage, url)),
                    "b": np.zeros(50, dtype=np.int64),
                }
                trainstate.load(url, target, storage=storage)
            else:
                with trainstate.open(url, storage=storage) as ck:
                    storage.delete(storage.strip(url))
                    if how == "read":
                        ck.read("part.a")
                    elif how == "read_into":
                        ck.read_into("part.a", np.zeros(1000, dtype=np.float32))
                    else:
                        ck.verify()
        assert isinstance(info.value, FileNotFoundError), how
        assert isinstance(info.value.__cause__, StorageError) and info.value.__cause__.errno == errno.ENOENT


# -- memory -------------------------------------------------------------------------------------------


def test_restoring_a_large_tensor_from_s3_holds_at_most_one_extra_copy(moto_server: MotoServer) -> None:
    """A 96 MiB tensor restored in place over HTTP: verified in one buffer, then copied into the live
    array. Peak Python-allocated memory (buffers, HTTP bodies) beyond the target stays under 1.5x the
    tensor; one GET for the whole range held ~3x (the body's pieces, their join, the buffer)."""
    import tracemalloc

    storage = FsspecStorage(moto_server.filesystem(skip_instance_cache=True))
    url = f"s3://{BUCKET}/mem-{uuid.uuid4().hex[:8]}/ck"
    saved = np.random.default_rng(0).standard_normal(24 << 20, dtype=np.float32)  # 96 MiB
    trainstate.save(url, {"w": saved}, storage=storage)
    target = {"w": np.zeros_like(saved)}
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        trainstate.load(url, target, storage=storage)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert np.array_equal(target["w"], saved)
    assert peak < 1.5 * saved.nbytes, f"peak extra {peak / 2**20:.0f} MiB for a {saved.nbytes / 2**20:.0f} MiB tensor"


# -- s3:// with the environment's credentials ----------------------------------------------------------

KEY_ID = "AKIATRAINSTATEENV0001"
SECRET = "trainstate/env+secret/do-not-store-0001"


@pytest.fixture
def s3_from_environment(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Any:
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", S3_REGION)
    monkeypatch.setattr(trainstate._storage, "_REMOTE", {})  # one cached FsspecStorage per protocol
    s3fs.S3FileSystem.clear_instance_cache()  # and fsspec caches filesystems by their arguments
    yield moto_server
    s3fs.S3FileSystem.clear_instance_cache()


def test_s3_url_without_storage_uses_the_environment(s3_from_environment: MotoServer) -> None:
    prefix = f"s3://{BUCKET}/env-{uuid.uuid4().hex[:8]}"
    url = prefix + "/step_1"
    state = small_state()
    trainstate.check_storage(prefix)
    trainstate.save(url, state, metadata={"run": "env"})
    assert isinstance(trainstate._storage._REMOTE.get("s3"), FsspecStorage)
    assert_same(state, trainstate.load(url))
    with trainstate.open(url) as ck:
        assert ck.metadata == {"run": "env"}
        ck.verify()

    with trainstate.CheckpointManager(
        prefix + "/run", every_steps=1, keep_last=1, capture_rng=False, save_on_preemption=False
    ) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        assert [c.step for c in mgr.list()] == [2]

    # Credentials never end up in a checkpoint: not in the manifest, not in any data file.
    fs = s3_from_environment.filesystem()
    objects = fs.find(prefix.removeprefix("s3://"))
    assert any(o.endswith(MANIFEST_NAME) for o in objects)
    for key in objects:
        blob = fs.cat_file(key)
        for secret in (KEY_ID, SECRET, "AWS_"):
            assert secret.encode() not in blob, f"{secret!r} found in {key}"


def test_the_command_line_works_on_s3_urls(s3_from_environment: MotoServer) -> None:
    """trainstate ls / inspect / verify / diff take s3:// URLs, with credentials from the environment."""
    import json

    from helpers import cli

    run = f"s3://{BUCKET}/cli-{uuid.uuid4().hex[:8]}"
    with trainstate.CheckpointManager(run, every_steps=1, capture_rng=False, save_on_preemption=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(16, step, dtype=np.float32)}, metrics={"loss": 1.0 / step})

    import os

    listing = cli("ls", run, "--json", env=dict(os.environ))  # a fresh process: credentials from its environment
    assert listing.returncode == 0, listing.stderr
    rows = json.loads(listing.stdout)["checkpoints"]
    assert [(r["step"], r["status"], r["metrics"]) for r in rows] == [
        (1, "complete", {"loss": 1.0}),
        (2, "complete", {"loss": 0.5}),
    ]
    assert cli("inspect", f"{run}/step_00000002", "--json").returncode == 0
    assert cli("verify", f"{run}/step_00000002").returncode == 0
    diff = cli("diff", f"{run}/step_00000001", f"{run}/step_00000002", "--json", code=None)
    assert diff.returncode == 1 and "w" in diff.stdout
    missing = cli("ls", f"{run}-nope", code=None)
    assert missing.returncode == 3 and "Traceback" not in missing.stderr


class _Killed(BaseException):
    """The process dying mid-delete (not an Exception: nothing retries or catches it)."""


def test_a_delete_interrupted_on_s3_is_listed_as_deleting(s3_from_environment: MotoServer, monkeypatch: Any) -> None:
    """Retention on S3 removes a checkpoint's manifest, then its data: killed in between, the prefix holds data
    and no manifest, as an unfinished save's does. ``trainstate ls`` tells the two apart."""
    import json

    from helpers import cli

    run = f"s3://{BUCKET}/deleting-{uuid.uuid4().hex[:8]}"
    fs = s3_from_environment.filesystem()
    storage = FsspecStorage(fs)
    with trainstate.CheckpointManager(run, storage=storage, every_steps=1, capture_rng=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(16, step, dtype=np.float32)})
        real_rm = fs.rm

        def rm(path: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path, str) and path.endswith(MANIFEST_NAME):
                return real_rm(path, *args, **kwargs)
            raise _Killed  # the manifest went; the data files stay

        monkeypatch.setattr(fs, "rm", rm)
        with pytest.raises(_Killed):
            mgr.catalog.delete("step_00000001")
        monkeypatch.setattr(fs, "rm", real_rm)
        with trainstate.CheckpointManager(run, storage=storage, every_steps=1, capture_rng=False) as partial:
            partial.save(3, {"w": np.zeros(16, dtype=np.float32)})  # a save killed before its commit, by hand:
        real_rm(f"{run.removeprefix('s3://')}/step_00000003/{MANIFEST_NAME}")  # its data, no manifest

    rows = {r["name"]: r for r in json.loads(cli("ls", run, "--json").stdout)["checkpoints"]}
    assert (rows["step_00000001"]["status"], rows["step_00000002"]["status"]) == ("deleting", "complete")
    assert rows["step_00000003"]["status"] == "incomplete"
    assert "1 deleting" in cli("ls", run).stdout
