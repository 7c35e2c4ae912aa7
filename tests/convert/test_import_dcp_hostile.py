"""Importing a torch.distributed.checkpoint directory someone else made: its ``.metadata`` and data files are
the attacker's. Each test starts from a real ``dcp.save`` and changes one thing the way a hostile download
would; the import refuses it with a CheckpointError naming the file, and changes nothing outside the output."""

from __future__ import annotations

import collections
import contextlib
import copyreg
import io
import os
import pathlib
import pickle
import random
import shutil
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from convert_helpers import cli
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

import trainstate

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DATA = "__0_0.distcp"


def saved(tmp_path: Path, state: dict[str, Any] | None = None, **kwargs: Any) -> Path:
    """A real DCP directory of ``state`` (two float tensors by default)."""
    out = tmp_path / "dcp"
    state = state if state is not None else {"w": torch.arange(4.0), "v": torch.arange(4.0) + 10}
    dcp.save(state, checkpoint_id=out, no_dist=True, **kwargs)
    return out


def rewrite(path: Path, change: Callable[[Metadata], object]) -> None:
    """Unpickle our own save's metadata (trusted: the test wrote it), change it, pickle it back."""
    md = pickle.loads((path / ".metadata").read_bytes())
    change(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def info(md: Metadata, fqn: str) -> _StorageInfo:
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


def set_chunks(fqn: str, *chunks: tuple[int, int]) -> Callable[[Metadata], None]:
    """The 1-d tensor ``fqn`` said to be stored as these (offset, size) chunks, each read from its own copy of
    the tensor's real bytes (one byte range per chunk, as DCP writes them)."""

    def change(md: Metadata) -> None:
        where = info(md, fqn)
        entry = md.state_dict_metadata[fqn]
        assert isinstance(entry, TensorStorageMetadata)
        entry.chunks = [ChunkStorageMetadata(torch.Size([o]), torch.Size([n])) for o, n in chunks]
        for i, (o, _) in enumerate(chunks):
            md.storage_data[MetadataIndex(fqn, [o], i)] = _StorageInfo(f"copy{i}.distcp", where.offset, where.length)

    return change


def refused(src: Path, tmp_path: Path, match: str) -> pytest.ExceptionInfo[trainstate.CorruptCheckpointError]:
    with pytest.raises(trainstate.CorruptCheckpointError, match=match) as caught:
        trainstate.import_checkpoint(src, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    return caught


# 1. chunks that do not cover their tensor: the gap would be the importing process's uninitialised memory


@pytest.mark.parametrize(
    "chunks",
    [((0, 2),), ((0, 3), (1, 3)), ((2, 4),), ((-1, 5),), ((0, 2), (2, 2), (2, 2))],
    ids=["gap", "overlap", "out_of_bounds", "negative_offset", "duplicate"],
)
def test_chunks_that_do_not_cover_the_tensor_are_refused(chunks, tmp_path):
    src = saved(tmp_path)
    for i in range(len(chunks)):
        shutil.copy(src / DATA, src / f"copy{i}.distcp")
    rewrite(src, set_chunks("w", *chunks))
    refused(src, tmp_path, r"\.metadata.*'w'.*chunks")


def test_the_overlap_check_agrees_with_comparing_every_pair():
    from trainstate._convert.dcp_metadata import _overlap

    def pairwise(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
        live = [b for b in boxes if all(b[1])]
        return any(
            all(b0 < a0 + an and a0 < b0 + bn for a0, an, b0, bn in zip(a[0], a[1], b[0], b[1]))
            for i, a in enumerate(live)
            for b in live[i + 1 :]
        )

    rng = random.Random(1)
    for _ in range(5000):
        ndim = rng.randint(0, 3)
        boxes = [
            (tuple(rng.randint(0, 5) for _ in range(ndim)), tuple(rng.randint(0, 3) for _ in range(ndim)))
            for _ in range(rng.randint(0, 6))
        ]
        assert _overlap(boxes) == pairwise(boxes), boxes


def _staircase(k: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Chunks that tile a k x k tensor exactly once: column j from row j down, row j right of column j."""
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for j in range(k):
        boxes.append(((j, j), (k - j, 1)))
        if j + 1 < k:
            boxes.append(((j, j + 1), (1, k - j - 1)))
    return boxes


def test_an_irregular_chunk_layout_is_refused_in_bounded_time_not_checked_for_hours():
    from trainstate._convert.dcp_metadata import _overlap

    assert not _overlap(_staircase(300))  # small: checked, and it tiles
    start = time.perf_counter()
    assert _overlap(_staircase(50_000))  # n²/8 = 1.25e9 comparisons: refused once the budget is spent
    assert time.perf_counter() - start < 30


def test_grid_layouts_are_checked_whatever_their_size():
    from trainstate._convert.dcp_metadata import _overlap

    rows, cols = 1024, 64  # FSDP x tensor parallel, the last row and column of blocks smaller
    grid = [
        ((r * 7, c * 5), (7 if r < rows - 1 else 3, 5 if c < cols - 1 else 2)) for r in range(rows) for c in range(cols)
    ]
    assert not _overlap(grid)
    assert _overlap([*grid, grid[100]])
    bricks = [((r, (r % 2) * 2 + 4 * c), (1, 4)) for r in range(400) for c in range(50)]  # no grid: rows offset
    assert not _overlap(bricks)


def test_chunks_that_tile_the_tensor_are_read(tmp_path):
    src = saved(tmp_path)
    for i in range(2):
        shutil.copy(src / DATA, src / f"copy{i}.distcp")
    rewrite(src, set_chunks("w", (0, 2), (2, 2)))  # each chunk reads the first half of its copy
    trainstate.import_checkpoint(src, tmp_path / "ck")
    with trainstate.open(tmp_path / "ck") as ck:
        assert ck.read("w").tolist() == [0.0, 1.0, 0.0, 1.0] and ck.read("v").tolist() == [10.0, 11.0, 12.0, 13.0]


def test_one_byte_range_read_for_two_chunks_is_refused(tmp_path):
    src = saved(tmp_path)

    def change(md: Metadata) -> None:
        set_chunks("w", (0, 2), (2, 2))(md)
        for key in [k for k in md.storage_data if k.fqn == "w"]:
            md.storage_data[key] = info(md, "v")  # both halves of w from v's bytes, which v reads too

    rewrite(src, change)
    refused(src, tmp_path, r"\.metadata: the bytes of '[vw]' in __0_0\.distcp overlap '[vw]'")


def test_a_value_without_storage_is_refused_before_reading(tmp_path):
    src = saved(tmp_path, {"w": torch.ones(2), "step": 5})

    def change(md: Metadata) -> None:  # stored under a tensor chunk's key: not where a value is read from
        md.storage_data[MetadataIndex("step", [0])] = md.storage_data.pop(MetadataIndex("step"))

    rewrite(src, change)
    refused(src, tmp_path, r"\.metadata: no storage is given for 'step'")


# 2. every file read is a file of the folder


def outside_copy(tmp_path: Path, src: Path) -> Path:
    outside = tmp_path / "outside.distcp"
    shutil.copy(src / DATA, outside)
    return outside


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "symlinked_metadata", "symlink_loop"])
def test_files_outside_the_folder_are_never_read(how, tmp_path):
    src = saved(tmp_path)
    outside = outside_copy(tmp_path, src)
    if how in ("dotdot", "absolute"):
        name = "../outside.distcp" if how == "dotdot" else str(outside)

        def change(md: Metadata) -> None:
            for where in md.storage_data.values():
                where.relative_path = name

        rewrite(src, change)
        (src / DATA).unlink()  # what is imported can only come from outside
    elif how == "symlink":
        (src / DATA).unlink()
        (src / DATA).symlink_to(outside)
    elif how == "symlink_loop":
        (src / DATA).unlink()
        (src / DATA).symlink_to(src / "loop")
        (src / "loop").symlink_to(src / DATA)
    else:
        (tmp_path / "elsewhere.metadata").write_bytes((src / ".metadata").read_bytes())
        (src / ".metadata").unlink()
        (src / ".metadata").symlink_to(tmp_path / "elsewhere.metadata")
    refused(src, tmp_path, "outside" if how != "symlink_loop" else "cannot be resolved")


# 3. the metadata unpickler builds DCP's metadata and changes nothing else


def short(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def set_class_attribute(module: str, name: str, attribute: str) -> bytes:
    """A pickle that fetches an allowed class and BUILDs it with a slot state: ``setattr(cls, attribute, ...)``."""
    return (
        b"\x80\x04"  # PROTO 4
        + short(module)
        + short(name)
        + b"\x93"  # STACK_GLOBAL: the class itself
        + b"N}"  # NONE, EMPTY_DICT: state (None, {attribute: "pwned"})
        + short(attribute)
        + short("pwned")
        + b"s\x86"  # SETITEM, TUPLE2
        + b"b."  # BUILD on the class, STOP
    )


@contextlib.contextmanager
def restoring(cls: type) -> Iterator[dict[str, Any]]:
    """The class's own attributes as they were; put back afterwards whatever happened, so later tests see
    the real class."""
    before = dict(cls.__dict__)
    try:
        yield before
    finally:
        for k in set(cls.__dict__) - set(before):
            delattr(cls, k)
        for k, v in before.items():
            if cls.__dict__.get(k) is not v:
                setattr(cls, k, v)


@pytest.mark.parametrize(
    "module, name, attribute",
    [
        ("pathlib", "PosixPath", "exists"),
        ("torch.distributed.checkpoint.metadata", "Metadata", "planner_data"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo", "transform_descriptors"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "pwned"),
    ],
)
def test_the_metadata_cannot_set_attributes_of_a_class(module, name, attribute, tmp_path):
    src = saved(tmp_path)
    (src / ".metadata").write_bytes(set_class_attribute(module, name, attribute))
    cls = getattr(__import__(module, fromlist=[name]), name)
    with restoring(cls) as before:
        with pytest.raises(trainstate.CorruptCheckpointError, match=r"\.metadata"):
            trainstate.import_checkpoint(src, tmp_path / "ck")
        assert dict(cls.__dict__) == before  # nothing set, nothing added
    assert "exists" not in pathlib.PosixPath.__dict__ and "exists" not in pathlib.Path.__dict__.get("__slots__", ())


class AsMetadataIndex:
    """Pickles exactly as a MetadataIndex does (NEWOBJ + BUILD), but two of them can be keys of one dict."""

    def __init__(self, fqn: str, offset: list[int], index: int) -> None:
        self.state = {"fqn": fqn, "offset": torch.Size(offset), "index": index}

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # what the pickler checks NEWOBJ's class against
        return MetadataIndex

    def __reduce_ex__(self, protocol: object) -> tuple[Any, ...]:
        return copyreg.__newobj__, (MetadataIndex,), self.state


def test_a_set_where_dcp_writes_a_tuple_is_refused(tmp_path):
    src = saved(tmp_path)
    rewrite(src, lambda md: md.planner_data.update(w={"x"}))  # a real save never holds a set
    refused(src, tmp_path, r"\.metadata.*set")


def test_a_type_no_dcp_save_holds_is_refused_after_loading(tmp_path):
    src = saved(tmp_path)
    rewrite(src, lambda md: md.planner_data.update(w=("x", 1.5)))  # a float: built without any global
    refused(src, tmp_path, r"\.metadata holds a builtins\.float")


# 4. small inputs cannot cost large memory or disk


def test_a_declared_size_beyond_the_bytes_stored_is_refused_before_allocating(tmp_path, monkeypatch):
    from trainstate._frameworks import torch as adapter

    src = saved(tmp_path)

    def change(md: Metadata) -> None:
        entry = md.state_dict_metadata["w"]
        entry.size = torch.Size([1 << 28])  # 1 GiB of float32, from a file of a few kB
        entry.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([1 << 28]))]

    rewrite(src, change)
    asked: list[int] = []
    real_empty = adapter.empty
    monkeypatch.setattr(adapter, "empty", lambda dtype, shape: asked.append(shape) or real_empty(dtype, shape))
    refused(src, tmp_path, r"\.metadata.*'w'.*bytes")
    assert all(max(shape, default=0) < 1 << 20 for shape in asked), asked


def test_a_compressed_entry_decompresses_no_further_than_its_declared_size(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    src = tmp_path / "dcp"
    dcp.save({"w": torch.zeros(1000)}, storage_writer=FileSystemWriter(src, _extensions=[ZStandard()]), no_dist=True)
    big = io.BytesIO()
    torch.save(torch.zeros(16 << 20), big)  # 64 MiB where the metadata declares 4 kB
    bomb = zstandard.ZstdCompressor().compress(big.getvalue())
    assert len(bomb) < 64 << 10
    (src / DATA).write_bytes(bomb)
    rewrite(src, lambda md: setattr(info(md, "w"), "length", len(bomb)))
    tracemalloc.start()
    try:
        refused(src, tmp_path, r"__0_0\.distcp.*'w'.*declares")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_a_compressed_directory_imports_exactly(tmp_path):
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"w": torch.randn(300, 7), "zeros": torch.zeros(5000), "step": 9, "groups": [{"lr": 0.1}]}
    src = tmp_path / "dcp"
    dcp.save(state, storage_writer=FileSystemWriter(src, _extensions=[ZStandard()]), no_dist=True)
    trainstate.import_checkpoint(src, tmp_path / "ck")
    back = trainstate.load(tmp_path / "ck", framework="torch")
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["zeros"], state["zeros"])
    assert back["step"] == 9 and back["groups"] == [{"lr": 0.1}]


def test_a_length_in_the_metadata_pickle_does_not_size_a_read(tmp_path):
    src = saved(tmp_path)
    (src / ".metadata").write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 2 << 30) + b"tiny")  # BINBYTES8 of 2 GiB
    tracemalloc.start()
    try:
        refused(src, tmp_path, r"\.metadata is not readable DCP metadata")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_a_tensor_of_too_many_dimensions_is_refused(tmp_path):
    src = saved(tmp_path)

    def change(md: Metadata) -> None:
        entry = md.state_dict_metadata["w"]
        entry.size = torch.Size([4] + [1] * 99)
        entry.chunks = [ChunkStorageMetadata(torch.Size([0] * 100), entry.size)]
        md.storage_data[MetadataIndex("w", [0] * 100, 0)] = md.storage_data.pop(MetadataIndex("w", [0]))

    rewrite(src, change)
    refused(src, tmp_path, r"\.metadata: 'w' has a shape")


def test_two_storage_entries_for_one_chunk_are_refused(tmp_path):
    src = saved(tmp_path)

    def change(md: Metadata) -> None:
        real, v = next(k for k in md.storage_data if k.fqn == "w"), info(md, "v")
        md.storage_data = {AsMetadataIndex("w", [0], 0): md.storage_data.pop(real), **md.storage_data}
        md.storage_data[AsMetadataIndex("w", [0], 1)] = v  # the same key again, with v's bytes

    rewrite(src, change)
    refused(src, tmp_path, r"\.metadata.*'w'.*twice")


def test_two_tensors_in_one_place_are_refused(tmp_path):
    src = saved(tmp_path)
    rewrite(src, lambda md: md.planner_data.update(w=("x",), v=("x",)))
    refused(src, tmp_path, r"\.metadata.*'x'")


# 5. every failure is a CheckpointError naming the file, and one line from the command line


def truncated(src: Path) -> None:
    data = (src / DATA).read_bytes()
    (src / DATA).write_bytes(data[: len(data) // 2])


def scrambled(src: Path) -> None:
    """Every byte range still inside its file: only reading the bytes can tell."""
    size = (src / DATA).stat().st_size
    (src / DATA).write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))


def unknown_dtype(src: Path) -> None:
    def change(md: Metadata) -> None:
        md.state_dict_metadata["w"].properties.dtype = torch.quint8

    rewrite(src, change)


def not_metadata(src: Path) -> None:
    (src / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))


def asks_for_code(src: Path) -> None:
    (src / ".metadata").write_bytes(b"\x80\x04" + short("os") + short("system") + b"\x93.")  # os.system, not called


def garbage(src: Path) -> None:
    (src / ".metadata").write_bytes(b"\x80\x04" + struct.pack("<Q", 7) + b"\xff" * 8)


@pytest.mark.parametrize("damage", [truncated, scrambled, unknown_dtype, not_metadata, asks_for_code, garbage])
def test_every_failure_is_a_checkpoint_error_naming_the_file(damage, tmp_path):
    src = saved(tmp_path)
    damage(src)
    with pytest.raises(trainstate.CheckpointError, match=str(src)):
        trainstate.import_checkpoint(src, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_tensors_inside_a_value_dcp_pickled_whole_are_imported(tmp_path):
    src = saved(tmp_path, {"w": torch.ones(2), "pair": (torch.arange(3.0), 3)})  # a tuple: saved as one value
    trainstate.import_checkpoint(src, tmp_path / "ck")
    back = trainstate.load(tmp_path / "ck", framework="torch")
    assert torch.equal(back["pair"][0], torch.arange(3.0)) and back["pair"][1] == 3


def test_a_value_trainstate_cannot_store_is_refused_naming_the_source(tmp_path):
    src = saved(tmp_path, {"w": torch.ones(2), "tags": {1, 2}})
    with pytest.raises(trainstate.UnsupportedValueError, match=f"{src}: tags: a builtins.set cannot be stored"):
        trainstate.import_checkpoint(src, tmp_path / "ck")


def test_the_command_line_says_one_line(tmp_path):
    src = saved(tmp_path)
    scrambled(src)
    err = cli("import", str(src), str(tmp_path / "ck"), code=5).stderr
    assert err.startswith("trainstate: error: ") and err.count("\n") == 1 and str(src) in err, err
    assert os.listdir(tmp_path) == ["dcp"] or "ck" not in os.listdir(tmp_path)


# 6. an entry torch.load would read otherwise than the entry check: a zip from its first byte, nothing before it


class _Storage:
    pass


_STORAGE = _Storage()


class _Tensor:
    """Pickles as torch.save's legacy format pickles a float32 tensor of 64 elements over ``_STORAGE``."""

    def __reduce__(self) -> tuple[Any, ...]:
        return torch._utils._rebuild_tensor_v2, (_STORAGE, 0, (64,), (1,), False, collections.OrderedDict())


class _LegacyPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return ("storage", torch.FloatStorage, "0", "cpu", 64, None) if obj is _STORAGE else None


def legacy_then_zip(entry: bytes) -> bytes:
    """A legacy torch.save file that never stores its storage (torch leaves it uninitialized), then a zip:
    Python's zipfile finds the zip at the end, torch.load sees no zip at the start and reads the pickle."""
    out = io.BytesIO()
    for head in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(head, out, protocol=2)
    _LegacyPickler(out, protocol=2).dump(_Tensor())
    pickle.dump([], out, protocol=2)
    return out.getvalue() + entry


def zip_then_zip(entry: bytes) -> bytes:
    """Another torch.save zip before the entry: a prefix the two zip readers may each resolve their own way."""
    other = io.BytesIO()
    torch.save(torch.full((4,), 7.0), other)
    return other.getvalue() + entry


@pytest.mark.parametrize("fqn", ["w", "step"], ids=["tensor", "bytes"])
@pytest.mark.parametrize("forge", [legacy_then_zip, zip_then_zip])
def test_an_entry_with_bytes_before_its_zip_is_refused(forge, fqn, tmp_path):
    src = saved(tmp_path, {"w": torch.arange(64.0), "step": 9})
    md = pickle.loads((src / ".metadata").read_bytes())
    where = info(md, fqn)
    with open(src / where.relative_path, "rb") as f:
        f.seek(where.offset)
        entry = forge(f.read(where.length))
    (src / "forged.distcp").write_bytes(entry)

    def change(md: Metadata) -> None:
        stored = info(md, fqn)
        stored.relative_path, stored.offset, stored.length = "forged.distcp", 0, len(entry)

    rewrite(src, change)
    refused(src, tmp_path, r"forged\.distcp")


def _colliding_dict(n: int, one_at_a_time: bool = False) -> bytes:
    """A pickled dict of ``n`` int keys that all hash to 0 (``k * (2**61 - 1)``): each insertion probes every
    earlier key, so building it takes time quadratic in ``n``. Filled by one SETITEMS, or a SETITEM per key."""
    items = b""
    for k in range(1, n + 1):
        key = (k * ((1 << 61) - 1)).to_bytes(10, "little", signed=True)
        items += pickle.LONG1 + b"\x0a" + key + pickle.BININT1 + b"\x00" + (pickle.SETITEM if one_at_a_time else b"")
    if one_at_a_time:
        return pickle.EMPTY_DICT + items
    return pickle.EMPTY_DICT + pickle.MARK + items + pickle.SETITEMS


@pytest.mark.parametrize("one_at_a_time", [False, True], ids=["setitems", "setitem"])
def test_a_dict_of_keys_sharing_one_hash_is_refused_before_it_is_built(tmp_path, one_at_a_time):
    src = saved(tmp_path)
    md = pickle.loads((src / ".metadata").read_bytes())
    md.planner_data = "FLOODMARK"
    raw = pickle.dumps(md, protocol=2)
    at = raw.index(b"FLOODMARK") - 5  # BINUNICODE, its 4-byte length, the text
    (src / ".metadata").write_bytes(raw[:at] + _colliding_dict(20_000, one_at_a_time) + raw[at + 14 :])
    started = time.perf_counter()
    refused(src, tmp_path, "share one hash")
    assert time.perf_counter() - started < 2  # the quadratic build takes several seconds


@pytest.mark.parametrize("key", ["deep", "shared"])
def test_a_key_whose_hash_would_crash_or_take_hours_is_refused_before_it_is_hashed(tmp_path, key):
    """The unpickler hashed every key to count those of one hash: a key nested a million tuples deep crashed
    the process, one shared 40 levels deep (t = (t, t)) took hours."""
    src = saved(tmp_path)
    md = pickle.loads((src / ".metadata").read_bytes())
    md.planner_data = "FLOODMARK"
    raw = pickle.dumps(md, protocol=2)
    at = raw.index(b"FLOODMARK") - 5  # BINUNICODE, its 4-byte length, the text
    if key == "deep":
        value = pickle.EMPTY_DICT + pickle.BINUNICODE + b"\x01\x00\x00\x00x" + pickle.TUPLE1 * 5000
    else:
        put = pickle.BINPUT + b"\xf0" + pickle.POP
        value = pickle.EMPTY_DICT + pickle.BINUNICODE + b"\x01\x00\x00\x00x" + pickle.TUPLE1 + put
        for _ in range(40):
            value += pickle.BINGET + b"\xf0" + pickle.BINGET + b"\xf0" + pickle.TUPLE2 + put
        value += pickle.BINGET + b"\xf0"
    value += pickle.BININT1 + b"\x00" + pickle.SETITEM
    (src / ".metadata").write_bytes(raw[:at] + value + raw[at + 14 :])
    refused(src, tmp_path, "nests tuples deeper than 100")


def test_a_metadata_index_key_hiding_a_deep_tuple_is_refused_before_it_is_hashed(tmp_path):
    """The key walk followed plain tuples only: a MetadataIndex key (a frozen dataclass, hashed as the tuple
    of its fields) whose offset nests a million tuples crashed the process."""
    src = saved(tmp_path)
    md = pickle.loads((src / ".metadata").read_bytes())
    md.planner_data = {MetadataIndex("w", (0,), 7777777): 0}
    raw = pickle.dumps(md, protocol=2)
    mark = pickle.BININT + (7777777).to_bytes(4, "little")  # a field set by BUILD, replaced by a deep tuple
    deep = pickle.BINUNICODE + b"\x01\x00\x00\x00x" + pickle.TUPLE1 * 5000
    (src / ".metadata").write_bytes(raw.replace(mark, deep, 1))
    refused(src, tmp_path, "nests tuples deeper than 100")
