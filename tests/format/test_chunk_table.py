"""The columnar tensor table renders the same manifest bytes as the per-chunk objects it stands for."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trainstate import _tree
from trainstate._format import manifest
from trainstate._format.chunk_table import ChunkTable

NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
# a chunk's transforms as a compressed chunk has them (and odd ones: escapes, several, none)
TRANSFORM = st.one_of(
    st.builds(
        lambda level, raw: {"name": "zstd", "level": level, "raw_checksum": raw},
        st.integers(1, 19),
        st.from_regex(r"xxh3_64:[0-9a-f]{16}", fullmatch=True),
    ),
    st.dictionaries(NAMES, st.one_of(st.integers(), NAMES, st.booleans()), max_size=3),
)
TRANSFORMS = st.lists(TRANSFORM, min_size=0, max_size=2).map(tuple)


@st.composite
def tables(draw: st.DrawFn) -> ChunkTable:
    names = draw(st.lists(NAMES, min_size=1, max_size=6, unique=True))
    width = draw(st.integers(0, 3))
    files = [f"data-r{r:05d}-{i:05d}.safetensors" for r in range(2) for i in range(2)]
    headers, tensor, offsets, shapes = [], [], [], []
    for i, _ in enumerate(names):
        d = draw(st.integers(0, width))
        headers.append(
            (
                draw(st.sampled_from(["F32", "BF16", "U8"])),
                draw(st.sampled_from(["torch", "numpy"])),
                tuple(draw(st.lists(st.integers(0, 10**6), min_size=d, max_size=d))),
            )
        )
        for _ in range(draw(st.integers(1 if d else 1, 4 if d else 1))):
            tensor.append(i)
            offsets.append(draw(st.lists(st.integers(0, 10**9), min_size=d, max_size=d)) + [0] * (width - d))
            shapes.append(draw(st.lists(st.integers(0, 10**5), min_size=d, max_size=d)) + [0] * (width - d))
    n = len(tensor)
    ranges = np.array(draw(st.lists(st.tuples(st.integers(0, 10**12), st.integers(0, 10**12)), min_size=n, max_size=n)))
    sums = draw(st.lists(st.from_regex(r"[a-z0-9_]{1,8}:[0-9a-f]{0,16}", fullmatch=True), min_size=n, max_size=n))
    pieced = draw(st.sets(st.integers(0, n - 1)))
    pieces = {k: manifest.Pieces(draw(st.integers(1, 1 << 20)), tuple(sums[: 1 + k % 3])) for k in pieced}
    transformed = draw(st.sets(st.integers(0, n - 1)))
    transforms = {k: draw(TRANSFORMS) for k in transformed}
    return ChunkTable(
        names,
        headers,
        np.array(tensor, dtype=np.int64),
        np.array(offsets, dtype=np.int64).reshape(n, width),
        np.array(shapes, dtype=np.int64).reshape(n, width),
        files,
        np.array(draw(st.lists(st.integers(0, len(files) - 1), min_size=n, max_size=n)), dtype=np.int64),
        ranges.reshape(n, 2),
        np.array(sums, dtype="S"),
        pieces,
        transforms,
    )


def _objects(table: ChunkTable) -> dict[str, manifest.TensorEntry]:
    return {name: table[name] for name in table}


@settings(max_examples=60, deadline=None)
@given(tables())
def test_the_columns_render_exactly_the_canonical_json_of_the_entries(table):
    entries = _objects(table)
    expected = manifest._dumps({name: manifest._tensor_json(t) for name, t in entries.items()}).encode()
    assert table.canonical_json() == expected


@settings(max_examples=20, deadline=None)
@given(tables())
def test_a_manifest_over_the_columns_is_byte_for_byte_the_manifest_over_the_entries(table):
    def body(tensors):
        return manifest.Manifest(
            tree=_tree.NONE,
            tensors=tensors,
            files=tuple(manifest.FileEntry(f, 10**13, "xxh3_64:00") for f in table.files),
            created=1.5,
            writer="w",
        ).to_json_bytes()

    assert body(table) == body(_objects(table))


def test_a_checksum_that_needs_escaping_takes_the_general_path():
    table = ChunkTable(
        ["w"],
        [("F32", "torch", (2,))],
        np.zeros(1, np.int64),
        np.zeros((1, 1), np.int64),
        np.full((1, 1), 2, np.int64),
        ["data-r00000-00000.safetensors"],
        np.zeros(1, np.int64),
        np.array([[0, 8]]),
        np.array(['xx"h'], dtype="S"),
        {},
    )
    assert table.canonical_json() is None
    raw = manifest.Manifest(
        _tree.NONE, table, (manifest.FileEntry("data-r00000-00000.safetensors", 8, "x"),)
    ).to_json_bytes()
    assert b'"checksum":"xx\\"h"' in raw


def test_a_table_of_many_blocks_of_rows_renders_the_same_bytes():
    rng = np.random.default_rng(0)
    n, tensors = 40_000, 7  # rows cross several blocks, rendered on more than one thread
    tensor = np.sort(rng.integers(0, tensors, n))
    offsets = np.zeros((n, 2), np.int64)
    offsets[:, 0] = rng.integers(0, 10**7, n)
    begin = rng.integers(0, 10**11, n)
    table = ChunkTable(
        [f"t{i}" for i in range(tensors)],
        [("BF16", "torch", (10**7, 4096))] * tensors,
        tensor,
        offsets,
        np.tile([4, 4096], (n, 1)),
        ["data-r00000-00000.safetensors", "data-r00001-00000.safetensors"],
        rng.integers(0, 2, n),
        np.stack([begin, begin + 32768], axis=1),
        np.array([f"xxh3_64:{x:016x}" for x in rng.integers(0, 2**63, n).tolist()], dtype="S"),
        {int(k): manifest.Pieces(4096, ("a", "b")) for k in rng.integers(0, n, 50)},
    )
    expected = manifest._dumps({name: manifest._tensor_json(table[name]) for name in table}).encode()
    assert table.canonical_json() == expected


def test_compressed_chunks_render_their_transforms_after_the_shape_as_json_dumps_does():
    zstd = ({"level": 3, "name": "zstd", "raw_checksum": "xxh3_64:00000000000000ff"},)
    table = ChunkTable(
        ["a", "b"],
        [("F32", "torch", (8, 4)), ("F32", "numpy", (3,))],
        np.array([0, 0, 0, 1], np.int64),
        np.array([[0, 0], [2, 0], [4, 0], [0, 0]], np.int64),
        np.array([[2, 4], [2, 4], [4, 4], [3, 0]], np.int64),
        ["data-r00000-00000.safetensors", "data-r00001-00000.safetensors"],
        np.array([0, 0, 1, 1], np.int64),
        np.array([[100, 130], [130, 162], [100, 140], [140, 152]], np.int64),
        np.array(["xxh3_64:01", "xxh3_64:02", "xxh3_64:03", "xxh3_64:04"], dtype="S"),
        {1: manifest.Pieces(16, ("xxh3_64:0a", "xxh3_64:0b"))},
        {0: zstd, 1: zstd, 2: (), 3: zstd},  # chunk 2 stored raw (it did not compress)
    )
    assert table["a"].chunks[0].transforms == zstd and table["a"].chunks[2].transforms == ()
    assert table["a"].chunks[1].pieces is not None and table["a"].chunks[1].transforms == zstd
    entries = _objects(table)
    assert table.canonical_json() == manifest._dumps({n: manifest._tensor_json(t) for n, t in entries.items()}).encode()
    raw = manifest.Manifest(_tree.NONE, table, (), world_size=2).to_json_bytes()
    assert raw == manifest.Manifest(_tree.NONE, entries, (), world_size=2).to_json_bytes()
    assert b'"format_version":"1.3"' in raw
    lines = raw.split(b"\n")
    assert [line[:4] for line in lines if line.startswith(b'"a":') or line.startswith(b'"b":')] == [b'"a":', b'"b":']
