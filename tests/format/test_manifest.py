"""Manifest validation units: chunk tiling, byte-range aliasing, shape limits."""

from __future__ import annotations

import time

import pytest

import trainstate
from trainstate._format import manifest


def _grid(rows: int, cols: int, dup: bool = False) -> tuple[manifest.Chunk, ...]:
    boxes = [manifest.Chunk("d", (0, 4), (r, c), (1, 1), "x") for r in range(rows) for c in range(cols)]
    if dup:
        boxes.append(manifest.Chunk("d", (0, 4), (rows // 2, cols // 2), (1, 1), "x"))
    return tuple(boxes)


def test_many_disjoint_chunks_validate_without_quadratic_blowup():
    chunks = _grid(200, 100)  # 20,000 boxes: pairwise checking would be 2e8 comparisons
    start = time.perf_counter()
    manifest._check_disjoint("t", chunks)
    assert time.perf_counter() - start < 5.0  # a generous bound: this guards against a hang, not speed


@pytest.mark.parametrize("rows, cols", [(50, 1), (1, 50), (7, 9)])
def test_an_overlapping_chunk_is_found(rows, cols):
    with pytest.raises(trainstate.CorruptCheckpointError, match="overlap"):
        manifest._check_disjoint("t", _grid(rows, cols, dup=True))


def test_byte_ranges_must_not_be_shared():
    raw = {
        "a": {"chunks": [{"file": "f", "byte_range": [8, 72]}]},
        "b": {"chunks": [{"file": "f", "byte_range": [64, 128]}]},
    }
    with pytest.raises(trainstate.CorruptCheckpointError, match="share bytes"):
        manifest._check_byte_ranges(raw)
    raw["b"]["chunks"][0]["byte_range"] = [72, 128]
    manifest._check_byte_ranges(raw)  # back to back is fine
    raw["c"] = {"chunks": [{"file": "f", "byte_range": [72, 72]}]}  # empty tensors take no bytes
    manifest._check_byte_ranges(raw)


@pytest.mark.parametrize("shape", [[0, 2**63], [0] * 65, [2**40, 2**40], [-1]])
def test_implausible_shapes_are_refused(shape):
    with pytest.raises(trainstate.CorruptCheckpointError):
        manifest._shape(shape, "t.shape")


def _repeat(unit: bytes, nbytes: int = 300_000) -> bytes:
    return b"[" + unit * (nbytes // len(unit)) + b"0]"


PARSE_SHAPES = {
    "empty lists": _repeat(b"[],"),
    "empty dicts": _repeat(b"{},"),
    "nested lists": _repeat(b"[[[]]],"),
    "one-item lists": _repeat(b"[0],"),
    "one-key dicts": _repeat(b'{"a":[]},'),
    "six-key dicts": _repeat(b'{"a":0,"b":0,"c":0,"d":0,"e":0,"f":0},'),
    "short strings": _repeat(b'"ab",'),
    "ints": _repeat(b"257,"),
    "floats": _repeat(b"1.5,"),
    "literals": _repeat(b"true,"),
    "unique keys": b"{" + b",".join(b'"%d":[]' % i for i in range(30_000)) + b"}",
    "astral escapes": _repeat(b'"\\ud83d\\ude00' + b"a" * 200 + b'",'),
    "raw UTF-8": _repeat('"\U0001f600'.encode() + b"a" * 200 + b'",'),
    "tree nodes": _repeat(b'[0,{"t":"list","v":[]}],'),
}


@pytest.mark.parametrize("shape", PARSE_SHAPES)
def test_parse_cost_bounds_what_json_loads_allocates(shape):
    import json
    import tracemalloc

    raw = PARSE_SHAPES[shape]
    tracemalloc.start()
    try:
        parsed = json.loads(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del parsed
    assert manifest.parse_cost(raw) >= peak


def test_the_fast_entry_check_agrees_with_the_full_one(tmp_path, training_state, monkeypatch):
    import json

    from trainstate._save import write

    monkeypatch.setattr(write, "PIECE_BYTES", 256)  # the small training state gets pieced tensors too
    trainstate.save(tmp_path / "c", training_state)
    body = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    sizes = {f["path"]: f["size"] for f in body["files"]}
    fast = {name: manifest._plain_entry(t, sizes) for name, t in body["tensors"].items()}
    assert all(e is not None for e in fast.values())
    assert any(e.chunks[0].pieces for e in fast.values())
    assert fast == {name: manifest._checked_entry(name, t, sizes) for name, t in body["tensors"].items()}
