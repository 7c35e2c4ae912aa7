"""The manifest's line layout (docs/format.md §3.1) and the cheap open it gives (issue 27): one tensor read
by its line, everything else by the whole parse with every check it always ran."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_golden import golden_state
from test_spec_reader import SpecReader, tensor_line

import trainstate
from helpers import assert_same, laid_out, one_line, reseal_manifest
from trainstate import _checksum as checksum
from trainstate import _tree
from trainstate._format import lazy_manifest, manifest, manifest_lines
from trainstate._format.chunk_table import ChunkTable

KEY = bytes(range(32))
FIXTURE = Path(__file__).parent.parent / "fixtures" / "v1.0-lines" / "basic"  # test_golden's state, laid out
PREFIX = len(b'{"checksum":"xxh3_64:0123456789abcdef",')


def mixed_state() -> dict:
    rng = np.random.default_rng(0)
    return {
        "model": {f"layer{i}.w": rng.standard_normal((8, 8)).astype(np.float32) for i in range(40)},
        "big": rng.standard_normal(600_000).astype(np.float32),  # 2.4 MB: stored with per-piece checksums
        "bf16": np.arange(6, dtype=ml_dtypes.bfloat16),
        "torch": torch.arange(5, dtype=torch.int64),
        "scalar": np.float64(2.5),
        "empty": np.zeros((0, 3), np.int8),
        "names": {'a"b': np.ones(2), "a\\b": np.ones(3), "ü": np.ones(4), "Z": np.ones(5), "\u2603": np.ones(1)},
        "step": 7,
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    trainstate.save(tmp_path / "c", mixed_state(), metadata={"run": "lines"})
    return tmp_path / "c"


@pytest.fixture
def whole_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts the whole-manifest parses (``_build``: the tree, the byte-range overlap check, ...)."""
    calls: list[str] = []
    build = manifest._build

    def counted(body: dict, what: str = "manifest") -> manifest.Manifest:
        calls.append(what)
        return build(body, what)

    monkeypatch.setattr(manifest, "_build", counted)
    return calls


def _raw(path: Path) -> bytes:
    return (path / "manifest.json").read_bytes()


def _reseal_bytes(path: Path, raw: bytes) -> None:
    """Write manifest bytes in the layout with their checksum recomputed over them (a forger's file)."""
    covered = b"{" + raw[PREFIX:].rstrip(b"\n")
    (path / "manifest.json").write_bytes(b'{"checksum":"' + checksum.digest(covered).encode() + b'",' + raw[PREFIX:])


# -- the layout ---------------------------------------------------------------------------------------------
def test_each_tensor_is_on_a_line_of_its_own_in_one_json_document(ckpt):
    raw = _raw(ckpt)
    body = json.loads(raw)
    lines = raw.split(b"\n")
    first = lines.index(b'"tensors":{') + 1
    tensor_lines = lines[first : lines.index(b"},", first)]
    names = sorted(body["tensors"])
    assert [json.loads(b"{" + line.removesuffix(b",") + b"}") for line in tensor_lines] == [
        {n: body["tensors"][n]} for n in names
    ]
    assert lines[first - 2].startswith(b'"metadata":') and lines[first + len(names) + 1].startswith(b'"tree":')
    assert len(lines) == 1 + 1 + 1 + len(names) + 1 + 1 + 1 + 1  # header, metadata, tensors, }, tree, rest, ""
    checksum_ = body.pop("checksum")
    assert raw == b'{"checksum":"' + checksum_.encode() + b'",' + laid_out(body)[1:] + b"\n"  # §3.1, from the spec
    assert json.loads(one_line(raw)) == json.loads(raw)  # line feeds are whitespace only


def test_the_spec_reader_reads_the_layout_and_finds_a_line(ckpt):
    reader = SpecReader(ckpt)
    reader.verify()
    reader.load()
    raw, tensors = _raw(ckpt), json.loads(_raw(ckpt))["tensors"]
    for name, entry in tensors.items():
        assert tensor_line(raw, name) == entry, name
    assert tensor_line(raw, "model.nope") is None


