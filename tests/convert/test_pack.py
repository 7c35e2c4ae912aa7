"""trainstate.pack and loading from memory, the way an application that embeds a model uses them."""

from __future__ import annotations

import io
import json
import mmap
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import trainstate
from helpers import assert_same, cli
from trainstate._format import archive


def _state(scale: int = 1) -> dict:
    return {
        "model": {"w": np.arange(12, dtype=np.float32).reshape(3, 4) * scale, "b": np.arange(3, dtype=np.int64)},
        "optim": {"m": np.full((4,), 0.5, np.float64)},
        "step": 7,
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99)},
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    trainstate.save(path, _state(), metadata={"run": "exp1"}, threads=2)  # two data files
    return path


@pytest.fixture
def packed(tmp_path: Path, ckpt: Path) -> tuple[bytes, Path]:
    """The checkpoint's packed bytes, and the same written to a file."""
    data = trainstate.pack(ckpt)
    file = tmp_path / "model.tsar"
    assert trainstate.pack(ckpt, file) == len(data)
    assert file.read_bytes() == data
    return data, file


def _mapped(file: Path) -> mmap.mmap:
    with open(file, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


SOURCES = {
    "bytes": lambda data, file: data,
    "bytearray": lambda data, file: bytearray(data),
    "memoryview": lambda data, file: memoryview(data),
    "numpy uint8": lambda data, file: np.frombuffer(data, np.uint8),
    "BytesIO": lambda data, file: io.BytesIO(data),
    "binary file": lambda data, file: open(file, "rb"),  # noqa: SIM115 - closed by the test
    "zip-like stream": lambda data, file: io.BufferedReader(io.BytesIO(data)),  # no fileno: read whole
    "mmap": lambda data, file: _mapped(file),
    "path": lambda data, file: file,
    "str path": lambda data, file: str(file),
    "file:// URL": lambda data, file: f"file://{file}",
}


@pytest.mark.parametrize("kind", SOURCES)
def test_open_and_load_read_every_kind_of_source_like_the_directory(ckpt, packed, kind):
    source = SOURCES[kind](*packed)
    try:
        assert_same(trainstate.load(ckpt), trainstate.load(source))
        if hasattr(source, "seek"):
            source.seek(0)
        with trainstate.open(source) as ck:
            assert ck.keys() == trainstate.open(ckpt).keys()
            assert ck.metadata == {"run": "exp1"}
            assert ck.read("model.w", framework="torch" if kind == "bytes" else "numpy").shape == (3, 4)
            ck.verify()
    finally:
        if hasattr(source, "close") and not isinstance(source, (str, Path)):
            source.close()


def test_a_file_object_is_read_from_its_position(tmp_path, packed):
    """An archive inside a larger file (after a header of the application's own) is read where it starts."""
    data, _ = packed
    blob = tmp_path / "app.bin"
    blob.write_bytes(b"APP HEADER" * 100 + data + b"trailer")
    with open(blob, "rb") as f:
        f.seek(1000)
        assert trainstate.load(f)["step"] == 7


def test_lazy_reads_are_views_of_the_buffer_not_copies(packed):
    data, file = packed
    with trainstate.open(data) as ck:
        w = ck.read("model.w")
        assert np.shares_memory(w, np.frombuffer(data, np.uint8)) and not w.flags.writeable
        assert w.tolist() == _state()["model"]["w"].tolist()
    mm = _mapped(file)
    with trainstate.open(mm) as ck:
        chunk = ck.manifest.tensors["model.w"].chunks[0]
        w = ck.read("model.w")
        first = next(m for m in _index(data) if m["name"] == chunk.file)
        at = np.frombuffer(mm, np.uint8).ctypes.data + first["offset"] + chunk.byte_range[0]
        assert w.ctypes.data == at  # in place in the mapped file
        assert (at - chunk.byte_range[0]) % mmap.PAGESIZE == 0  # the data file starts on a page
    del w


def test_the_buffer_is_free_again_once_the_checkpoint_is_closed(packed):
    """Views are lent while the checkpoint is open (and while arrays read from it live), then given back:
    a bytearray can be resized, an mmap or a BytesIO closed, as if it had never been read."""
    data, file = packed
    buffer = bytearray(data)
    with trainstate.open(buffer) as ck:
        w = ck.read("model.w")
        with pytest.raises(BufferError):
            buffer.extend(b"x")  # the array views it
    del w
    buffer.extend(b"x")
    trainstate.load(buffer)
    buffer.clear()
    mm = _mapped(file)
    with trainstate.open(mm) as ck:
        ck.read("model.w")
    mm.close()
    stream = io.BytesIO(data)
    trainstate.load(stream)
    stream.write(b"more")
    stream.close()


def _index(data: bytes) -> list[dict]:
    n = archive.HEADER.unpack(data[: archive.HEADER.size])[3]
    return json.loads(data[32 : 32 + n])["files"]


def test_load_into_a_live_training_state_with_include_and_exclude(tmp_path):
    pytest.importorskip("torch")
    from helpers import fresh_like, make_training_state

    trained = make_training_state()
    trainstate.save(tmp_path / "c", trained)
    data = trainstate.pack(tmp_path / "c")
    target = fresh_like()
    trainstate.load(data, target)
    for name, value in trained["model"].state_dict().items():
        assert_same(value, target["model"].state_dict()[name], name)
    assert target["optim"].state_dict()["state"].keys() == trained["optim"].state_dict()["state"].keys()

    only_model = fresh_like()
    before = {k: v.clone() for k, v in only_model["model"].state_dict().items()}
    trainstate.load(data, only_model, include="model.*", strict=False)
    assert all(not v.equal(before[k]) for k, v in only_model["model"].state_dict().items())
    assert not only_model["optim"].state_dict()["state"]  # left alone

    no_optim = trainstate.load(data, exclude=["optim.*", "sched.*", "rng.*"])
    assert set(no_optim) == {"model", "step", "epoch"}


def test_a_checkpoint_saved_by_several_ranks_packs_and_loads(tmp_path):
    """A collective save: tensors in boxes spread over every rank's data files, assembled from the buffer."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is missing")
    import dist_workers as workers
    import ranks

    path = str(tmp_path / "c")
    ranks.ok(ranks.run(2, workers.fsdp_save, path))
    data = trainstate.pack(path)
    with trainstate.open(data) as ck:
        assert ck.world_size == 2 and len(ck.manifest.files) >= 2
        assert ck.info("model.0.weight").chunks == 2
        ck.verify()
    assert_same(trainstate.load(path), trainstate.load(data))
    assert_same(trainstate.load(path, include="model.*"), trainstate.load(data, include="model.*"))


def test_consolidate_reads_a_packed_checkpoint(tmp_path, packed):
    data, _ = packed
    trainstate.consolidate(data, tmp_path / "whole")
    assert_same(trainstate.load(data), trainstate.load(tmp_path / "whole"))


# -- what cannot be done, said clearly --------------------------------------------------------------


def test_saving_into_a_packed_checkpoint_is_refused(tmp_path, packed):
    data, file = packed
    with pytest.raises(trainstate.InvalidArgumentError, match="path or URL.*read-only: save to a directory"):
        trainstate.save(data, _state())
    with pytest.raises(trainstate.InvalidArgumentError, match="path or URL"):
        trainstate.CheckpointManager(data)
    with pytest.raises(trainstate.CheckpointExistsError, match="not a checkpoint directory"):
        trainstate.save(file, _state())
    from trainstate._storage.packed import PackedStorage

    with pytest.raises(trainstate.InvalidArgumentError, match="read-only: save to a directory, then trainstate.pack"):
        trainstate.save(tmp_path / "x", _state(), storage=PackedStorage.from_source(data))
    assert file.read_bytes() == data


def test_wrong_arguments_are_clear(tmp_path, packed):
    data, file = packed
    with pytest.raises(trainstate.InvalidArgumentError, match="storage= is for checkpoint paths"):
        trainstate.open(data, storage=trainstate.LocalStorage())
    with pytest.raises(trainstate.InvalidArgumentError, match="got int"):
        trainstate.open(42)
    with open(file, encoding="latin-1") as text, pytest.raises(trainstate.InvalidArgumentError, match="'rb'"):
        trainstate.open(text)
    with pytest.raises(trainstate.InvalidArgumentError, match="pass a directory's path as a str"):
        trainstate.open(os.fsencode(file.parent / "ckpt"))  # a bytes path is read as bytes
    with pytest.raises(trainstate.InvalidArgumentError, match="must be None, a file path or a binary file"):
        trainstate.pack(file.parent / "ckpt", 3)


# -- writing ----------------------------------------------------------------------------------------


def test_pack_to_a_file_is_atomic_and_refuses_to_replace_unless_asked(tmp_path, ckpt, packed):
    data, file = packed
    trainstate.save(tmp_path / "other", _state(2))
    with pytest.raises(trainstate.CheckpointExistsError, match="pass overwrite=True"):
        trainstate.pack(tmp_path / "other", file)
    assert file.read_bytes() == data
    trainstate.pack(tmp_path / "other", file, overwrite=True)
    assert_same(trainstate.load(file), _state(2))
    with pytest.raises(trainstate.CheckpointExistsError, match="is a directory"):
        trainstate.pack(ckpt, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left
    trainstate.pack(ckpt, tmp_path / "new" / "dir" / "m.tsar")
    assert (tmp_path / "new" / "dir" / "m.tsar").read_bytes() == data


def test_pack_into_a_file_object(tmp_path, ckpt, packed):
    data, _ = packed
    out = io.BytesIO(b"prefix")
    out.seek(0, io.SEEK_END)
    assert trainstate.pack(ckpt, out) == len(data)
    assert out.getvalue() == b"prefix" + data
    with open(tmp_path / "raw.bin", "wb", buffering=0) as raw:  # a raw file: writes may be partial
        trainstate.pack(ckpt, raw)
    assert (tmp_path / "raw.bin").read_bytes() == data


def test_a_missing_or_incomplete_checkpoint_is_not_packed(tmp_path):
    with pytest.raises(trainstate.CheckpointNotFoundError):
        trainstate.pack(tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "data-00000.safetensors").write_bytes(b"x" * 16)
    with pytest.raises(trainstate.IncompleteCheckpointError):
        trainstate.pack(tmp_path / "half", tmp_path / "half.tsar")
    assert not (tmp_path / "half.tsar").exists()


class _Big:
    def state_dict(self):
        return {f"w{i}": np.full(1 << 20, i, dtype=np.float32) for i in range(12)}  # 48 MiB in 4 MiB tensors

    def load_state_dict(self, state):
        pass


def test_pack_streams_to_a_file_and_builds_bytes_once(tmp_path):
    """Python heap peaks (tracemalloc): writing a file holds no whole file; bytes are built without a copy."""
    trainstate.save(tmp_path / "big", {"big": _Big()}, threads=2, fsync=False)
    size = sum(p.stat().st_size for p in (tmp_path / "big").iterdir())
    tracemalloc.start()
    try:
        trainstate.pack(tmp_path / "big", tmp_path / "big.tsar", fsync=False)
        to_file = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        data = trainstate.pack(tmp_path / "big")
        to_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(data) > size
    assert to_file < 4 << 20, to_file  # a few small buffers, none near a data file (24 MiB each)
    assert to_bytes < len(data) + (4 << 20), (to_bytes, len(data))  # the bytes once, not twice


# -- a packed file on disk --------------------------------------------------------------------------

_TRUNCATE_WHILE_OPEN = """
    import os, sys, trainstate
    path, how = sys.argv[1], sys.argv[2]
    with trainstate.open(path) as ck:
        os.truncate(path, os.path.getsize(path) - 4096)
        try:
            ck.read("big.w") if how == "read" else ck.verify() if how == "verify" else trainstate.load(path)
        except trainstate.CheckpointError as e:
            print(type(e).__name__, e)
"""


@pytest.mark.parametrize("how", ["read", "verify", "load"])
def test_a_packed_file_truncated_while_open_is_corrupt_not_a_crash(tmp_path, how):
    """The file is memory-mapped: touching pages past its new end would be SIGBUS. Run in a child so a
    crash shows as a failure here, not as a dead pytest."""

    class Part:
        def state_dict(self):
            return {"w": np.arange(1 << 16, dtype=np.float32)}

        def load_state_dict(self, state):
            pass

    trainstate.save(tmp_path / "c", {"big": Part()}, threads=1)
    trainstate.pack(tmp_path / "c", tmp_path / "m.tsar")
    src = str(Path(trainstate.__file__).parents[1])
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_TRUNCATE_WHILE_OPEN), str(tmp_path / "m.tsar"), how],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (-7 is SIGBUS)\n{proc.stdout}{proc.stderr}"
    assert proc.stdout.startswith("CorruptCheckpointError") and "truncated" in proc.stdout, proc.stdout


# -- the command line -------------------------------------------------------------------------------


def test_cli_packs_and_takes_the_packed_file_as_ckpt(tmp_path, ckpt, packed):
    data, _ = packed
    out = tmp_path / "cli.tsar"
    report = json.loads(cli("pack", str(ckpt), str(out), "--json").stdout)
    assert report["nbytes"] == len(data) and report["tensors"] == 3 and report["files"] == 2
    assert out.read_bytes() == data
    assert "pass --overwrite" in cli("pack", str(ckpt), str(out), code=8).stderr
    assert json.loads(cli("inspect", str(out), "--json").stdout)["tensor_count"] == 3
    assert "OK: 3 tensors" in cli("verify", str(out)).stdout
    assert "identical state" in cli("diff", str(ckpt), str(out)).stdout
    trainstate.save(tmp_path / "other", _state(2))
    trainstate.pack(tmp_path / "other", tmp_path / "other.tsar")
    assert "model.w" in cli("diff", str(out), str(tmp_path / "other.tsar"), code=1).stdout


def test_cli_verify_names_the_damaged_tensor_of_a_packed_file(tmp_path, packed):
    data, file = packed
    with trainstate.open(data) as ck:
        chunk = ck.manifest.tensors["model.w"].chunks[0]
    member = next(m for m in _index(data) if m["name"] == chunk.file)
    damaged = bytearray(data)
    damaged[member["offset"] + chunk.byte_range[0] + 1] ^= 0xFF
    file.write_bytes(damaged)
    proc = cli("verify", str(file), code=5)
    assert "model.w" in proc.stderr and len(proc.stderr.splitlines()) == 1
    with pytest.raises(trainstate.CorruptCheckpointError, match="tensor model.w"):
        trainstate.load(bytes(damaged))
