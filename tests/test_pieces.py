"""Large tensors are checked and copied a piece at a time (format 1.1 ``pieces``): what lands when a piece
is damaged, old manifests without pieces, a tensor split across reader threads, truncation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import trainstate
from helpers import reseal_manifest
from trainstate._restore import files
from trainstate._save.files import PIECE_BYTES

FLOATS_PER_PIECE = PIECE_BYTES // 4


def _big(pieces: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(int(pieces * FLOATS_PER_PIECE)).astype(np.float32)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "c"
    trainstate.save(path, {"w": _big(3.5), "b": np.arange(10, dtype=np.int64)}, threads=1)
    return path


def _chunk(path: Path, name: str = "w") -> dict:
    return json.loads((path / "manifest.json").read_bytes())["tensors"][name]["chunks"][0]


def _flip(path: Path, chunk: dict, at: int) -> None:
    data = path / chunk["file"]
    raw = bytearray(data.read_bytes())
    raw[chunk["byte_range"][0] + at] ^= 0x10
    data.write_bytes(bytes(raw))


def test_large_tensors_carry_pieces_and_declare_format_1_1(ckpt, tmp_path):
    body = json.loads((ckpt / "manifest.json").read_bytes())
    pieces = body["tensors"]["w"]["chunks"][0]["pieces"]
    assert body["format_version"] == "1.1"
    assert pieces["bytes"] == PIECE_BYTES and len(pieces["checksums"]) == 4  # 1 + 1 + 1 + 0.5 MiB
    assert "pieces" not in body["tensors"]["b"]["chunks"][0]  # one piece or less: the whole checksum says it all
    trainstate.save(tmp_path / "small", {"b": np.arange(10)})
    assert json.loads((tmp_path / "small" / "manifest.json").read_bytes())["format_version"] == "1.0"


def test_a_damaged_piece_never_lands_and_exactly_the_pieces_before_it_do(ckpt):
    """One reader thread: pieces 1 and 2 of 4 are verified and copied, piece 3 is damaged and stops the
    read, so it and piece 4 keep the target's own bytes; the error names the tensor and the piece."""
    saved = _big(3.5)
    _flip(ckpt, _chunk(ckpt), 2 * PIECE_BYTES + 12345)  # inside the third piece
    target = {"w": np.full_like(saved, 7.0), "b": np.zeros(10, dtype=np.int64)}
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"(?s)tensor w .*piece 3 of 4.*partly restored"):
        trainstate.load(ckpt, target, threads=1)
    cut = 2 * FLOATS_PER_PIECE
    assert np.array_equal(target["w"][:cut], saved[:cut])
    assert bool((target["w"][cut:] == 7.0).all())


def test_with_several_threads_a_damaged_piece_still_never_lands(ckpt):
    _flip(ckpt, _chunk(ckpt), 2 * PIECE_BYTES + 7)
    for threads in (2, 3, 8):
        target = {"w": np.full(int(3.5 * FLOATS_PER_PIECE), 7.0, dtype=np.float32), "b": np.zeros(10, dtype=np.int64)}
        with pytest.raises(trainstate.CorruptCheckpointError, match="piece 3 of 4"):
            trainstate.load(ckpt, target, threads=threads)
        assert bool((target["w"][2 * FLOATS_PER_PIECE : 3 * FLOATS_PER_PIECE] == 7.0).all()), threads


def test_open_read_and_verify_check_pieces(ckpt):
    _flip(ckpt, _chunk(ckpt), PIECE_BYTES + 1)
    with trainstate.open(ckpt) as ck:
        with pytest.raises(trainstate.CorruptCheckpointError, match="piece 2 of 4"):
            ck.read("w")
        with pytest.raises(trainstate.CorruptCheckpointError, match="piece 2 of 4"):
            ck.read_into("w", np.empty(int(3.5 * FLOATS_PER_PIECE), dtype=np.float32))
        with pytest.raises(trainstate.CorruptCheckpointError, match="tensor w"):
            ck.verify()