@pytest.mark.parametrize(
    "entries",
    [
        {"b": {"chunks": [], "x": 1}, 'a"},"b":{"chunks":': {"chunks": [{"k": ',"b":{"chunks":'}]}, "c": {"chunks": 2}},
        {"b": 1, "a": {"x": [1, {"y": None}]}, "\u2603": "s"},  # not entries (a re-formatted manifest's JSON)
    ],
)
def test_tensor_lines_put_each_member_on_a_line_of_the_same_json(entries):
    text = b"".join(manifest_lines.tensor_lines(entries))
    assert json.loads(text) == entries and text.replace(b"\n", b"") == manifest_lines.dumps(entries).encode()
    lines = text.split(b"\n")[1:-1]
    assert [json.loads(b"{" + line.removesuffix(b",") + b"}") for line in lines] == [
        {k: entries[k]} for k in sorted(entries)
    ]


def test_the_columns_of_a_collective_save_are_laid_out_the_same():
    rng = np.random.default_rng(1)
    n = 40
    table = ChunkTable(
        [f"t{i}" for i in range(5)] + ["ü", 'a"b'],
        [("BF16", "torch", (40, 4))] * 7,
        np.sort(rng.integers(0, 7, n)),
        np.stack([np.arange(n) % 40, np.zeros(n, np.int64)], axis=1),
        np.tile([1, 4], (n, 1)),
        ["data-r00000-00000.safetensors", "data-r00001-00000.safetensors"],
        rng.integers(0, 2, n),
        np.stack([np.arange(n) * 8, np.arange(n) * 8 + 8], axis=1),
        np.array([f"xxh3_64:{x:016x}" for x in rng.integers(0, 2**63, n).tolist()], dtype="S"),
        {3: manifest.Pieces(4, ("a", "b"))},
    )
    parts = table.canonical_json_parts(lines=True)
    assert parts is not None
    entries = {name: manifest._tensor_json(table[name]) for name in table}
    assert b"".join(parts) == b"".join(manifest_lines.tensor_lines(entries))
    files = tuple(manifest.FileEntry(f, 10**6, "xxh3_64:00") for f in table.files)
    raw = manifest.Manifest(tree=_tree.NONE, tensors=table, files=files, world_size=2).to_json_bytes()
    lines = manifest_lines.split(raw)
    assert lines is not None
    for name, entry in json.loads(raw)["tensors"].items():
        assert lines.find(name) == entry


# -- one tensor by its line -----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["plain", "zstd", "encrypted"])
def test_a_lookup_reads_what_the_whole_parse_reads(tmp_path, how, whole_parses):
    options = {"zstd": {"compression": "zstd"}, "encrypted": {"key": KEY}}.get(how, {})
    trainstate.save(tmp_path / "c", mixed_state(), **options)
    key = KEY if how == "encrypted" else None
    raw = _raw(tmp_path / "c")
    whole = manifest.parse(raw, "m", None if key is None else trainstate._keys.Key(key))
    for name in whole.tensors:
        whole_parses.clear()
        with trainstate.open(tmp_path / "c", key=key) as ck:
            assert isinstance(ck.manifest, lazy_manifest.LazyManifest)
            assert ck.manifest.tensors[name] == whole.tensors[name], name
            fast = np.array(ck.read(name))
        assert whole_parses == [], name
        with trainstate.open(tmp_path / "c", key=key) as ck:
            ck.keys()  # the whole parse first
            slow = np.array(ck.read(name))
        assert fast.dtype == slow.dtype and fast.shape == slow.shape and fast.tobytes() == slow.tobytes(), name
    assert trainstate.load(tmp_path / "c", key=key)["names"]["ü"].tolist() == [1.0] * 4


def test_one_read_does_not_parse_the_whole_manifest(ckpt, whole_parses):
    with trainstate.open(ckpt) as ck:
        w = ck.read("model.layer30.w")
        assert ck.info("big").shape == (600_000,)
        assert "names.ü" in ck and ck.created > 0 and not ck.encrypted and ck.world_size == 1 and ck.nbytes > 0
        out = np.empty(5, np.int64)
        ck.read_into("torch", out)
        assert whole_parses == []
        assert np.array_equal(w, mixed_state()["model"]["layer30.w"]) and out.tolist() == [0, 1, 2, 3, 4]
        assert ck.metadata == {"run": "lines"}  # the metadata is parsed with the rest
        assert len(whole_parses) == 1 and ck.manifest._raw == b""  # its bytes are let go once parsed
        ck.keys(), list(ck), ck.load()
        assert len(whole_parses) == 1  # once


def test_a_name_with_no_line_is_an_unknown_key(ckpt):
    with trainstate.open(ckpt) as ck:
        assert "model.layer30" not in ck
        with pytest.raises(trainstate.UnknownKeyError, match="did you mean model.layer30.w"):
            ck.read("model.layer30")


