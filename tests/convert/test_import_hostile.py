"""Imports of untrusted files (downloaded weights, archives from elsewhere), each built hostile here: a
refusal is a trainstate CheckpointError naming the file, and nothing is allocated or read beyond what the
file holds."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import pickletools
import struct
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import trainstate
from trainstate import _checksum as checksum
from trainstate._format import archive

# -- Hugging Face folders: shards stay inside the folder (or the hub cache's blob store) ------------------


def _hf_sharded(folder: Path, shard_names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {f"w{i}": name for i, name in enumerate(shard_names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_shard_linked_outside_its_folder_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file({"w0": torch.ones(2)}, outside / "secret.safetensors")
    folder = tmp_path / "model"
    _hf_sharded(folder, ["model-00001-of-00001.safetensors"])
    (folder / "model-00001-of-00001.safetensors").symlink_to(outside / "secret.safetensors")
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"model-00001-of-00001.safetensors.*outside"):
        trainstate.import_checkpoint(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_single_weights_file_linked_outside_its_folder_is_refused(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "secret.safetensors")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(tmp_path / "secret.safetensors")
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"model.safetensors.*outside"):
        trainstate.import_checkpoint(folder, tmp_path / "out")


def _hub_cache(root: Path, target_of: dict[str, str]) -> Path:
    """A hub cache's repo folder as huggingface_hub lays it out: blobs by hash, a snapshot of links to them."""
    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for i, (name, target) in enumerate(target_of.items()):
        blob = repo / "blobs" / f"{i:040x}"
        save_file({f"w{i}": torch.full((2,), float(i))}, blob)
        (snapshot / name).symlink_to(target or f"../../blobs/{blob.name}")
    index = repo / "blobs" / "index"
    index.write_text(json.dumps({"weight_map": {f"w{i}": name for i, name in enumerate(target_of)}}))
    (snapshot / "model.safetensors.index.json").symlink_to("../../blobs/index")
    return snapshot


def test_a_hub_cache_snapshot_imports_through_its_links_to_blobs(tmp_path):
    snapshot = _hub_cache(tmp_path, {"model-00001-of-00002.safetensors": "", "model-00002-of-00002.safetensors": ""})
    trainstate.import_checkpoint(snapshot, tmp_path / "out")
    with trainstate.open(tmp_path / "out") as ck:
        assert sorted(ck.keys()) == ["w0", "w1"]
        assert ck.read("w1", framework="torch").tolist() == [1.0, 1.0]


def test_a_hub_cache_link_out_of_its_blobs_is_refused(tmp_path):
    save_file({"w1": torch.ones(2)}, tmp_path / "secret.safetensors")
    snapshot = _hub_cache(
        tmp_path,
        {"model-00001-of-00002.safetensors": "", "model-00002-of-00002.safetensors": "../../../secret.safetensors"},
    )
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"model-00002-of-00002.safetensors.*outside"):
        trainstate.import_checkpoint(snapshot, tmp_path / "out")


@pytest.mark.parametrize(
    "shard", ["../model.safetensors", "/etc/model.safetensors", "sub/../model.safetensors", "..", "a\\..\\b.bin"]
)
def test_a_shard_name_that_leaves_the_folder_is_refused(tmp_path, shard):
    save_file({"w0": torch.ones(2)}, tmp_path / "model.safetensors")
    folder = tmp_path / "model"
    _hf_sharded(folder, [shard])
    with pytest.raises(trainstate.CorruptCheckpointError, match="not a file of its folder"):
        trainstate.import_checkpoint(folder, tmp_path / "out")


# -- torch.save files: tensors no bigger than their bytes in the file ------------------------------------


class _Storage:
    def __init__(self, declared: int) -> None:
        self.declared = declared


class _View:
    """Pickles as torch.save pickles a tensor: a view (offset, size, stride) of a float32 storage."""

    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.storage, self.place = storage, (offset, size, stride)

    def __reduce__(self) -> tuple[Any, ...]:
        offset, size, stride = self.place
        return torch._utils._rebuild_tensor_v2, (self.storage, offset, size, stride, False, collections.OrderedDict())


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, "0", "cpu", obj.declared)
        return None


def _torch_file(
    path: Path, declared: int, stored: int, offset: int, size: tuple[int, ...], stride: tuple[int, ...]
) -> None:
    """A torch.save file (torch's own zip writer) of one float32 view over one storage record of ``stored``
    floats whose pickle declares ``declared`` floats."""
    pickled = io.BytesIO()
    _Pickler(pickled, protocol=2).dump({"w": _View(_Storage(declared), offset, size, stride)})
    data = pickled.getvalue()
    with open(path, "wb") as f:
        writer = torch._C.PyTorchFileWriter(f, True, 64)
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", 1)
        writer.write_record(".storage_alignment", "64", 2)
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        storage = torch.arange(stored, dtype=torch.float32).untyped_storage()
        writer.write_record("data/0", storage, storage.nbytes())
        writer.write_end_of_file()
        del writer


