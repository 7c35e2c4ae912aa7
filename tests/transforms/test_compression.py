"""Compression (``compression="zstd"``) the way users meet it: save, load, read one tensor, damage, resume.

Tensors are small; a tensor "cut into several chunks" uses a smaller chunk size (the rule is the same at
4 MiB). Damage is done to real files on disk, and the manager test runs a real background save.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import trainstate
import trainstate._transforms as transforms
from helpers import assert_same, cli, reseal_manifest
from trainstate import _checksum as checksum
from trainstate._format import dtypes

pytest.importorskip("zstandard")


def _all_dtypes() -> dict[str, np.ndarray]:
    """One compressible tensor of every dtype code, plus 0-d and empty ones."""
    pattern = np.tile(np.arange(32, dtype=np.uint8), 512)  # 16 KiB that zstd shrinks
    out = {}
    for code, dt in dtypes.BY_CODE.items():
        raw = pattern % 2 if code == "BOOL" else pattern
        out[code] = np.frombuffer(raw.tobytes(), dtype=dt.numpy).reshape(8, -1)
    out["zero_d"] = np.array(3.5, dtype=np.float32)
    out["scalar"] = np.float64(-1.25)
    out["empty"] = np.zeros((0, 7), dtype=np.int16)
    out["empty_bf16"] = np.zeros((3, 0), dtype=ml_dtypes.bfloat16)
    return out


def _chunks(path: Path, name: str) -> list[dict]:
    return json.loads((path / "manifest.json").read_bytes())["tensors"][name]["chunks"]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Chunks of 64 KiB, so a tensor of a few hundred KB is cut into several."""
    monkeypatch.setattr(transforms, "TRANSFORM_CHUNK_BYTES", 64 << 10)
    return 64 << 10


def test_every_dtype_round_trips_compressed(tmp_path: Path) -> None:
    state = {"t": _all_dtypes(), "step": 3}
    trainstate.save(tmp_path / "c", state, compression="zstd")
    assert_same(trainstate.load(tmp_path / "c"), state)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    assert manifest["format_version"] == "1.3"
    for code in dtypes.BY_CODE:  # every one of them compressed, with the raw bytes' checksum
        (chunk,) = manifest["tensors"][f"t.{code}"]["chunks"]
        assert chunk["transforms"][0]["name"] == "zstd", code
        raw = np.ascontiguousarray(state["t"][code]).tobytes()
        assert chunk["transforms"][0]["raw_checksum"] == checksum.digest(raw)
    for small in ("zero_d", "scalar", "empty", "empty_bf16"):  # nothing to gain: stored raw
        assert "transforms" not in manifest["tensors"][f"t.{small}"]["chunks"][0]
    with trainstate.open(tmp_path / "c") as ck:
        ck.verify()


def test_torch_state_round_trips_into_live_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from helpers import fresh_like, make_training_state

    state = make_training_state(steps=3)
    state["big"] = torch.arange(300_000, dtype=torch.float32).reshape(300, 1000) % 5  # several 4 MiB chunks? one
    trainstate.save(tmp_path / "c", state, compression="zstd:1")
    target = fresh_like()
    target["big"] = torch.zeros(300, 1000)
    trainstate.load(tmp_path / "c", target)
    assert_same(target["model"].state_dict(), state["model"].state_dict())
    assert_same(target["optim"].state_dict()["state"], state["optim"].state_dict()["state"])
    assert torch.equal(target["big"], state["big"])
    with trainstate.open(tmp_path / "c") as ck:
        assert torch.equal(ck.read("big", framework="torch"), state["big"])


def test_a_chunk_that_does_not_pay_is_stored_raw(tmp_path: Path, small_chunks: int) -> None:
    noise = np.random.default_rng(0).integers(0, 256, 3 * small_chunks, dtype=np.uint8)
    mixed = np.concatenate([noise[:small_chunks], np.zeros(small_chunks, np.uint8), noise[small_chunks:]])
    state = {"noise": noise, "mixed": mixed.reshape(4, -1)}
    trainstate.save(tmp_path / "c", state, compression="zstd")
    assert all("transforms" not in c for c in _chunks(tmp_path / "c", "noise"))
    assert [bool(c.get("transforms")) for c in _chunks(tmp_path / "c", "mixed")] == [False, True, False, False]
    assert_same(trainstate.load(tmp_path / "c"), state)
    with trainstate.open(tmp_path / "c") as ck:
        ck.verify()
        assert_same(np.asarray(ck.read("mixed")), state["mixed"])