def test_a_damaged_tensor_is_refused_when_read(ckpt, whole_parses):
    c = json.loads(_raw(ckpt))["tensors"]["model.layer7.w"]["chunks"][0]
    data = bytearray((ckpt / c["file"]).read_bytes())
    data[c["byte_range"][0] + 5] ^= 0x10
    (ckpt / c["file"]).write_bytes(bytes(data))
    with trainstate.open(ckpt) as ck:
        with pytest.raises(trainstate.CorruptCheckpointError, match="model.layer7.w"):
            ck.read("model.layer7.w")
        ck.read("model.layer8.w")
    assert whole_parses == []


@pytest.mark.parametrize("where", [b'"model.layer2.w":{"c', b'"tree":{"t', b'"writer":"t'])
def test_a_damaged_line_of_the_manifest_fails_its_checksum_at_open(ckpt, where):
    raw = bytearray(_raw(ckpt))
    raw[raw.index(where) + len(where) - 1] ^= 0x01  # a letter in a string: still valid JSON
    (ckpt / "manifest.json").write_bytes(bytes(raw))
    with pytest.raises(trainstate.CorruptCheckpointError, match="checksum"):
        trainstate.open(ckpt)


# -- what the whole parse checks still runs before any whole use ---------------------------------------------
def _share_bytes(body: dict) -> None:
    a, b = (body["tensors"][f"model.layer{i}.w"]["chunks"][0] for i in (3, 4))
    b.update(file=a["file"], byte_range=a["byte_range"], checksum=a["checksum"])


def _missing_tensor(body: dict) -> None:
    body["tree"] = {"t": "dict", "v": [["w", {"name": "nope", "t": "tensor"}]]}


@pytest.mark.parametrize(("edit", "match"), [(_share_bytes, "share bytes"), (_missing_tensor, "nope")])
def test_a_forged_manifest_is_refused_by_every_whole_use(ckpt, edit, match):
    reseal_manifest(ckpt, edit, layout=True)  # a valid checksum over a lying manifest, laid out
    with pytest.raises(trainstate.CorruptCheckpointError, match=match):
        manifest.parse(_raw(ckpt))  # what open() refused before the layout
    with pytest.raises(trainstate.CorruptCheckpointError, match=match):
        trainstate.load(ckpt)
    uses = {
        "keys": lambda ck: ck.keys(),
        "verify": lambda ck: ck.verify(),
        "len": lambda ck: len(ck.manifest.tensors),
        "iter": lambda ck: list(ck),
        "metadata": lambda ck: ck.metadata,
        "tree": lambda ck: ck.manifest.tree,
        "restore": lambda ck: ck.load(),
    }
    for what, use in uses.items():
        with trainstate.open(ckpt) as ck, pytest.raises(trainstate.CorruptCheckpointError, match=match):
            use(ck)
            pytest.fail(what)
    with trainstate.open(ckpt) as ck:  # one entry that is right on its own still reads
        assert np.array_equal(ck.read("model.layer5.w"), mixed_state()["model"]["layer5.w"])


# -- manifests not in the layout, and forged layouts ----------------------------------------------------------
def test_a_one_line_manifest_opens_by_the_whole_parse(ckpt, whole_parses):
    reseal_manifest(ckpt, lambda body: None)  # one line, as trainstate wrote it before the layout
    assert b"\n" not in _raw(ckpt)
    with trainstate.open(ckpt) as ck:
        assert not isinstance(ck.manifest, lazy_manifest.LazyManifest) and len(whole_parses) == 1
        assert np.array_equal(ck.read("model.layer9.w"), mixed_state()["model"]["layer9.w"])
    for fixture in sorted((Path(__file__).parent.parent / "fixtures").glob("v1.*/*/manifest.json")):
        assert (manifest_lines.split(fixture.read_bytes()) is None) == (fixture.parent != FIXTURE), fixture