def test_an_expanded_tensor_is_refused_not_materialized(tmp_path):
    src = tmp_path / "expanded.pt"
    torch.save({"w": torch.zeros(1).expand(25_000_000), "b": torch.ones(3)}, src)  # 4 bytes stored, 100 MB seen
    assert src.stat().st_size < 4096
    with pytest.raises(trainstate.UnsupportedValueError, match=r"expanded.pt.*\bw\b.*25000000 elements.*4 bytes"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_broadcast_buffer_of_its_own_size_still_imports(tmp_path):
    # BERT's position_ids: arange(n).expand((1, -1)), stride 0 only on a dimension of one
    src = tmp_path / "bert.bin"
    torch.save({"position_ids": torch.arange(8).expand((1, -1))}, src)
    trainstate.import_checkpoint(src, tmp_path / "out")
    with trainstate.open(tmp_path / "out") as ck:
        assert ck.read("position_ids", framework="torch").tolist() == [list(range(8))]


@pytest.mark.parametrize(
    ("declared", "stored", "offset", "size", "stride"),
    [
        (4, 4, 2, (4,), (1,)),  # offset past the storage
        (4, 4, 0, (3,), (2,)),  # strides past the storage
        (1 << 30, 4, 0, (200,), (1,)),  # a storage declared larger than its record: the rest of the file
        (4, 4, 0, (1 << 62,), (1,)),  # sizes that overflow
    ],
)
def test_a_view_past_its_storage_is_refused(tmp_path, declared, stored, offset, size, stride):
    src = tmp_path / "hostile.pt"
    _torch_file(src, declared, stored, offset, size, stride)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"hostile.pt"):
        trainstate.import_checkpoint(src, tmp_path / "out")


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("dtype", ["float4_e2m1fn_x2", "quint8"])
def test_a_torch_tensor_of_a_dtype_trainstate_does_not_store_is_named(tmp_path, dtype):
    if not hasattr(torch, dtype):
        pytest.skip(f"torch {torch.__version__} has no {dtype}")
    if dtype == "quint8":
        t = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8)
    else:
        t = torch.zeros(4, dtype=torch.uint8).view(getattr(torch, dtype))
    src = tmp_path / "odd.pt"
    torch.save({"w": t}, src)
    with pytest.raises(trainstate.CheckpointError, match=r"odd.pt"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_sparse_tensor_is_refused_with_the_file_named(tmp_path):
    src = tmp_path / "sparse.pt"
    torch.save({"w": torch.eye(3).to_sparse()}, src)
    with pytest.raises(trainstate.CheckpointError, match=r"sparse.pt"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_pickle_referring_to_one_value_many_times_is_refused_not_imported_each_time(tmp_path):
    src = tmp_path / "refs.pt"
    big = b"x" * (1 << 20)
    torch.save({"w": torch.zeros(4), "extra": [big] * 200}, src)  # 1 MiB file: each reference is 2 bytes
    with pytest.raises(trainstate.UnsupportedValueError, match=r"refs.pt: extra\.\d+: .*same values over and over"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_nested_repeated_lists_are_refused_before_they_are_walked(tmp_path):
    x: Any = [0] * 10
    for _ in range(11):  # 10**12 values in a pickle of under 2 KB
        x = [x] * 10
    src = tmp_path / "laughs.pt"
    torch.save({"x": x}, src)
    with pytest.raises(trainstate.UnsupportedValueError, match=r"laughs.pt: x\..*same values over and over"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_values_a_pickle_shares_a_few_times_still_import(tmp_path):
    betas = (0.9, 0.999)
    groups = [{"lr": 0.1, "betas": betas, "params": [i]} for i in range(100)]
    src = tmp_path / "optim.pt"
    torch.save({"model": {"w": torch.ones(3)}, "param_groups": groups}, src)
    trainstate.import_checkpoint(src, tmp_path / "out")
    assert trainstate.load(tmp_path / "out")["param_groups"] == groups


def test_a_source_that_is_neither_file_nor_folder_is_an_invalid_argument(tmp_path):
    fifo = tmp_path / "weights.pt"
    os.mkfifo(fifo)
    with pytest.raises(trainstate.InvalidArgumentError, match=r"weights.pt is neither a file nor a folder"):
        trainstate.import_checkpoint(fifo, tmp_path / "out")


def test_a_re_zipped_torch_file_is_refused_saying_its_records_are_compressed(tmp_path):
    import zipfile

    original = tmp_path / "orig.pt"
    torch.save({"w": torch.arange(1 << 12, dtype=torch.float32)}, original)
    src = tmp_path / "rezipped.pt"
    with zipfile.ZipFile(original) as zin, zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    with pytest.raises(trainstate.UnsupportedValueError, match=r"rezipped.pt: its zip records are compressed"):
        trainstate.import_checkpoint(src, tmp_path / "out")


# -- safetensors files -----------------------------------------------------------------------------------


def _safetensors(path: Path, header: Any, data: bytes = b"") -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("code", ["F4", "F6_E2M3", "F8_E8M0FNU", "Q4_K"])
def test_an_unsupported_safetensors_dtype_is_named(tmp_path, code):
    src = tmp_path / "fp4.safetensors"
    _safetensors(src, {"w": {"dtype": code, "shape": [4], "data_offsets": [0, 2]}}, b"\0\0")
    with pytest.raises(trainstate.UnsupportedValueError, match=rf"fp4.safetensors.*unsupported dtype {code}\b"):
        trainstate.import_checkpoint(src, tmp_path / "out")


@pytest.mark.parametrize(
    "header",
    [
        b"\xff\xfe{",  # not UTF-8
        {"w": {"dtype": "F32", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 4]}},
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}, "__metadata__": {"a": 1}},
        {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}},
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {"trainstate.tied": "{"}},
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {"trainstate.tied": '{"a": 1}'}},
        [1, 2],
        {"w": [1]},
    ],
)
def test_a_malformed_safetensors_file_is_a_checkpoint_error_naming_it(tmp_path, header):
    src = tmp_path / "bad.safetensors"
    _safetensors(src, header, b"\0" * 4)
    with pytest.raises(trainstate.CheckpointError, match=r"bad.safetensors"):
        trainstate.import_checkpoint(src, tmp_path / "out")


