"""Manifest validation units: chunk tiling, byte-range aliasing, shape limits."""

from __future__ import annotations

import numpy as np
import pytest

import trainstate
from trainstate._format import boxes, manifest, manifest_limits


def _grid(rows: int, cols: int, dup: bool = False) -> tuple[manifest.Chunk, ...]:
    boxes = [manifest.Chunk("d", (0, 4), (r, c), (1, 1), "x") for r in range(rows) for c in range(cols)]
    if dup:
        boxes.append(manifest.Chunk("d", (0, 4), (rows // 2, cols // 2), (1, 1), "x"))
    return tuple(boxes)


def test_many_disjoint_chunks_validate_without_quadratic_blowup():
    # Counted, not timed (by the comparison budget): pairwise checking of 20,000 boxes would be 2e8 box
    # comparisons; the sweep compares each box with the boxes of its own row only (at most 100 here).
    manifest._check_disjoint("t", _grid(200, 100))
    grid = [(c.offset, c.shape) for c in _grid(200, 100)]
    assert boxes.overlap(grid, budget=0) is None  # a grid: each box one cell, told apart by its corner
    bricks = tuple(  # no grid: odd rows offset by half a brick, so the sweep compares within each row
        manifest.Chunk("d", (0, 4), (r, (r % 2) * 2 + 4 * c), (1, 4), "x") for r in range(200) for c in range(100)
    )
    manifest._check_disjoint("t", bricks)
    layout = [(c.offset, c.shape) for c in bricks]
    assert boxes.overlap(layout, budget=200 * 100 * 100) is None and boxes.overlap(layout, budget=0) == "irregular"


def _staircase(k: int) -> tuple[manifest.Chunk, ...]:
    """Chunks that tile a k x k tensor exactly once: column j from row j down, row j right of column j."""
    boxes = []
    for j in range(k):
        boxes.append(manifest.Chunk("d", (0, 4), (j, j), (k - j, 1), "x"))
        if j + 1 < k:
            boxes.append(manifest.Chunk("d", (0, 4), (j, j + 1), (1, k - j - 1), "x"))
    return tuple(boxes)


def test_an_irregular_layout_is_refused_in_bounded_time_not_swept_for_hours(monkeypatch):
    manifest._check_disjoint("t", _staircase(300))  # small: swept, and it tiles
    with pytest.raises(trainstate.CorruptCheckpointError, match="too irregularly to check"):
        manifest._check_disjoint("t", _staircase(50_000))  # n²/8 = 1.25e9 comparisons in full
    layout = [(c.offset, c.shape) for c in _staircase(300)]
    assert boxes.overlap(layout) is None and boxes.overlap(layout, budget=100) == "irregular"  # the bound


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
    assert manifest_limits.parse_cost(raw) >= peak


def test_the_checksum_is_the_first_member_whatever_fields_a_newer_minor_version_adds():
    """docs/format.md §5.1: the file begins with {"checksum":"...", and the checksum covers the bytes after it.

    A field that sorts before "checksum" (kept from a newer minor version's manifest) must not move it.
    """
    import json

    from trainstate import _checksum as checksum

    raw = manifest.Manifest(tree=None, tensors={}, files=(), extra={"aardvark": 1}).to_json_bytes()
    expected = json.loads(raw)["checksum"]
    prefix = b'{"checksum":"' + expected.encode() + b'",'
    assert raw.startswith(prefix)
    assert checksum.digest(b"{" + raw[len(prefix) :].rstrip(b"\n")) == expected
    assert manifest.parse(raw).extra == {"aardvark": 1}


@pytest.mark.parametrize("name", ["data-00000.safetensors\n", "a\nb", "", ".hidden", "a/b", "manifest.json"])
def test_data_file_names_must_match_the_pattern_in_full(name):
    with pytest.raises(trainstate.CorruptCheckpointError, match="illegal data file"):
        manifest.check_file_name(name)


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


@pytest.mark.parametrize("char", [b"{", b"[", b",", b'"', b":", b"a", "\u00e9".encode()])
def test_no_byte_costs_more_than_the_bound_that_lets_small_manifests_skip_counting(char):
    for text in (char * 999, b"\\u1234" + char * 999, "\u00e9".encode() + char * 999):
        assert manifest_limits.parse_cost(text) <= manifest_limits.MAX_COST_PER_BYTE * len(text)


def test_world_size_is_recorded_as_format_1_2_only_when_several_ranks_saved():
    """docs/format.md §3: ``world_size`` (1.2) is written for a collective save; one process omits it."""
    import json

    sharded = manifest.Manifest(tree=None, tensors={}, files=(), world_size=4).to_json_bytes()
    body = json.loads(sharded)
    assert body["world_size"] == 4 and body["format_version"] == "1.2"
    assert manifest.parse(sharded).world_size == 4
    single = manifest.Manifest(tree=None, tensors={}, files=()).to_json_bytes()
    assert "world_size" not in json.loads(single) and json.loads(single)["format_version"] == "1.0"
    assert manifest.parse(single).world_size == 1 and manifest.parse(single).extra == {}


@pytest.mark.parametrize("bad", [0, -2, "4", 2.0, True, None, 1 << 40])
def test_a_world_size_that_is_not_a_positive_integer_is_corrupt(bad):
    raw = manifest.Manifest(tree=None, tensors={}, files=(), extra={"world_size": bad}).to_json_bytes()
    with pytest.raises(trainstate.CorruptCheckpointError, match="world_size"):
        manifest.parse(raw)


def _sharded(rows: int, cols: int, ranks: int, pieced: bool) -> tuple[dict, dict[str, int]]:
    """A raw entry of a (rows, cols) F32 tensor in ``ranks`` row shards, each in its rank's file."""
    per = rows // ranks
    chunks = []
    for r in range(ranks):
        nbytes = per * cols * 4
        c = {"file": f"d{r}", "byte_range": [64, 64 + nbytes], "offset": [r * per, 0], "shape": [per, cols]}
        c["checksum"] = f"xxh3_64:{r:016x}"
        if pieced:
            c["pieces"] = {"bytes": 256, "checksums": ["p"] * -(-nbytes // 256)}
        chunks.append(c)
    t = {"dtype": "F32", "kind": "torch", "shape": [rows, cols], "chunks": chunks}
    return t, {f"d{r}": 64 + per * cols * 4 for r in range(ranks)}


def _outcome(fn, *args):
    try:
        return fn(*args)
    except trainstate.CheckpointError as e:
        return type(e).__name__
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError):
        return "CorruptCheckpointError"  # what malformed() turns it into


DAMAGE = [
    ("nothing", lambda t, s: None),
    ("a gap", lambda t, s: t["chunks"].pop(1)),
    ("an overlap", lambda t, s: t["chunks"][1]["offset"].__setitem__(0, t["chunks"][1]["offset"][0] - 1)),
    ("a box outside", lambda t, s: t["chunks"][-1]["offset"].__setitem__(0, 10**6)),
    ("a short range", lambda t, s: t["chunks"][0]["byte_range"].__setitem__(1, 65)),
    ("a range past the file", lambda t, s: s.__setitem__("d0", 70)),
    ("an unlisted file", lambda t, s: t["chunks"][2].__setitem__("file", "nope")),
    ("a bool", lambda t, s: t["chunks"][2]["shape"].__setitem__(1, True)),
    ("a float", lambda t, s: t["chunks"][2]["offset"].__setitem__(1, 0.0)),
    ("a negative", lambda t, s: t["chunks"][0]["byte_range"].__setitem__(0, -1)),
    ("a huge number", lambda t, s: t["chunks"][0]["byte_range"].__setitem__(1, 2**70)),
    ("a wrong rank", lambda t, s: t["chunks"][0]["offset"].append(0)),
    ("a transform", lambda t, s: t["chunks"][0].__setitem__("transforms", [])),
    ("an unknown transform", lambda t, s: t["chunks"][0].__setitem__("transforms", [{"name": "brotli"}])),
    ("a missing checksum", lambda t, s: t["chunks"][3].pop("checksum")),
    ("a checksum number", lambda t, s: t["chunks"][3].__setitem__("checksum", 5)),
    ("a chunk list", lambda t, s: t["chunks"].__setitem__(0, [])),
    ("a bad dtype", lambda t, s: t.__setitem__("dtype", "F99")),
    ("a shape of zero and huge", lambda t, s: t.__setitem__("shape", [0, 2**47, 2**47])),
    ("bad pieces", lambda t, s: t["chunks"][0].__setitem__("pieces", {"bytes": 256, "checksums": []})),
    (
        "extra piece members",
        lambda t, s: t["chunks"][0].__setitem__("pieces", {"bytes": 10**9, "checksums": ["p"], "x": 1}),
    ),
]


@pytest.mark.parametrize("pieced", [False, True])
@pytest.mark.parametrize("what, damage", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_the_column_check_of_sharded_entries_agrees_with_the_full_one(what, damage, pieced):
    import copy

    t, sizes = _sharded(16, 8, 8, pieced)
    damage(t, sizes)
    full = _outcome(manifest._checked_entry, "t", copy.deepcopy(t), sizes)
    fast = _outcome(manifest._sharded_entry, copy.deepcopy(t), sizes)
    assert fast is None or fast == full  # None: the general path decides
    assert _outcome(manifest.tensor_entry, "t", t, sizes) == full
    if what == "nothing":
        assert fast is not None


def test_byte_counts_of_a_large_manifest_match_bytes_count():
    alphabet = np.frombuffer(b'{}[],":ab\\u', dtype=np.uint8)
    raw = np.random.default_rng(0).choice(alphabet, 3 << 20).tobytes()
    assert manifest_limits._counts(raw, b'{[,":') == [raw.count(bytes([c])) for c in b'{[,":']