@pytest.mark.parametrize(("field", "lazy"), [("other", False), ("zz", True), ("aa", True)])
def test_a_newer_minor_versions_field_is_kept_either_way(ckpt, whole_parses, field, lazy):
    """A top-level field sorting between ``metadata`` and ``tree`` gets lines of its own, which this reader's
    lookup does not know: the whole parse reads that manifest; elsewhere it is a header field."""
    reseal_manifest(ckpt, lambda body: body.update({field: [1, {"x": 2}]}), layout=True)
    with trainstate.open(ckpt) as ck:
        assert isinstance(ck.manifest, lazy_manifest.LazyManifest) == lazy
        assert ck.manifest.extra == {field: [1, {"x": 2}]}
        assert np.array_equal(ck.read("model.layer9.w"), mixed_state()["model"]["layer9.w"])
        assert len(whole_parses) == (0 if lazy else 1)
        assert ck.load()["step"] == 7


def test_a_reformatted_manifest_in_the_layout_still_opens(ckpt):
    body = json.loads(_raw(ckpt))
    (ckpt / "manifest.json").write_text(json.dumps(body, indent=1))  # the checksum no longer first in the bytes
    with trainstate.open(ckpt) as ck:
        assert np.array_equal(ck.read("model.layer1.w"), mixed_state()["model"]["layer1.w"])
    body["tensors"]["model.layer1.w"]["kind"] = "torch"
    (ckpt / "manifest.json").write_text(json.dumps(body, indent=1))
    with pytest.raises(trainstate.CorruptCheckpointError, match="checksum"):
        trainstate.open(ckpt)


def _line(raw: bytes, name: str) -> bytes:
    (line,) = [x for x in raw.split(b"\n") if x.startswith(json.dumps(name).encode() + b":")]
    return line


def test_a_name_listed_twice_side_by_side_is_refused(ckpt, whole_parses):
    raw = _raw(ckpt)
    line = _line(raw, "model.layer3.w")
    entry = json.loads(b"{" + line.removesuffix(b",") + b"}")["model.layer3.w"]
    entry["shape"] = entry["chunks"][0]["shape"] = [64]  # the same bytes, another shape: the last one counts
    entry["chunks"][0]["offset"] = [0]
    twice = line + b"\n" + json.dumps({"model.layer3.w": entry}, separators=(",", ":")).encode()[1:-1] + b","
    _reseal_bytes(ckpt, raw.replace(line, twice))
    with trainstate.open(ckpt) as ck:  # the lines were not trusted: the whole parse refuses a name twice
        with pytest.raises(trainstate.CorruptCheckpointError, match="out of order or repeated"):
            ck.read("model.layer3.w")
        assert len(whole_parses) == 1
    with pytest.raises(trainstate.CorruptCheckpointError, match="out of order or repeated"):
        trainstate.load(ckpt)


def test_a_name_listed_twice_apart_is_refused_by_the_whole_parse(ckpt):
    raw = _raw(ckpt)
    line = _line(raw, "model.layer1.w")
    entry = json.loads(b"{" + line.removesuffix(b",") + b"}")["model.layer1.w"]
    entry["shape"] = entry["chunks"][0]["shape"] = [64]
    entry["chunks"][0]["offset"] = [0]
    last = _line(raw, "torch")  # the last tensor line: the second member goes after every sorted line
    extra = json.dumps({"model.layer1.w": entry}, separators=(",", ":")).encode()[1:-1]
    _reseal_bytes(ckpt, raw.replace(b"\n" + last + b"\n", b"\n" + last + b",\n" + extra + b"\n"))
    assert json.loads(_raw(ckpt))["tensors"]["model.layer1.w"]["shape"] == [64]
    with trainstate.open(ckpt) as ck:
        assert ck.read("model.layer1.w").shape == (8, 8)  # the binary search meets the sorted line
        with pytest.raises(trainstate.CorruptCheckpointError, match="out of order or repeated at 'model.layer1.w'"):
            ck.keys()
    with pytest.raises(trainstate.CorruptCheckpointError, match="out of order or repeated"):
        trainstate.load(ckpt)  # the whole parse alone refuses it too: verify, load and read agree


def test_an_encrypted_manifest_reads_by_line_and_is_authenticated_whole(tmp_path, whole_parses):
    trainstate.save(tmp_path / "c", mixed_state(), key=KEY)
    whole_parses.clear()
    with trainstate.open(tmp_path / "c", key=KEY) as ck:
        assert np.array_equal(ck.read("model.layer2.w"), mixed_state()["model"]["layer2.w"])
    assert whole_parses == []
    raw = bytearray(_raw(tmp_path / "c"))
    at = raw.index(b'"model.layer30.w":{"chunks":[{"byte_range":[') + 45
    raw[at] = ord("9") if raw[at] != ord("9") else ord("8")  # another tensor's line
    (tmp_path / "c" / "manifest.json").write_bytes(bytes(raw))
    with pytest.raises(trainstate.TamperedCheckpointError):
        trainstate.open(tmp_path / "c", key=KEY)