@pytest.mark.parametrize(
    "ranges",
    [
        [(0, 1024)] * 3,  # many names over one range: each would be imported in full
        [(0, 1024), (512, 1536)],  # a range starting inside another
        [(0, 2048), (1024, 2048)],  # a range inside another
    ],
)
def test_safetensors_tensors_over_the_same_bytes_are_refused_not_each_imported(tmp_path, ranges):
    src = tmp_path / "evil.safetensors"
    header = {f"t{i}": {"dtype": "U8", "shape": [e - b], "data_offsets": [b, e]} for i, (b, e) in enumerate(ranges)}
    _safetensors(src, header, b"\1" * 2048)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"evil.safetensors.*overlap"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_empty_safetensors_tensors_beside_others_still_import(tmp_path):
    src = tmp_path / "ok.safetensors"
    header = {
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "e": {"dtype": "F32", "shape": [0], "data_offsets": [2, 2]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
    }
    _safetensors(src, header, bytes(range(8)))
    trainstate.import_checkpoint(src, tmp_path / "out")
    loaded = trainstate.load(tmp_path / "out")
    assert bytes(loaded["a"]) + bytes(loaded["b"]) == bytes(range(8))
    assert loaded["e"].shape == (0,)


@pytest.mark.parametrize(
    "index",
    [
        b"\xff\xfe",
        b"[]",
        b'{"weight_map": []}',
        b'{"weight_map": {"w": 5}}',
        b'{"weight_map": {"w": "missing.safetensors"}}',
        b'{"weight_map": {"w": "model.bin"}}',  # a .bin shard that is not a torch file
    ],
)
def test_a_malformed_hugging_face_folder_is_a_checkpoint_error_naming_it(tmp_path, index):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_bytes(index)
    (folder / "model.bin").write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(trainstate.CheckpointError, match=r"model"):
        trainstate.import_checkpoint(folder, tmp_path / "out")


# -- packed archives: the index costs what its bytes do ----------------------------------------------------


def _packed(tmp_path: Path) -> bytes:
    trainstate.save(tmp_path / "ckpt", {"w": torch.ones(3)})
    return trainstate.pack(tmp_path / "ckpt")


def _with_index(blob: bytes, index: bytes, total: int | None = None, length: int | None = None) -> bytes:
    """An archive with another index (the header's checksum made right for it, as anyone can)."""
    magic, major, minor, n, old_total, _ = archive.HEADER.unpack(blob[: archive.HEADER.size])
    rest = blob[archive.HEADER.size + n :]
    head = archive.HEADER.pack(magic, major, minor, len(index) if length is None else length, total or old_total, 0)
    head = head[:24] + struct.pack("<Q", checksum.value_of(head[:24] + index))
    return head + index + rest


def test_a_tiny_archive_declaring_a_huge_index_is_refused_without_allocating_it(tmp_path):
    blob = _packed(tmp_path)
    for length in (archive.MAX_INDEX, (1 << 32) - 1):
        hostile = _with_index(blob[:4096], b"{}", length=length)[:100]
        tracemalloc.start()
        with pytest.raises(trainstate.CorruptCheckpointError, match="index"):
            trainstate.open(hostile)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20


def test_an_index_of_many_tiny_entries_costs_memory_in_proportion_to_its_bytes(tmp_path):
    blob = _packed(tmp_path)
    fillers = (b"{},", b"[],", b"1.5,", b'"",', b"1.5e+00,", b'"abcde",', b"[[[[[[[]]]]]]],")
    for filler in fillers:  # values that parse to Python objects far bigger than their bytes
        index = b'{"files":[' + filler * (1_200_000 // len(filler)) + b"0]}"
        tracemalloc.start()
        with pytest.raises(trainstate.CorruptCheckpointError, match="index"):
            trainstate.open(_with_index(blob, index))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 12 * len(index), (filler, peak, len(index))  # 26x for {} before the check


@pytest.mark.parametrize(
    "files",
    [
        [{"name": 5, "offset": 4096, "length": 1}],
        [{"name": ["manifest.json"], "offset": 4096, "length": 1}],
        [{"name": "manifest.json", "offset": 4096, "length": 10**30}],
        [{"name": "manifest.json", "offset": 4096.0, "length": 1}],
        [{"name": "manifest.json", "offset": True, "length": 1}],
        [{"name": "manifest.json", "offset": 4096, "length": 1}, {"name": "../x", "offset": 8192, "length": 1}],
        [{"name": "manifest.json", "offset": 4096, "length": 1}, {"name": "\udc80", "offset": 8192, "length": 1}],
        [None],
        "files",
    ],
)
def test_a_hostile_archive_index_is_a_checkpoint_error(tmp_path, files):
    blob = _packed(tmp_path)
    index = json.dumps({"files": files}).encode()
    with pytest.raises(trainstate.CheckpointError):
        trainstate.open(_with_index(blob, index))


def test_a_damaged_archive_file_is_a_checkpoint_error_naming_it(tmp_path):
    blob = bytearray(_packed(tmp_path))
    path = tmp_path / "model.tsar"
    for cut in (10, 40, 4096, 4200, len(blob) - 1):
        path.write_bytes(blob[:cut])
        with pytest.raises(trainstate.CheckpointError, match="model.tsar"):
            with trainstate.open(str(path)) as ck:
                ck.verify()
    os.unlink(path)


# -- whatever a torch.save file holds, a refusal names the file ------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [{"d": torch.device("cpu")}, {"s": {1, 2}}, {(1, 2): torch.ones(1)}, {"c": 1 + 2j}],
    ids=["device", "set", "tuple key", "complex"],
)
def test_a_value_trainstate_does_not_store_is_refused_naming_the_file(tmp_path, obj):
    src = tmp_path / "odd.pt"
    torch.save(obj, src)
    with pytest.raises(trainstate.UnsupportedValueError, match=r"odd.pt"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_an_empty_expanded_tensor_imports(tmp_path):
    src = tmp_path / "empty.pt"
    torch.save({"e": torch.ones(1).expand(0), "f": torch.ones(3, 1).expand(3, 0)}, src)
    trainstate.import_checkpoint(src, tmp_path / "out")
    with trainstate.open(tmp_path / "out") as ck:
        assert ck.read("e", framework="torch").shape == (0,) and ck.read("f", framework="torch").shape == (3, 0)


def test_a_compressed_pickle_larger_than_its_file_is_refused_unread(tmp_path):
    import zipfile

    src = tmp_path / "bomb.pt"
    with zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as z:  # 50 MB of pickle in a file of 50 KB
        z.writestr("a/data.pkl", b"(" * 50_000_000)
        z.writestr("a/byteorder", b"little")
        z.writestr("a/version", b"3")
    assert src.stat().st_size < 1 << 20
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"bomb.pt: its pickle \(data.pkl\) claims more bytes"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_many_views_of_one_storage_cannot_make_a_small_file_a_huge_checkpoint(tmp_path):
    base = torch.zeros(250_000)  # 1 MB stored once; 200 views of it would import 200 MB
    src = tmp_path / "views.pt"
    torch.save({f"v{i}": base[i:] for i in range(200)}, src)
    assert src.stat().st_size < 2 << 20
    with pytest.raises(trainstate.UnsupportedValueError, match=r"views.pt: tensor 'v\d+' is one view too many"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_tensor_beside_a_view_of_it_and_tied_names_still_import(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    src = tmp_path / "ok.pt"
    torch.save({"w": w, "row": w[0], "tied": w, "q": w[:1], "k": w[1:2], "v": w[2:]}, src)
    trainstate.import_checkpoint(src, tmp_path / "out")
    with trainstate.open(tmp_path / "out") as ck:
        assert ck.read("row", framework="torch").tolist() == [0.0, 1.0, 2.0, 3.0]


# -- a torch.save file damaged after it was written: its zip's CRC-32 says so ---------------------------------


def test_a_torch_save_file_with_a_flipped_tensor_byte_is_refused_not_checksummed_anew(tmp_path):
    """torch.load does not check the zip's CRC-32s: one flipped byte of tensor data imported, was checksummed
    by trainstate as if it were the tensor, and verified."""
    src = tmp_path / "w.pt"
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, src)
    data = bytearray(src.read_bytes())
    at = data.index(torch.arange(4096, dtype=torch.float32).numpy().tobytes()[4000:4016])
    data[at] ^= 0x01
    src.write_bytes(bytes(data))
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"w\.pt.*CRC"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"", b"hello, these are notes\n", b'{"hidden_size": 8}', b"\x00" * 64])
def test_a_file_that_was_never_a_checkpoint_is_an_argument_error_saying_what_imports(tmp_path, content):
    """A config or a text file was reported as a damaged torch.save file ("Unsupported operand 123"), exit 5."""
    src = tmp_path / "config.bin"
    src.write_bytes(content)
    with pytest.raises(trainstate.InvalidArgumentError, match=r"config\.bin is not a file trainstate can import"):
        trainstate.import_checkpoint(src, tmp_path / "out")


# -- the legacy format (torch.save before 1.6, old Hugging Face .bin files): every storage read from the file --


class _LegacyPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, "0", "cpu", obj.declared, None)
        return None


def _legacy_file(path: Path, declared: int, keys: list[str], data: bytes) -> None:
    """A legacy torch.save file of one float32 tensor over a storage of ``declared`` floats; its storage-keys
    list is ``keys``, and ``data`` follows it (each storage's 8-byte count, then its bytes)."""
    out = io.BytesIO()
    for head in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(head, out, protocol=2)
    _LegacyPickler(out, protocol=2).dump({"w": _View(_Storage(declared), 0, (declared,), (1,))})
    pickle.dump(keys, out, protocol=2)
    path.write_bytes(out.getvalue() + data)


@pytest.mark.parametrize(
    ("declared", "keys", "data"),
    [
        (1 << 26, [], b""),  # never filled: torch leaves 256 MB of this process's memory in the tensor
        (64, [], b""),
        (64, ["0"], struct.pack("<q", 64) + b"\0" * 16),  # filled from bytes the file does not hold
        (64, ["0"], struct.pack("<q", 63) + b"\0" * 256),  # its count is not the declared one
        (64, ["0"], b"\0" * 4),  # no count
    ],
)
def test_a_legacy_torch_file_whose_storage_is_not_in_the_file_is_refused(tmp_path, declared, keys, data):
    """torch's legacy loader allocates each declared storage uninitialized and fills only those the keys list
    names: the tensor imported the importing process's heap (pointers), checksummed as if it were weights."""
    src = tmp_path / "legacy.pt"
    _legacy_file(src, declared, keys, data)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"legacy\.pt"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_hand_built_legacy_torch_file_that_holds_its_storage_imports(tmp_path):
    src = tmp_path / "legacy.pt"
    values = torch.arange(64, dtype=torch.float32)
    _legacy_file(src, 64, ["0"], struct.pack("<q", 64) + values.numpy().tobytes())
    trainstate.import_checkpoint(src, tmp_path / "out")
    with trainstate.open(tmp_path / "out") as ck:
        assert torch.equal(ck.read("w", framework="torch"), values)