def test_a_large_tensor_is_cut_into_chunks_and_one_tensor_reads_alone(tmp_path: Path, small_chunks: int) -> None:
    big = (np.arange(200_000, dtype=np.float32) % 11).reshape(500, 400)  # 800 KB: 13 chunks of 160 rows' worth
    wide = (np.arange(2 * 3 * 40_000, dtype=np.int32) % 3).reshape(2, 3, 40_000)  # one row holds 480 KB
    other = np.ones(50_000, dtype=np.float64)
    trainstate.save(tmp_path / "c", {"big": big, "wide": wide, "other": other}, compression="zstd")
    chunks = _chunks(tmp_path / "c", "big")
    assert len(chunks) == 13 and all(c["shape"][1] == 400 for c in chunks)
    assert all(c["shape"][:2] == [1, 1] for c in _chunks(tmp_path / "c", "wide"))  # cut along the last dim
    # Damage every byte that is not "big"'s: reading "big" alone still works, so it read nothing else.
    own = {(c["file"], *c["byte_range"]) for c in chunks}
    for name in ("wide", "other"):
        for c in _chunks(tmp_path / "c", name):
            assert (c["file"], *c["byte_range"]) not in own
            data = bytearray((tmp_path / "c" / c["file"]).read_bytes())
            data[c["byte_range"][0] : c["byte_range"][1]] = bytes(c["byte_range"][1] - c["byte_range"][0])
            (tmp_path / "c" / c["file"]).write_bytes(bytes(data))
    with trainstate.open(tmp_path / "c") as ck:
        assert_same(np.asarray(ck.read("big")), big)
        out = np.empty_like(big)
        ck.read_into("big", out)
        assert_same(out, big)
        with pytest.raises(trainstate.CorruptCheckpointError):
            ck.read("wide")