def test_every_fixture_still_reads(whole_parses):
    fixtures = sorted((Path(__file__).parent.parent / "fixtures").glob("v1.*/*/manifest.json"))
    for fixture in [f for f in fixtures if "encrypted" not in str(f)]:
        with trainstate.open(fixture.parent) as ck:
            for name in ck.keys():
                ck.read(name)


NAMES = st.text(st.characters(), min_size=1, max_size=8)  # lone surrogates too: JSON escapes them


@settings(max_examples=60, deadline=None)
@given(st.lists(NAMES, min_size=1, max_size=40, unique=True), st.lists(NAMES, max_size=5))
def test_every_name_is_found_by_its_line_and_no_other(names, others):
    chunk = manifest.Chunk("data-00000.safetensors", (0, 4), (0,), (1,), "xxh3_64:0123456789abcdef")
    tensors = {name: manifest.TensorEntry("F32", (1,), "numpy", (chunk,)) for name in names}
    raw = manifest.Manifest(
        tree=_tree.NONE, tensors=tensors, files=(manifest.FileEntry("data-00000.safetensors", 4, "x"),)
    ).to_json_bytes()
    lines = manifest_lines.split(raw)
    assert lines is not None
    body = json.loads(raw)
    for name in names:
        assert lines.find(name) == body["tensors"][name]
    for name in others:
        assert (lines.find(name) is manifest_lines.MISSING) == (name not in tensors)


def _volatile(raw: bytes) -> bytes:
    raw = re.sub(rb'"checksum":"[^"]*"', b'"checksum":""', raw, count=1)
    return re.sub(rb'"writer":"[^"]*"', b'"writer":""', re.sub(rb'"created":[-+.e0-9]+', b'"created":0', raw))


def test_the_layout_is_pinned_by_its_fixture(tmp_path, whole_parses):
    """tests/fixtures/v1.0-lines/basic is test_golden's state saved in the line layout: a fresh save is the
    same bytes but for the time, the writer and the checksum (regenerate: python tests/format/test_manifest_lines.py)."""
    trainstate.save(tmp_path / "c", golden_state(), metadata={"run": "golden"}, threads=2)
    for f in sorted(p.name for p in FIXTURE.iterdir()):
        fresh, pinned = (tmp_path / "c" / f).read_bytes(), (FIXTURE / f).read_bytes()
        assert (_volatile(fresh) == _volatile(pinned)) if f == "manifest.json" else fresh == pinned, f
    with trainstate.open(FIXTURE) as ck:
        ck.read("weights.w")
        assert whole_parses == []
        assert_same(golden_state(), ck.load())


if __name__ == "__main__":
    shutil.rmtree(FIXTURE, ignore_errors=True)
    trainstate.save(FIXTURE, golden_state(), metadata={"run": "golden"}, threads=2)
    print("wrote", FIXTURE)


def test_verify_refuses_lines_that_a_lookup_reads_otherwise_than_the_whole_parse(ckpt):
    # JSON whitespace lets the metadata span lines and hold a "tensors":{ line of its own: split() takes the
    # tensor lines from there, and a binary search that lands in a long member of the metadata goes left onto
    # a forged line. The whole parse (verify, load, inspect) reads the real entry and passes; a fresh
    # open().read() of the name returns the forged entry's bytes.
    raw = _raw(ckpt)
    forged = _line(raw, "scalar").removesuffix(b",").replace(b'"scalar":', b'"torch":', 1)
    meta = raw.index(b'\n"metadata":') + 1
    end = raw.index(b"\n", meta)
    value = raw[meta + len(b'"metadata":') : end - 1]
    spanning = b'"metadata":{\n"tensors":{\n' + forged + b',\n"zzz":"' + b"x" * 200_000 + b'"},"t":"x",'
    _reseal_bytes(ckpt, raw[:meta] + spanning + value[1:] + b"," + raw[end:])
    with trainstate.open(ckpt) as ck:
        looked_up = ck.info("torch").shape
    with trainstate.open(ckpt) as ck:
        try:
            ck.verify()
        except trainstate.CorruptCheckpointError:
            return
        assert looked_up == ck.info("torch").shape, (looked_up, ck.info("torch").shape)