def test_a_legacy_torch_save_file_imports_bit_exactly(tmp_path):
    w = torch.randn(5, 7)
    state = {"w": w, "row": w[1], "b": torch.arange(6, dtype=torch.int64), "h": torch.randn(3).half(), "n": 3}
    src = tmp_path / "pytorch_model.bin"
    torch.save(state, src, _use_new_zipfile_serialization=False)
    assert not src.read_bytes().startswith(b"PK")
    trainstate.import_checkpoint(src, tmp_path / "out")
    with trainstate.open(tmp_path / "out") as ck:
        for name in ("w", "row", "b", "h"):
            got = ck.read(name, framework="torch")
            assert got.dtype == state[name].dtype and got.numpy().tobytes() == state[name].numpy().tobytes()


def test_a_torch_file_of_the_tar_format_is_refused_naming_it(tmp_path):
    """torch 0.3 and older saved a tar archive, which torch.load reads only by running its pickles."""
    import tarfile

    src = tmp_path / "ancient.pt"
    with tarfile.open(src, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("storages", pickle.dumps(0, protocol=2)), ("tensors", pickle.dumps(0, protocol=2))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(trainstate.CheckpointError, match=r"ancient\.pt"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_torch_save_zip_after_another_is_refused_not_read_two_ways(tmp_path):
    """torch's zip reader and Python's zipfile (which checks the CRC-32s) each read one of two zips laid end to
    end: torch imported the first, whose bytes no check had read."""
    first, second = io.BytesIO(), io.BytesIO()
    torch.save({"w": torch.full((4,), 7.0)}, first)
    torch.save({"w": torch.arange(4.0)}, second)
    src = tmp_path / "two.pt"
    src.write_bytes(first.getvalue() + second.getvalue())
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"two\.pt.*before its zip"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def _colliding_dict(n: int) -> bytes:
    """A protocol-2 pickle of a dict of ``n`` int keys that all hash to 0 (``k * (2**61 - 1)``): each
    insertion probes every earlier key, so unpickling it takes time quadratic in ``n``."""
    items = b""
    for k in range(1, n + 1):
        key = (k * ((1 << 61) - 1)).to_bytes(10, "little", signed=True)
        items += pickle.LONG1 + b"\x0a" + key + pickle.BININT1 + b"\x00"
    return pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.MARK + items + pickle.SETITEMS + pickle.STOP


def _zip_of(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        writer = torch._C.PyTorchFileWriter(f, True, 64)
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", 1)
        writer.write_record(".storage_alignment", "64", 2)
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        writer.write_end_of_file()
        del writer


def _legacy_of(path: Path, data: bytes) -> None:
    out = io.BytesIO()
    pickle.dump(0x1950A86A20F9469CFC6C, out, protocol=2)  # torch's legacy magic number
    pickle.dump(1001, out, protocol=2)
    pickle.dump({"protocol_version": 1001, "little_endian": True, "type_sizes": {"int": 4, "long": 4}}, out, protocol=2)
    out.write(data)
    pickle.dump([], out, protocol=2)  # the storage keys: none
    path.write_bytes(out.getvalue())


@pytest.mark.parametrize("layout", [_zip_of, _legacy_of], ids=["zip", "legacy"])
def test_a_pickle_of_many_numbers_sharing_one_hash_is_refused_before_it_is_unpickled(tmp_path, layout):
    src = tmp_path / "flood.pt"
    layout(src, _colliding_dict(20_000))
    started = time.perf_counter()
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"flood.pt: .*share one hash"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    assert time.perf_counter() - started < 2  # unpickling it takes several seconds
    assert not (tmp_path / "out").exists()


def test_a_model_and_optimizer_state_saved_by_torch_still_import(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    group = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0,
        "amsgrad": False,
        "params": [0, 1, 2, 3],
    }
    state = {i: {"step": torch.tensor(1.0), "exp_avg": p.detach() * 0.1} for i, p in enumerate(model.parameters())}
    optim = {"state": state, "param_groups": [group]}  # Adam's state_dict(), without a slow torch.optim import
    src = tmp_path / "both.pt"
    torch.save({"model": model.state_dict(), "optim": optim, "ints": {k: -k for k in range(-5000, 5000)}}, src)
    trainstate.import_checkpoint(src, tmp_path / "out")
    back = trainstate.load(tmp_path / "out", framework="torch")
    assert sorted(back["optim"]["state"]) == list(range(4)) and len(back["ints"]) == 10_000


_P1, _P2, _P5, _W = 11400714785074694791, 14029467366897019727, 2870177450012600261, (1 << 64) - 1


def _colliding_pairs(n: int) -> list[tuple[int, int]]:
    """``n`` pairs of ints of distinct hashes whose tuples all share one hash: CPython's tuple hash (xxHash's
    round, the same since 3.8) solved for the second item."""
    acc2 = (12345 - (2 ^ (_P5 ^ 3527539))) & _W
    lanes = (acc2 * pow(_P1, -1, 1 << 64)) & _W
    lanes = ((lanes >> 31) | (lanes << 33)) & _W
    pairs = []
    for k in range(1, 100 * n):
        acc1 = (_P5 + k * _P2) & _W
        acc1 = (((acc1 << 31) | (acc1 >> 33)) & _W) * _P1 & _W
        second = ((lanes - acc1) * pow(_P2, -1, 1 << 64)) & _W
        second -= (second >> 63) << 64
        if abs(second) < (1 << 61) - 1 and second != -1:
            pairs.append((k, second))
            if len(pairs) == n:
                break
    return pairs


def test_tuple_keys_of_one_hash_built_from_numbers_of_distinct_hashes_are_refused(tmp_path):
    pairs = _colliding_pairs(9)
    assert len({hash(p) for p in pairs}) == 1 and len({hash(x) for p in pairs for x in p}) == 18
    src = tmp_path / "pairs.pt"
    torch.save({"w": torch.zeros(2), "x": dict.fromkeys(pairs, 0)}, src)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"pairs.pt: .*share one hash"):
        trainstate.import_checkpoint(src, tmp_path / "out")


@pytest.mark.parametrize("depth", [50, 100_000])
def test_deeply_nested_tuples_are_hashed_no_deeper_than_a_limit(tmp_path, depth):
    data = pickle.PROTO + b"\x02" + pickle.BININT1 + b"\x01" + pickle.TUPLE1 * depth + pickle.STOP
    src = tmp_path / "deep.pt"
    _zip_of(src, data)
    if depth > 100:
        with pytest.raises(trainstate.CorruptCheckpointError, match=r"deep.pt: .*nests tuples deeper than 100 levels"):
            trainstate.import_checkpoint(src, tmp_path / "out")
    else:
        trainstate.import_checkpoint(src, tmp_path / "out")


def _deep_key(depth: int) -> bytes:
    """A dict whose one key is a string in ``depth`` nested one-tuples: hashing it recurses ``depth`` deep in C
    (a million levels crash the interpreter)."""
    key = pickle.BINUNICODE + b"\x01\x00\x00\x00x" + pickle.TUPLE1 * depth
    return pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + key + pickle.BININT1 + b"\x00" + pickle.SETITEM + pickle.STOP


def _shared_key(levels: int) -> bytes:
    """A dict whose key is ``(t_0, ..., t_n)`` with ``t_0 = ('x',)`` and ``t_k = (t_k-1, t_k-1)`` through the
    memo: a few bytes a level, and 2**levels items to hash (tuples cache no hash)."""
    body = pickle.MARK + pickle.BINUNICODE + b"\x01\x00\x00\x00x" + pickle.TUPLE1 + pickle.BINPUT + b"\x00"
    for k in range(levels):
        body += pickle.BINGET + bytes([k]) + pickle.BINGET + bytes([k]) + pickle.TUPLE2 + pickle.BINPUT + bytes([k + 1])
    body += pickle.TUPLE
    return pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + body + pickle.BININT1 + b"\x00" + pickle.SETITEM + pickle.STOP


@pytest.mark.parametrize("layout", ["zip", "legacy"])
@pytest.mark.parametrize("key", ["deep", "shared"])
def test_a_key_whose_hash_would_crash_or_take_hours_is_refused_before_it_is_hashed(tmp_path, key, layout):
    """A string in 5,000 nested tuples crashed the importing process (hashing recursed past the C stack at a
    million levels; 5,000 keeps the test's own pickle small); a tuple shared 40 levels deep took hours."""
    src = tmp_path / "key.pt"
    (_zip_of if layout == "zip" else _legacy_of)(src, _deep_key(5000) if key == "deep" else _shared_key(40))
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"key\.pt: .*nests tuples deeper than 100"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_complex_keys_of_one_hash_built_by_reduce_are_refused(tmp_path):
    """complex(2**52 - 1000003*i, i) all hash to 2**52 while their parts do not: the scan followed plain
    numbers only, so a dict of them unpickled in quadratic time (30 s for 40,000)."""
    src = tmp_path / "complex.pt"
    _zip_of(src, pickle.dumps({complex(2**52 - 1000003 * i, i): 0 for i in range(20)}, protocol=2))
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"complex\.pt: .*share one hash"):
        trainstate.import_checkpoint(src, tmp_path / "out")


@pytest.mark.parametrize(
    "body",
    [
        pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.EMPTY_TUPLE + pickle.NEWOBJ,
        pickle.MARK + pickle.INST + b"collections\nOrderedDict\n",
        pickle.EXT1 + b"\x01",
        pickle.PERSID + b"0\n",
        pickle.EMPTY_DICT + pickle.EMPTY_TUPLE + pickle.BUILD,
        pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n" + pickle.EMPTY_DICT + pickle.BUILD,
    ],
    ids=["newobj", "inst", "extension", "text persistent id", "build a dict", "build a function"],
)
def test_an_opcode_a_torch_save_never_writes_is_refused(tmp_path, body):
    """torch's pickles are read by trainstate's own unpickler, which refuses what torch.save never writes (an
    object built by NEWOBJ or INST, an extension code, attributes set on anything but an OrderedDict)."""
    src = tmp_path / "odd.pt"
    _zip_of(src, pickle.PROTO + b"\x02" + body + pickle.STOP)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"odd\.pt: its pickle is refused"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_legacy_files_list_of_storages_is_scanned_too(tmp_path):
    """A legacy file is five pickles; the scan read four, and the fifth (the storages' keys, unpickled by the
    storage check and by torch.load) built a dict of keys of one hash below the list it returns."""
    buf = io.BytesIO()
    torch.save({"a": 1}, buf, _use_new_zipfile_serialization=False)
    raw = buf.getvalue()
    f = io.BytesIO(raw)
    for _ in range(4):
        for _op in pickletools.genops(f):
            pass
    keys = b"".join(
        pickle.LONG1 + bytes([9]) + (k * ((1 << 61) - 1)).to_bytes(9, "little") + pickle.NONE for k in range(1, 20)
    )
    fifth = (
        pickle.PROTO
        + b"\x02"
        + pickle.EMPTY_DICT
        + pickle.MARK
        + keys
        + pickle.SETITEMS
        + pickle.EMPTY_LIST
        + pickle.STOP
    )
    src = tmp_path / "legacy.bin"
    src.write_bytes(raw[: f.tell()] + fifth)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"legacy\.bin: .*share one hash"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_bytearray_of_a_given_length_is_refused_before_it_is_allocated(tmp_path):
    """bytearray is on torch's allowlist: a 74-byte pickle made the import allocate 2 GB."""
    src = tmp_path / "alloc.pt"
    data = (
        pickle.PROTO
        + b"\x02"
        + pickle.GLOBAL
        + b"__builtin__\nbytearray\n"
        + pickle.BININT
        + (1 << 30).to_bytes(4, "little")
    )
    _zip_of(src, data + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"alloc\.pt: .*bytearray of a given length"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_dict_key_built_from_objects_is_refused_before_the_dict_is_built(tmp_path):
    """A key holding a global or a built object ((a, b, torch.float32), a tuple of references to one long
    torch.Size) has a hash the scan cannot bound or count: keys of one hash were built in quadratic time."""
    src = tmp_path / "keys.pt"
    _zip_of(src, pickle.dumps({(1, 2, torch.float32): 0}, protocol=2))
    with pytest.raises(trainstate.UnsupportedValueError, match=r"keys\.pt: .*fills a dict with a key"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_dict_built_from_a_list_is_refused_and_a_set_of_keys_of_one_hash_too(tmp_path):
    """OrderedDict(pairs) or set(items) hash what the list holds as they are built: torch.save never builds
    a dict from a list, and a set's items are checked as a dict's keys are, before they are hashed."""
    src = tmp_path / "built.pt"
    _zip_of(
        src,
        pickle.dumps(collections.OrderedDict, protocol=2)[:-1]
        + pickle.dumps([((1, 2), 0)], protocol=2)[2:-1]
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP,
    )
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"built\.pt: .*builds a OrderedDict from arguments"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    _zip_of(src, pickle.dumps({k * ((1 << 61) - 1) for k in range(1, 20)}, protocol=2))
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"built\.pt: .*share one hash"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    torch.save({"w": torch.zeros(2), "sd": collections.OrderedDict(a=torch.ones(1))}, src)  # as torch.save fills them
    assert trainstate.load(trainstate.import_checkpoint(src, tmp_path / "ok").path)["sd"]["a"].tolist() == [1.0]


# -- the pickle is read by trainstate's own unpickler: torch's never runs on an imported file ------------------


def test_torch_s_unpickler_never_reads_an_imported_file(tmp_path, monkeypatch):
    """Every torch.save import (zip, legacy, a DCP directory's chunks and values) goes through trainstate's own
    restricted unpickler: torch's weights-only unpickler builds what a hostile file chooses before any check
    of trainstate's could see it."""
    import torch._weights_only_unpickler as wou
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(3, 4), "step": 7, "betas": (0.9, 0.999)}
    torch.save(state, tmp_path / "zip.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)

    def never(*args, **kwargs):
        raise AssertionError("torch's unpickler ran on an imported file")

    monkeypatch.setattr(wou, "Unpickler", never)
    monkeypatch.setattr(torch, "load", never)
    for name in ("zip.pt", "legacy.pt", "dcp"):
        trainstate.import_checkpoint(tmp_path / name, tmp_path / f"out-{name}")
        back = trainstate.load(tmp_path / f"out-{name}", framework="torch")
        assert torch.equal(back["w"], state["w"]) and back["step"] == 7 and tuple(back["betas"]) == (0.9, 0.999)


def test_a_long_string_a_pickle_encodes_again_and_again_is_refused(tmp_path):
    """Protocol 2 pickles bytes as _codecs.encode(str, 'latin1'): a memo reference to one 1 MiB string,
    encoded 2,000 times in 20 kB of opcodes, would have built 2 GiB of bytes."""
    body = pickle.BINUNICODE + (1 << 20).to_bytes(4, "little") + b"x" * (1 << 20) + pickle.BINPUT + b"\x00"
    one = (
        pickle.GLOBAL
        + b"_codecs\nencode\n"
        + pickle.BINGET
        + b"\x00"
        + pickle.SHORT_BINUNICODE
        + b"\x06latin1"
        + pickle.TUPLE2
        + pickle.REDUCE
        + pickle.APPEND
    )
    src = tmp_path / "copies.pt"
    _zip_of(src, pickle.PROTO + b"\x02" + body + pickle.POP + pickle.EMPTY_LIST + one * 2000 + pickle.STOP)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"copies\.pt: .*same values over and over"):
        trainstate.import_checkpoint(src, tmp_path / "out")


@pytest.mark.parametrize("name", ["__class__", "__dict__", "not a name", "values"])
def test_an_ordered_dict_is_given_plain_attributes_only(tmp_path, name):
    """A state_dict's OrderedDict carries _metadata as an attribute (BUILD); any other is refused: its
    __class__, or a ``values`` that stood in for the method the import reads the dict with."""
    od = pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.EMPTY_TUPLE + pickle.REDUCE
    state = pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + bytes([len(name)]) + name.encode() + pickle.NONE
    src = tmp_path / "attrs.pt"
    _zip_of(src, pickle.PROTO + b"\x02" + od + state + pickle.SETITEM + pickle.BUILD + pickle.STOP)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"attrs\.pt: .*other than a state_dict's _metadata"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_state_dict_with_its_metadata_parameters_and_a_conjugate_view_imports_as_torch_loads_it(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    state = {
        "model": model.state_dict(),
        "p": torch.nn.Parameter(torch.randn(2)),
        "c": torch.complex(torch.randn(3), torch.randn(3)).conj(),
        "b": b"\x00\xffbytes",
    }
    src = tmp_path / "full.pt"
    torch.save(state, src)
    want = torch.load(src, weights_only=True)
    trainstate.import_checkpoint(src, tmp_path / "out")
    back = trainstate.load(tmp_path / "out", framework="torch")
    for name, value in want["model"].items():
        assert torch.equal(back["model"][name], value), name
    assert torch.equal(back["p"], want["p"].detach()) and back["b"] == state["b"]
    assert torch.equal(back["c"], want["c"].resolve_conj())


# -- a sixth attack: what the new reader allowed --------------------------------------------------------------


def test_neg_and_conj_views_of_one_tensor_are_not_tied(tmp_path):
    """A view with the negative or conjugate bit shares its tensor's memory, shape and strides: it was taken
    for a tie of it and stored as the tensor itself, by import and by save, in silence."""
    x = torch.arange(1.0, 5.0)
    z = torch.complex(torch.tensor([1.0, 3.0]), torch.tensor([2.0, -4.0]))
    state = {"x": x, "xn": x._neg_view(), "z": z, "zc": z.conj()}
    torch.save(state, tmp_path / "views.pt")
    trainstate.import_checkpoint(tmp_path / "views.pt", tmp_path / "imported")
    trainstate.save(tmp_path / "saved", state)
    for ckpt in ("imported", "saved"):
        back = trainstate.load(tmp_path / ckpt, framework="torch")
        for name, value in state.items():
            assert torch.equal(back[name], value.resolve_neg().resolve_conj()), (ckpt, name)


class _Named:
    """A float32 storage the test picklers name by their own persistent id (``pid``)."""

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _Over:
    """Pickles as a float32 tensor of ``size`` elements over the storage ``named``."""

    def __init__(self, named: _Named, size: int) -> None:
        self.named, self.size = named, size

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.named, 0, (self.size,), (1,), False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


class _NamedPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Named) else None


def test_legacy_views_of_one_storage_count_against_the_file(tmp_path):
    """Each legacy view (the persistent id's sixth element) became a storage of its own, so the views budget
    counted 300 overlapping views of one 1 MB storage as 300 MB stored: a 1 MB file imported 300 MB."""
    total = 250_000
    out = io.BytesIO()
    for head in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(head, out, protocol=2)
    views = {
        f"t{i}": _Over(_Named(("storage", torch.FloatStorage, "s", "cpu", total, ("s", i, total - i))), total - i)
        for i in range(300)
    }
    _NamedPickler(out, protocol=2).dump(views)
    pickle.dump(["s"], out, protocol=2)
    src = tmp_path / "views.bin"
    src.write_bytes(out.getvalue() + struct.pack("<q", total) + torch.zeros(total).numpy().tobytes())
    with pytest.raises(trainstate.UnsupportedValueError, match=r"views\.bin: tensor 't\d+' is one view too many"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_zip_records_inside_one_another_are_refused(tmp_path):
    """A record whose local header and bytes lie inside another record's bytes passes every CRC-32 (each
    record's own), and each overlapping storage was imported in full: 692 kB became 657 MB."""
    import zlib

    def local(name: bytes, size: int) -> bytes:
        return struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, 0, size, size, len(name), 0) + name

    floats = torch.arange(1024, dtype=torch.float32).numpy().tobytes()
    inner = local(b"a/data/1", len(floats)) + floats + b"\0\0"  # record 1 inside record 0 (whole floats)
    tensors = {
        key: _Over(_Named(("storage", torch.FloatStorage, key, "cpu", n // 4)), n // 4)
        for key, n in (("0", len(inner)), ("1", len(floats)))
    }
    buf = io.BytesIO()
    _NamedPickler(buf, protocol=2).dump(tensors)
    pickled = buf.getvalue()
    out, records = bytearray(), []
    for name, data in (
        (b"a/data.pkl", pickled),
        (b"a/data/0", inner),
        (b"a/byteorder", b"little"),
        (b"a/version", b"3\n"),
    ):
        records.append((name, len(out), data))
        out += local(name, len(data)) + data
    at = records[1][1] + len(local(b"a/data/0", len(inner)))
    records.append((b"a/data/1", at, floats))
    directory = b"".join(
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            20,
            20,
            0,
            0,
            0,
            0,
            zlib.crc32(d),
            len(d),
            len(d),
            len(n),
            0,
            0,
            0,
            0,
            0,
            o,
        )
        + n
        for n, o, d in records
    )
    src = tmp_path / "nested.pt"
    src.write_bytes(
        bytes(out) + directory + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 5, 5, len(directory), len(out), 0)
    )
    import zipfile

    assert zipfile.ZipFile(src).testzip() is None  # every record passes its CRC-32
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"nested\.pt: the records of storages .* overlap"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_huge_int_hashed_as_a_key_again_and_again_is_refused(tmp_path):
    """Python never caches an int's hash: one 500 kB int set as a dict key 150,000 times (a memo reference
    each) hashed every digit each time, minutes for a 1 MB file. An int counts as 64 bits an item."""
    digits = (1 << (8 * 200_000)) - 1
    body = pickle.LONG4 + len(digits.to_bytes(200_001, "little", signed=True)).to_bytes(4, "little")
    body += digits.to_bytes(200_001, "little", signed=True) + pickle.BINPUT + b"\x00" + pickle.POP
    items = (pickle.BINGET + b"\x00" + pickle.NONE) * 50_000
    src = tmp_path / "bigkey.pt"
    _zip_of(
        src, pickle.PROTO + b"\x02" + body + pickle.EMPTY_DICT + pickle.MARK + items + pickle.SETITEMS + pickle.STOP
    )
    started = time.perf_counter()
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"bigkey\.pt: .*64 bits an item"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    assert time.perf_counter() - started < 5


def test_an_int_key_of_more_digits_than_json_holds_is_refused_by_import_and_save(tmp_path):
    torch.save({10**5000: torch.zeros(2)}, tmp_path / "big.pt")
    with pytest.raises(trainstate.UnsupportedValueError, match=r"big\.pt: a dict key, an int of \d+ bits"):
        trainstate.import_checkpoint(tmp_path / "big.pt", tmp_path / "out")
    with pytest.raises(trainstate.UnsupportedValueError, match=r"a dict key, an int of \d+ bits"):
        trainstate.save(tmp_path / "saved", {10**5000: 1})


def test_many_legacy_storages_are_declared_in_linear_time(tmp_path):
    """Each declaration summed every storage declared before it: 16,000 empty storages took 25 s."""
    out = io.BytesIO()
    for head in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(head, out, protocol=2)

    class Empty:
        def __init__(self, key: str) -> None:
            self.key = key

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", torch.FloatStorage, obj.key, "cpu", 0, None) if isinstance(obj, Empty) else None

    Pickler(out, protocol=2).dump([Empty(str(i)) for i in range(16_000)])
    pickle.dump([], out, protocol=2)
    src = tmp_path / "many.bin"
    src.write_bytes(out.getvalue())
    started = time.perf_counter()
    with pytest.raises(trainstate.CheckpointError, match=r"many\.bin"):
        trainstate.import_checkpoint(src, tmp_path / "out")
    assert time.perf_counter() - started < 10


# -- a seventh attack --------------------------------------------------------------------------------------


def test_a_zip_that_torch_and_zipfile_read_as_two_archives_is_refused(tmp_path):
    """torch's reader finds the zip64 end record where the locator points; zipfile takes the one just before
    the locator. Two central directories gave the checks (zipfile's) a stored record and torch a deflated one,
    whose compressed bytes were imported as the tensor."""
    import zipfile
    import zlib

    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, tmp_path / "genuine.pt")
    with zipfile.ZipFile(tmp_path / "genuine.pt") as z:
        records = [(i.filename, z.read(i)) for i in z.infolist()]
    out = bytearray()

    def local(name: str, data: bytes, method: int, size: int, crc: int) -> tuple[Any, ...]:
        at, n = len(out), name.encode()
        out.extend(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0x21, crc, len(data), size, len(n), 0))
        out.extend(n + data)
        return n, method, crc, len(data), size, at

    def central(entries: list[tuple[Any, ...]]) -> bytes:
        return b"".join(
            struct.pack(
                "<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, m, 0, 0x21, c, cs, us, len(n), 0, 0, 0, 0, 0, a
            )
            + n
            for n, m, c, cs, us, a in entries
        )

    common, torch_sees, zipfile_sees = [], [], []
    for name, data in records:
        crc = zlib.crc32(data)
        if name.endswith("data/0"):
            deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
            torch_sees.append(local(name, deflate.compress(data) + deflate.flush(), 8, len(data), crc))
            zipfile_sees.append(local(name, data, 0, len(data), crc))
        else:
            common.append(local(name, data, 0, len(data), crc))
    ends = []
    for entries in (common + torch_sees, common + zipfile_sees):
        directory, at = central(entries), len(out)
        out.extend(directory)
        ends.append(len(out))
        out.extend(
            struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, len(entries), len(entries), len(directory), at)
        )
    out.extend(struct.pack("<4sIQI", b"PK\x06\x07", 0, ends[0], 1))  # the locator: the first zip64 end record
    out.extend(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    src = tmp_path / "two.pt"
    src.write_bytes(bytes(out))
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"two\.pt: torch's zip reader and the zip's own"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_bit_a_dtype_cannot_carry_is_refused_when_the_file_is_read(tmp_path):
    """A negative bit on a bool tensor was accepted, and resolving it when writing raised a raw
    NotImplementedError out of import_checkpoint."""
    bools = _Named(("storage", torch.BoolStorage, "0", "cpu", 4))

    class NegBool:
        def __reduce__(self) -> tuple[Any, ...]:
            args = (bools, 0, (4,), (1,), False, collections.OrderedDict(), {"neg": True})
            return torch._utils._rebuild_tensor_v2, args

    buf = io.BytesIO()
    _NamedPickler(buf, protocol=2).dump({"w": NegBool()})
    src = tmp_path / "negbool.pt"
    with open(src, "wb") as f:
        writer = torch._C.PyTorchFileWriter(f, True, 64)
        writer.write_record("data.pkl", buf.getvalue(), len(buf.getvalue()))
        writer.write_record("byteorder", "little", 6)
        writer.write_record("data/0", b"\x01\x00\x01\x00", 4)
        writer.write_end_of_file()
        del writer
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"negbool\.pt: .*torch\.bool tensor is given metadata"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_shape_no_reader_accepts_is_refused_by_every_writer(tmp_path):
    """The manifest reader refuses more than 32 dimensions or a dimension of 2**48: import, save and the
    manager wrote such tensors, reported success, and nothing could load them."""
    torch.save({"w": torch.zeros([2, 3] + [1] * 38)}, tmp_path / "deep.pt")
    with pytest.raises(trainstate.UnsupportedValueError, match=r"40 dimensions \(a manifest holds at most 32\)"):
        trainstate.import_checkpoint(tmp_path / "deep.pt", tmp_path / "out")
    torch.save({"w": torch.empty((0, 2**50))}, tmp_path / "wide.pt")
    with pytest.raises(trainstate.UnsupportedValueError, match=r"a dimension of 2\*\*48 or more"):
        trainstate.import_checkpoint(tmp_path / "wide.pt", tmp_path / "out")
    with pytest.raises(trainstate.UnsupportedValueError, match=r"33 dimensions"):
        trainstate.save(tmp_path / "saved", {"w": np.zeros([1] * 33)})
    with trainstate.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(trainstate.UnsupportedValueError, match=r"33 dimensions"):
            mgr.save(1, {"w": np.zeros([1] * 33)}, force=True)
        assert mgr.list() == []


def test_shards_that_are_links_to_one_file_share_one_budget(tmp_path):
    """Each shard had a views budget of its own file: eight links to one 1 MB file of views imported 490 MB.
    The folder's files are counted once each, however many names reach them."""
    base = torch.zeros(250_000)
    views = {f"v{i}": base[i:] for i in range(200)}
    folder = tmp_path / "model"
    folder.mkdir()
    torch.save(views, folder / "real.bin")
    weight_map = {}
    for i in range(200):
        shard = f"pytorch_model-{i % 8:05d}.bin"
        if not (folder / shard).exists():
            (folder / shard).symlink_to("real.bin")
        weight_map[f"v{i}"] = shard
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(trainstate.UnsupportedValueError, match=r"is one view too many"):
        trainstate.import_checkpoint(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- an eighth attack ---------------------------------------------------------------------------------------


def test_legacy_views_are_keyed_as_torch_keys_them(tmp_path):
    """torch's legacy loader keeps views by their own key (in the table storages are kept in) and sizes a view
    in the dtype its id names: the import sliced anew each time, in the storage's first dtype."""
    fs = torch.FloatStorage
    obj = {
        "a": _Over(_Named(("storage", fs, "k", "cpu", 8, ("v", 0, 4))), 4),
        "b": _Over(_Named(("storage", fs, "k", "cpu", 8, ("v", 4, 4))), 4),  # view "v" again: the first one
        "c": _Over(_Named(("storage", fs, "j", "cpu", 4, None)), 4),
        "d": _Over(_Named(("storage", fs, "k", "cpu", 8, ("j", 2, 4))), 4),  # a view key that is a storage's
    }
    out = io.BytesIO()
    for head in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(head, out, protocol=2)
    _NamedPickler(out, protocol=2).dump(obj)
    pickle.dump(["k", "j"], out, protocol=2)
    out.write(struct.pack("<q", 8) + torch.arange(8.0).numpy().tobytes())
    out.write(struct.pack("<q", 4) + (100 + torch.arange(4.0)).numpy().tobytes())
    src = tmp_path / "views.pt"
    src.write_bytes(out.getvalue())
    want = torch.load(src, weights_only=True)
    trainstate.import_checkpoint(src, tmp_path / "out")
    got = trainstate.load(tmp_path / "out", framework="torch")
    assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in want.items()}


def test_a_tied_alias_never_replaces_a_tensor_the_file_stores(tmp_path):
    """Export names an alias only for a tensor it did not store; an alias naming a stored tensor replaced it."""
    save_file(
        {"a": torch.zeros(4), "b": torch.arange(4.0)},
        tmp_path / "m.safetensors",
        metadata={"trainstate.tied": '{"b": "a"}'},
    )
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"m\.safetensors: __metadata__ trainstate\.tied"):
        trainstate.import_checkpoint(tmp_path / "m.safetensors", tmp_path / "out")