def test_manifests_without_pieces_still_verify_by_whole_chunk(ckpt):
    """A 1.0 manifest (an older trainstate's) has one checksum per chunk: still checked before any byte lands."""

    def as_1_0(body):
        body["format_version"] = "1.0"
        for t in body["tensors"].values():
            for c in t["chunks"]:
                c.pop("pieces", None)

    reseal_manifest(ckpt, as_1_0)
    assert trainstate.load(ckpt)["w"].tobytes() == _big(3.5).tobytes()
    with trainstate.open(ckpt) as ck:
        assert ck.manifest.tensors["w"].chunks[0].pieces is None
        ck.verify()
    _flip(ckpt, _chunk(ckpt), 3 * PIECE_BYTES + 5)  # in the last MiB: the whole chunk is checked first
    target = {"w": np.full(int(3.5 * FLOATS_PER_PIECE), 7.0, dtype=np.float32), "b": np.zeros(10, dtype=np.int64)}
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"tensor w \(data-00000") as info:
        trainstate.load(ckpt, target, threads=1)
    assert "piece" not in str(info.value).split("\n")[0]
    assert bool((target["w"] == 7.0).all())  # one checksum for the chunk: nothing of it lands


def test_verify_also_checks_the_whole_chunk_checksum_an_older_reader_uses(ckpt):
    reseal_manifest(ckpt, lambda b: b["tensors"]["w"]["chunks"][0].update(checksum="xxh3_64:0000000000000000"))
    assert trainstate.load(ckpt)["w"].tobytes() == _big(3.5).tobytes()  # the pieces are right
    with trainstate.open(ckpt) as ck, pytest.raises(trainstate.CorruptCheckpointError, match="tensor w"):
        ck.verify()  # but a 1.0 reader would refuse it


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p["checksums"].pop(), "do not cover"),
        (lambda p: p.update(bytes=0), "do not cover"),
        (lambda p: p.update(bytes=True), "should be int"),
        (lambda p: p["checksums"].__setitem__(0, 5), "not a string"),
        (lambda p: p.pop("checksums"), "malformed"),
    ],
)
def test_malformed_pieces_are_refused(ckpt, edit, message):
    reseal_manifest(ckpt, lambda b: edit(b["tensors"]["w"]["chunks"][0]["pieces"]))
    with pytest.raises(trainstate.CorruptCheckpointError, match=message):
        trainstate.load(ckpt)


def test_a_lying_piece_checksum_is_caught(ckpt):
    reseal_manifest(
        ckpt, lambda b: b["tensors"]["w"]["chunks"][0]["pieces"]["checksums"].__setitem__(3, "xxh3_64:" + "0" * 16)
    )
    with pytest.raises(trainstate.CorruptCheckpointError, match="piece 4 of 4"):
        trainstate.load(ckpt)


def test_one_large_tensor_is_split_across_reader_threads_and_restores_exactly(tmp_path, monkeypatch):
    saved = _big(6.25, seed=3)
    trainstate.save(tmp_path / "c", {"w": saved}, threads=1)
    lanes: list[list[int]] = []
    original = files._split_by_bytes

    def spy(jobs, sizes, n):  # the lanes the reader cut: pieces (by size) per lane
        out = original(jobs, sizes, n)
        size_of = {id(job): size for job, size in zip(jobs, sizes)}
        lanes[:] = [[size_of[id(job)] for job in lane] for lane in out]
        return out

    monkeypatch.setattr(files, "_split_by_bytes", spy)
    for threads in (1, 2, 3):
        target = {"w": np.zeros_like(saved)}
        trainstate.load(tmp_path / "c", target, threads=threads)
        assert target["w"].tobytes() == saved.tobytes()
        assert len(lanes) == threads and sum(map(len, lanes)) == 7, lanes  # 7 pieces over `threads` lanes
        assert max(map(sum, lanes)) <= saved.nbytes / threads + PIECE_BYTES  # about equal bytes each