def _flip(path: Path, name: str, index: int) -> dict:
    c = _chunks(path, name)[index]
    data = bytearray((path / c["file"]).read_bytes())
    data[(c["byte_range"][0] + c["byte_range"][1]) // 2] ^= 0x40
    (path / c["file"]).write_bytes(bytes(data))
    return c


def test_a_flipped_byte_in_a_compressed_chunk_lands_nothing(tmp_path: Path, small_chunks: int) -> None:
    state = {"w": (np.arange(100_000, dtype=np.float32) % 9).reshape(250, 400), "b": np.zeros(4000)}
    trainstate.save(tmp_path / "c", state, compression="zstd")
    assert len(_chunks(tmp_path / "c", "b")) == 1
    _flip(tmp_path / "c", "b", 0)
    damaged = _flip(tmp_path / "c", "w", 2)
    assert damaged["transforms"][0]["name"] == "zstd"
    target = {"w": np.full((250, 400), -1.0, np.float32), "b": np.full(4000, -1.0)}
    with pytest.raises(trainstate.CorruptCheckpointError, match="checksum mismatch"):
        trainstate.load(tmp_path / "c", target, include="b")
    assert (target["b"] == -1).all()  # not one byte of the damaged chunk landed
    with pytest.raises(trainstate.CorruptCheckpointError, match="checksum mismatch"):
        trainstate.load(tmp_path / "c", target, include="w", threads=1)
    rows = slice(damaged["offset"][0], damaged["offset"][0] + damaged["shape"][0])
    assert (target["w"][rows] == -1).all()  # the damaged chunk's box: untouched
    with trainstate.open(tmp_path / "c") as ck, pytest.raises(trainstate.CorruptCheckpointError):
        ck.verify()


def test_a_wrong_raw_checksum_is_caught_after_decompressing(tmp_path: Path) -> None:
    trainstate.save(tmp_path / "c", {"w": np.zeros(10_000)}, compression="zstd")
    reseal_manifest(
        tmp_path / "c",
        lambda b: b["tensors"]["w"]["chunks"][0]["transforms"][0].update(raw_checksum="xxh3_64:0123456789abcdef"),
    )
    target = {"w": np.full(10_000, 7.0)}
    with pytest.raises(trainstate.CorruptCheckpointError, match="decoded"):
        trainstate.load(tmp_path / "c", target)
    assert (target["w"] == 7.0).all()
    with trainstate.open(tmp_path / "c") as ck, pytest.raises(trainstate.CorruptCheckpointError, match="decoded"):
        ck.verify()


def test_a_frame_that_lies_about_its_size_is_refused_before_decompressing(tmp_path: Path) -> None:
    """Another valid frame, for a larger tensor, in the chunk's place: its stored checksum is resealed too."""
    import zstandard

    trainstate.save(tmp_path / "c", {"w": np.zeros(1000)}, compression="zstd")
    (chunk,) = _chunks(tmp_path / "c", "w")
    lie = zstandard.ZstdCompressor().compress(bytes(64 << 20))  # says 64 MiB
    data = bytearray((tmp_path / "c" / chunk["file"]).read_bytes())
    begin, end = chunk["byte_range"]
    assert len(lie) > end - begin
    data[begin:end] = lie[: end - begin]  # a truncated frame: its header still declares 1 GiB
    (tmp_path / "c" / chunk["file"]).write_bytes(bytes(data))

    def edit(b: dict) -> None:
        b["tensors"]["w"]["chunks"][0]["checksum"] = checksum.digest(bytes(data[begin:end]))

    reseal_manifest(tmp_path / "c", edit)
    with pytest.raises(trainstate.CorruptCheckpointError, match="says 67108864 bytes"):
        trainstate.load(tmp_path / "c")


def test_an_unknown_transform_is_a_format_version_error_naming_it(tmp_path: Path) -> None:
    trainstate.save(tmp_path / "c", {"w": np.zeros(1000)}, compression="zstd")
    reseal_manifest(tmp_path / "c", lambda b: b["tensors"]["w"]["chunks"][0]["transforms"].append({"name": "xor-2099"}))
    with trainstate.open(tmp_path / "c") as ck:  # opening reads no tensor
        with pytest.raises(trainstate.FormatVersionError, match="xor-2099"):
            ck.read("w")


def test_without_zstandard_compression_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainstate.save(tmp_path / "c", {"w": np.zeros(1000)}, compression="zstd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now fails, as when not installed
    with pytest.raises(trainstate.MissingDependencyError, match=r'pip install "trainstate\[zstd\]"'):
        trainstate.save(tmp_path / "d", {"w": np.zeros(1000)}, compression="zstd")
    assert not (tmp_path / "d").exists()
    with pytest.raises(trainstate.MissingDependencyError, match=r'pip install "trainstate\[zstd\]"'):
        trainstate.load(tmp_path / "c")


@pytest.mark.parametrize("bad", ["gzip", "zstd:99", "zstd:", "zstd:x", 3, True])
def test_a_bad_compression_argument_is_refused(tmp_path: Path, bad: object) -> None:
    with pytest.raises(trainstate.InvalidArgumentError, match="compression"):
        trainstate.save(tmp_path / "c", {"w": np.zeros(3)}, compression=bad)  # type: ignore[arg-type]
    with pytest.raises(trainstate.InvalidArgumentError, match="compression"):
        trainstate.CheckpointManager(tmp_path / "run", compression=bad)  # type: ignore[arg-type]


def test_manager_async_saves_compressed_and_resumes(tmp_path: Path) -> None:
    state = {"w": np.zeros((100, 100), np.float32), "step": 0}
    with trainstate.CheckpointManager(
        tmp_path / "run", every_steps=1, async_save=True, compression="zstd", keep_last=2
    ) as mgr:
        for step in range(1, 4):
            state["w"][step] = step
            state["step"] = step
            mgr.save(step, state)
        mgr.wait()
        assert [r.background for r in mgr.history()] == [True, True, True]
    newest = tmp_path / "run" / "step_00000003"
    assert _chunks(newest, "w")[0]["transforms"][0]["name"] == "zstd"
    fresh = {"w": np.zeros((100, 100), np.float32), "step": -1}
    with trainstate.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        assert mgr.restore_latest(fresh) == 4  # the step to run next
    assert_same(fresh, state)


def test_consolidate_export_and_average_read_compressed_sources(tmp_path: Path) -> None:
    a = {"model": {"w": np.full((64, 64), 2.0, np.float32)}, "step": 1}
    b = {"model": {"w": np.full((64, 64), 4.0, np.float32)}, "step": 2}
    trainstate.save(tmp_path / "a", a, compression="zstd")
    trainstate.save(tmp_path / "b", b, compression="zstd")
    trainstate.consolidate(tmp_path / "a", tmp_path / "plain")
    assert "transforms" not in _chunks(tmp_path / "plain", "model.w")[0]  # uncompressed unless asked
    trainstate.consolidate(tmp_path / "a", tmp_path / "packed", compression="zstd:9")
    assert _chunks(tmp_path / "packed", "model.w")[0]["transforms"][0]["name"] == "zstd"
    for out in ("plain", "packed"):
        assert_same(trainstate.load(tmp_path / out), a)
    trainstate.average([tmp_path / "a", tmp_path / "b"], tmp_path / "mean")
    assert (trainstate.load(tmp_path / "mean")["model"]["w"] == 3.0).all()
    trainstate.export(tmp_path / "a", tmp_path / "w.safetensors", format="safetensors", select="model.*")
    from safetensors.numpy import load_file

    assert (next(iter(load_file(tmp_path / "w.safetensors").values())) == 2.0).all()


def test_inspect_shows_transforms_and_stored_size(tmp_path: Path) -> None:
    trainstate.save(tmp_path / "c", {"w": np.zeros((512, 512)), "b": np.arange(3.0)}, compression="zstd")
    text = cli("inspect", str(tmp_path / "c")).stdout
    assert "zstd" in text and "stored" in text and "smaller" in text
    doc = json.loads(cli("inspect", str(tmp_path / "c"), "--json").stdout)
    assert isinstance(doc, dict) and doc["transforms"] == ["zstd"]
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["w"]["transforms"] == ["zstd"] and tensors["w"]["stored_nbytes"] < tensors["w"]["nbytes"] // 100
    assert tensors["b"]["transforms"] == [] and tensors["b"]["stored_nbytes"] == 24
    cli("verify", str(tmp_path / "c"))


def test_the_raw_checksum_of_every_chunk_is_known_to_the_writer_and_after_reopening(tmp_path: Path) -> None:
    """What incremental saves build on: each chunk's raw bytes' checksum, fresh from the writer and read back."""
    from trainstate._save import encode_state, save_options
    from trainstate._save.write import write_data
    from trainstate._storage import LocalStorage

    state = {"w": np.zeros(5000), "noise": np.random.default_rng(1).random(100)}
    snapshot = encode_state(state)
    (tmp_path / "d").mkdir()
    options = save_options(fsync=False, threads=1, compression="zstd")
    groups = [snapshot.entries]
    _, tensors = write_data(
        LocalStorage(), str(tmp_path / "d"), snapshot.entries, groups, ["data-00000.safetensors"], options
    )
    for name, value in state.items():
        (chunk,) = tensors[name].chunks
        assert transforms.raw_checksum(chunk) == checksum.digest(value.tobytes())
    trainstate.save(tmp_path / "c", state, compression="zstd")
    with trainstate.open(tmp_path / "c") as ck:
        for name, value in state.items():
            (chunk,) = ck.manifest.tensors[name].chunks
            assert transforms.raw_checksum(chunk) == checksum.digest(value.tobytes())


def test_a_packed_compressed_checkpoint_loads_from_memory(tmp_path: Path) -> None:
    state = {"w": (np.arange(40_000, dtype=np.float32) % 4).reshape(200, 200), "step": 2}
    trainstate.save(tmp_path / "c", state, compression="zstd")
    blob = trainstate.pack(tmp_path / "c")
    assert_same(trainstate.load(blob), state)
    trainstate.save(tmp_path / "d", {**state, "step": 3}, compression="zstd")
    assert cli("diff", str(tmp_path / "c"), str(tmp_path / "d"), code=1).stdout


@pytest.mark.parametrize(
    "name, box",
    [("w", ((100, 50), (200, 100))), ("x", ((1, 1, 1000), (1, 2, 3000))), ("x", ((0, 0, 4999), (2, 3, 1)))],
)
def test_a_box_of_a_compressed_tensor_reads_across_its_chunks(tmp_path: Path, name: str, box: tuple) -> None:
    """What a sharded target (a DTensor's local part) asks for: a box that cuts through several chunks."""
    from trainstate._restore.read import read_views

    state = {
        "w": (np.arange(400 * 300, dtype=np.float64) % 13).reshape(400, 300),
        "x": (np.arange(2 * 3 * 5000, dtype=np.int16) % 7).reshape(2, 3, 5000),
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transforms, "TRANSFORM_CHUNK_BYTES", 16 << 10)
        trainstate.save(tmp_path / "c", state, compression="zstd")
    out = np.zeros(box[1], state[name].dtype)
    with trainstate.open(tmp_path / "c") as ck:
        assert len(ck.manifest.tensors[name].chunks) > 4
        read_views(ck, [(name, out.reshape(-1).view(np.uint8).data, box)], verify=True, threads=2)
    assert_same(out, state[name][tuple(slice(o, o + s) for o, s in zip(*box))])


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc/self/statm")
def test_a_compressed_save_to_disk_holds_chunks_not_files(tmp_path: Path) -> None:
    """Streaming: memory stays near a chunk per writer thread while 48 MB are compressed (they shrink ~10%)."""
    import os
    import threading

    page = os.sysconf("SC_PAGE_SIZE")

    def anonymous() -> int:  # resident minus file-backed pages: what the process itself holds
        fields = Path("/proc/self/statm").read_text().split()
        return (int(fields[1]) - int(fields[2])) * page

    rng = np.random.default_rng(0)
    state = {f"t{i}": rng.random(4 << 20, dtype=np.float32) for i in range(3)}
    trainstate.save(tmp_path / "warm", {"x": np.zeros(1000)}, compression="zstd:1")
    base = peak = anonymous()
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, anonymous())
            done.wait(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        trainstate.save(tmp_path / "c", state, compression="zstd:1", fsync=False)
    finally:
        done.set()
        watcher.join()
    stored = sum(p.stat().st_size for p in (tmp_path / "c").iterdir())
    assert stored > 40e6  # compressed, but barely: holding the chunks would show
    assert peak - base < 24e6, f"{(peak - base) / 1e6:.1f} MB held while saving"


@pytest.mark.parametrize("operation", ["create", "write", "fsync", "rename"])
def test_every_failing_storage_call_of_a_compressed_save_leaves_a_whole_checkpoint(
    tmp_path: Path, operation: str
) -> None:
    """The header rewrite is one more write and fsync: failing any call, in turn, leaves nothing behind and
    a whole checkpoint in place (the old one; the new one where only the last fsync, after the commit, failed)."""
    import errno

    from trainstate._storage.faulty import FaultyStorage

    old = {"w": np.zeros((300, 300)), "b": np.arange(10.0)}
    new = {"w": np.ones((300, 300)), "b": np.arange(10.0) + 1}
    trainstate.save(tmp_path / "c", old, compression="zstd")
    for at in range(1, 50):
        faulty = FaultyStorage(operation, at=at, error=errno.EIO)
        try:
            trainstate.save(tmp_path / "c", new, compression="zstd", overwrite=True, storage=faulty)
        except trainstate.StorageError:
            loaded = trainstate.load(tmp_path / "c")  # whole: the old one, or the new one if only the fsync
            assert loaded["w"][0, 0] in (0.0, 1.0)  # of the directory after the commit failed
            assert_same(loaded, old if loaded["w"][0, 0] == 0.0 else new)
            assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no staging directory left
            continue
        assert not faulty.fired  # it got through: every call of the save succeeded
        break
    assert_same(trainstate.load(tmp_path / "c"), new)