def test_a_shard_file_reached_by_many_names_is_read_once(tmp_path, monkeypatch):
    """1,000 shard names linked to one file were each read in full, each read listing every tensor: 19 s for
    an 80 kB folder, and 3,000 names never finished."""
    from trainstate._convert import import_

    folder = tmp_path / "model"
    folder.mkdir()
    save_file({f"t{i}": torch.zeros(1) for i in range(300)}, folder / "real.safetensors")
    weight_map = {}
    for i in range(300):
        (folder / f"model-{i:05d}.safetensors").symlink_to("real.safetensors")
        weight_map[f"t{i}"] = f"model-{i:05d}.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    reads = []
    original = import_._read_file
    monkeypatch.setattr(import_, "_read_file", lambda *a: reads.append(a) or original(*a))
    trainstate.import_checkpoint(folder, tmp_path / "out")
    assert len(reads) == 1
    with trainstate.open(tmp_path / "out") as ck:
        assert sorted(ck.keys()) == sorted(weight_map)


def test_dcp_entries_reached_through_hard_links_are_one_file_s_bytes(tmp_path):
    """The overlap check grouped byte ranges by path: hard links to one chunk file let many tensors declare its
    bytes, and 8 MiB imported as 335 MB."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    src = tmp_path / "dcp"
    dcp.save({"t0": torch.randn(1024)}, checkpoint_id=src, no_dist=True)
    md = pickle.loads((src / ".metadata").read_bytes())
    ((index, info),) = md.storage_data.items()
    for i in range(1, 4):
        os.link(src / info.relative_path, src / f"h{i}.distcp")
        md.state_dict_metadata[f"t{i}"] = copy.deepcopy(md.state_dict_metadata["t0"])
        md.storage_data[MetadataIndex(f"t{i}", index.offset)] = type(info)(f"h{i}.distcp", info.offset, info.length)
        if md.planner_data:
            md.planner_data[f"t{i}"] = (f"t{i}",)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"\.metadata: the bytes of 't\d' in .* overlap"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_dcp_values_that_decompress_past_the_source_are_refused(tmp_path):
    """Each zstd-compressed DCP value may decompress to 64 MiB: ten of a few kB each made 2.9 GB of memory and
    a 670 MB checkpoint. Together they may take twice the directory's bytes plus 16 MiB."""
    pytest.importorskip("zstandard")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    text = "a" * (12 << 20)
    src = tmp_path / "dcp"
    dcp.save(
        {f"v{i}": text for i in range(3)}, storage_writer=FileSystemWriter(src, _extensions=[ZStandard()]), no_dist=True
    )
    assert sum(p.stat().st_size for p in src.iterdir()) < 1 << 20
    with pytest.raises(trainstate.UnsupportedValueError, match=r"non-tensor values of this DCP directory decompress"):
        trainstate.import_checkpoint(src, tmp_path / "out")