def test_pieces_survive_torch_casts_and_non_contiguous_targets(tmp_path):
    torch = pytest.importorskip("torch")
    saved = torch.from_numpy(_big(2.5, seed=5)).reshape(-1, 256)
    trainstate.save(tmp_path / "c", {"w": saved, "v": saved.clone()})
    cast = torch.zeros(saved.shape, dtype=torch.float64)
    strided = torch.zeros(saved.shape[1], saved.shape[0]).t()  # not contiguous: read through a host buffer
    trainstate.load(tmp_path / "c", {"w": cast, "v": strided}, strict=False)
    assert torch.equal(cast, saved.double()) and torch.equal(strided, saved)


_TRUNCATE = """
import os, sys
import numpy as np
import trainstate

path = sys.argv[1]
ck = trainstate.open(path)
os.truncate(os.path.join(path, "data-00000.safetensors"), 2 << 20)  # inside the big tensor's third piece
try:
    ck.load() if sys.argv[2] == "load" else ck.read("w")
except trainstate.CorruptCheckpointError as e:
    print("CorruptCheckpointError:", e)
    sys.exit(0)
print("no error")
sys.exit(3)
"""


@pytest.mark.parametrize("how", ["load", "read"])
def test_a_file_truncated_under_a_pieced_tensor_is_an_error_not_sigbus(tmp_path, how):
    path = tmp_path / "c"
    trainstate.save(path, {"w": _big(3.5)}, threads=1)
    src = str(Path(trainstate.__file__).parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    code = textwrap.dedent(_TRUNCATE)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), how], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (-7 is SIGBUS)\n{proc.stdout}{proc.stderr}"
    assert "truncated" in proc.stdout, proc.stdout


def test_any_piece_size_round_trips_a_training_state(tmp_path, monkeypatch, training_state):
    from helpers import assert_same, fresh_like
    from trainstate._save import write

    for piece in (8, 100, 4096):  # pieces smaller than the small-tensor write buffer, odd sizes, several per tensor
        monkeypatch.setattr(write, "PIECE_BYTES", piece)
        path = tmp_path / f"c{piece}"
        trainstate.save(path, training_state)
        with trainstate.open(path) as ck:
            assert any(ck.manifest.tensors[n].chunks[0].pieces for n in ck.keys())
            ck.verify()
        target = fresh_like()
        trainstate.load(path, target)
        assert_same(training_state["optim"].state_dict()["state"], target["optim"].state_dict()["state"])
        assert all((a == b).all() for a, b in zip(training_state["model"].parameters(), target["model"].parameters()))


def test_a_tied_tensor_is_read_once_into_shared_memory_and_into_each_of_separate_ones(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    saved = torch.from_numpy(_big(2.5, seed=7))
    model = torch.nn.Module()  # weights tied as in a language model's embedding and output layer
    model.a = model.b = torch.nn.Parameter(saved.clone())
    trainstate.save(tmp_path / "c", {"m": model})  # stored once, named twice in the tree
    read_bytes: list[int] = []
    original = files._run_batch

    def spy(files, batch, verify):
        read_bytes.append(batch.end - batch.begin)
        return original(files, batch, verify)

    monkeypatch.setattr(files, "_run_batch", spy)
    with torch.no_grad():
        model.a.zero_()
    trainstate.load(tmp_path / "c", {"m": model})
    assert sum(read_bytes) == saved.nbytes and torch.equal(model.a, saved) and model.a is model.b
    read_bytes.clear()
    untied = torch.nn.Module()
    untied.a, untied.b = torch.nn.Parameter(torch.zeros_like(saved)), torch.nn.Parameter(torch.zeros_like(saved))
    trainstate.load(tmp_path / "c", {"m": untied})
    assert sum(read_bytes) == 2 * saved.nbytes
    assert torch.equal(untied.a, saved) and torch.equal(untied.b, saved)