# -- a ninth attack -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_a_source_truncated_while_it_is_imported_is_an_error_not_a_crash(tmp_path, kind):
    """Tensor bytes were read through a map of the source: a file truncated mid-import killed the process
    (SIGBUS) when a page past its new end was touched. They are read from the open file: a short read."""
    from trainstate._convert import safetensors_file, torch_file

    src = tmp_path / f"w.{kind}"
    tensors = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    if kind == "safetensors":
        save_file(tensors, src)
        read = safetensors_file.read(src)[0]["w"].read
    else:
        torch.save(tensors, src)
        try:
            read = torch_file.source_tensor(torch_file.read(src)["w"], "w", where=src).read
        except BaseException:
            torch_file.forget()
            raise
    try:
        with open(src, "r+b") as f:
            f.truncate(4096)
        with pytest.raises(trainstate.CorruptCheckpointError, match=r"was truncated while it was read"):
            read()
    finally:
        torch_file.forget()


@pytest.mark.parametrize("layout", ["folder", "legacy tail"])
def test_a_sparse_file_does_not_lift_the_import_s_budgets(tmp_path, layout):
    """Budgets counted st_size, holes included: a terabyte hole beside (or after) a small file of views let 4 MB
    import 1.26 GB. Only the bytes really there count."""
    base = torch.zeros(1 << 20)
    views = {f"v{i}": base[i:] for i in range(300)}
    if layout == "folder":
        src = tmp_path / "model"
        src.mkdir()
        torch.save(views, src / "pytorch_model.bin")
        with open(src / "optimizer.pt", "wb") as f:
            f.truncate(1 << 40)
    else:
        src = tmp_path / "legacy.bin"
        torch.save(views, src, _use_new_zipfile_serialization=False)
        with open(src, "r+b") as f:
            f.truncate(1 << 40)
    with pytest.raises(trainstate.UnsupportedValueError, match=r"is one view too many"):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_name_that_is_not_unicode_is_refused(tmp_path):
    """A lone surrogate (a JSON escape) as a tensor name imported, and export then wrote a safetensors file no
    reader opens."""
    header = b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    header += b" " * (-len(header) % 8)
    src = tmp_path / "odd.safetensors"
    src.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(
        trainstate.UnsupportedValueError, match=r"odd\.safetensors: a dict key that is not valid Unicode"
    ):
        trainstate.import_checkpoint(src, tmp_path / "out")


def test_a_prefix_that_is_not_unicode_is_an_argument_error(tmp_path):
    """A non-UTF-8 byte in argv becomes a lone surrogate: as a prefix it wrote a key save() refuses."""
    torch.save({"w": torch.zeros(2)}, tmp_path / "m.pt")
    with pytest.raises(trainstate.InvalidArgumentError, match=r"prefix must be a key like 'model'"):
        trainstate.import_checkpoint(tmp_path / "m.pt", tmp_path / "out", prefix="m\udc80")
