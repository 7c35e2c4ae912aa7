"""torch.save files: read without unpickling code, written a tensor at a time.

Reading uses ``torch.load(weights_only=True, mmap=True)``: torch's restricted unpickler builds only
tensors, containers and plain values (a pickled class is refused, never run), and ``mmap`` leaves the
tensors' bytes in the file until the writer reads them. A file in torch's legacy (pre-1.6, non-zip)
format cannot be mapped and is loaded whole, still restricted, once every storage its pickle declares is
found in the file (torch would leave one it does not find uninitialized).

Writing produces exactly what ``torch.save(state_dict, path)`` writes (a zip of ``data.pkl`` naming each
tensor's storage, then one record per storage), but streams: the pickle only *names* the storages, so it
is built from dtypes and shapes, then each storage record is written as its tensor is produced and
dropped. ``torch.save`` needs every tensor in memory first. The zip is written by torch's own writer
(``torch._C.PyTorchFileWriter``, what ``torch.save`` uses), so alignment and checksums are torch's.
"""

from __future__ import annotations

import collections
import errno
import io
import math
import os
import pickle
import re
import struct
import sys
import warnings
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from trainstate._convert import pickle_scan
from trainstate._convert.source import SourceTensor
from trainstate._format import dtypes
from trainstate._optional import optional
from trainstate.errors import CheckpointError, CorruptCheckpointError, StorageError, UnsupportedValueError

_NEEDED = "reading and writing torch.save files"


def _torch() -> Any:
    with optional("torch", extra="torch", needed_for=_NEEDED):
        import torch
    return torch


class Stored(NamedTuple):
    """A tensor to write: dtype code, shape, and how to make its bytes. One object per storage: names of
    a tied tensor share one (the file then holds it once, as torch.save does)."""

    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]


class _StorageRef:
    def __init__(self, key: str, stored: Stored) -> None:
        self.key, self.stored = key, stored


class _TensorRef:
    """Pickles as ``torch.save`` pickles a contiguous CPU tensor that owns its storage."""

    def __init__(self, storage: _StorageRef) -> None:
        self.storage = storage

    def __reduce__(self) -> tuple[Any, ...]:
        torch = _torch()
        shape = self.storage.stored.shape
        stride = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
        dtype = getattr(torch, dtypes.from_code(self.storage.stored.dtype).torch_name)
        args: tuple[Any, ...] = (self.storage, 0, shape, stride, False, collections.OrderedDict())
        if dtype in torch.storage._dtype_to_storage_type_map():  # a typed storage, as torch.save writes it
            return torch._utils._rebuild_tensor_v2, args
        return torch._utils._rebuild_tensor_v3, (*args, dtype)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _StorageRef):
            return None
        torch = _torch()
        stored = obj.stored
        dtype = getattr(torch, dtypes.from_code(stored.dtype).torch_name)
        numel = int(np.prod(stored.shape))
        typed = torch.storage._dtype_to_storage_type_map().get(dtype)
        if typed is not None:
            return ("storage", getattr(torch, typed), obj.key, "cpu", numel)
        return (
            "storage",
            torch.storage.UntypedStorage,
            obj.key,
            "cpu",
            numel * dtypes.from_code(stored.dtype).itemsize,
        )


def write(path: Path, tensors: dict[str, Stored]) -> None:
    """Write ``{name: tensor}`` as a new torch.save file at ``path``, fsynced; tensors a storage at a time."""
    torch = _torch()
    refs: dict[int, _StorageRef] = {}
    for stored in tensors.values():
        refs.setdefault(id(stored), _StorageRef(str(len(refs)), stored))
    obj = {name: _TensorRef(refs[id(stored)]) for name, stored in tensors.items()}
    pickled = io.BytesIO()
    _Pickler(pickled, protocol=2).dump(obj)
    data = pickled.getvalue()
    try:
        with open(path, "xb") as f:
            writer = torch._C.PyTorchFileWriter(f, True, 64)
            try:
                writer.write_record("data.pkl", data, len(data))
                writer.write_record(".format_version", "1", 1)
                writer.write_record(".storage_alignment", "64", 2)
                writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
                for ref in refs.values():
                    storage = _as_storage(torch, ref.stored.produce())
                    writer.write_record(f"data/{ref.key}", storage, storage.nbytes())
                    del storage  # one tensor in memory at a time
                writer.write_end_of_file()
            finally:
                # Its destructor writes to f: it must run before f closes, also when reading a tensor failed
                # (else it wrote to a closed file from C++ and the process aborted, the error already caught).
                del writer
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise StorageError(e.errno, f"writing {path} failed: {e.strerror or e}") from e


def _as_storage(torch: Any, array: np.ndarray) -> Any:
    """A torch storage over an array's bytes, without a copy where the array is contiguous."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():  # a read-only map of the checkpoint: the writer only reads it
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(flat).untyped_storage()


def _check_storages(torch: Any, path: Path) -> None:
    """Refuse a zip-format file whose pickle declares a storage of another size than its record holds.

    ``torch.load(mmap=True)`` slices the mapped file by the *declared* size, unchecked: a storage declared
    larger than its record reads the bytes after it (other tensors, the zip's directory) as its own. The
    pickle is run once more here by torch's restricted unpickler with storages on the meta device (no
    bytes), each declared size compared with its record's. Files in the legacy format are checked by
    :func:`_check_legacy_storages`.
    """
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # torch.load's own test of the format
            pickle_scan.refuse_crowded_legacy(path)  # before any unpickler builds its dictionaries
            _check_legacy_storages(torch, path, f)
            return
    try:
        reader = torch._C.PyTorchFileReader(str(path))
    except RuntimeError:
        return  # not a torch file (torch.load says so)
    records = set(reader.get_all_records())
    if "data.pkl" not in records:
        return
    if reader.get_record_size("data.pkl") > path.stat().st_size:  # compressed past its file: a zip bomb
        raise CorruptCheckpointError(f"{path}: its pickle (data.pkl) claims more bytes than the whole file")
    _refuse_compressed(path)
    data = reader.get_record("data.pkl")
    pickle_scan.refuse_crowded(path, data)
    from torch._weights_only_unpickler import Unpickler

    def persistent_load(pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) != 5:
            raise CorruptCheckpointError(f"{path}: the pickle names a storage as {pid!r:.80}")
        _, kind, key, _, numel = pid
        dtype = torch.uint8 if kind is torch.UntypedStorage else getattr(kind, "dtype", None)
        if not isinstance(dtype, torch.dtype) or type(numel) is not int or numel < 0:
            raise CorruptCheckpointError(f"{path}: the pickle names a storage as {pid!r:.80}")
        nbytes = numel * torch._utils._element_size(dtype)
        record = f"data/{key}"
        held = reader.get_record_size(record) if record in records else None
        if held != nbytes:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r:.40} is declared as {numel} x {dtype} ({nbytes} bytes), but the file "
                + ("has no record of it" if held is None else f"holds {held} bytes for it")
                + ": the file is damaged or forged"
            )
        return torch.storage.TypedStorage(
            wrap_storage=torch.UntypedStorage(nbytes, device="meta"), dtype=dtype, _internal=True
        )

    unpickler = Unpickler(io.BytesIO(data), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    with warnings.catch_warnings():  # torch's own rebuild of a quantized tensor touches TypedStorage
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        unpickler.load()  # type: ignore[no-untyped-call]
    _check_crcs(path)


LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of a legacy torch.save file


def _check_legacy_storages(torch: Any, path: Path, f: io.BufferedReader) -> None:
    """Refuse a legacy-format file (torch.save before 1.6, old Hugging Face ``.bin`` files) any storage of
    whose pickle is not read from the file.

    The format is five pickles (a magic number, a protocol version, the system's sizes, the object, the
    list of its storages' keys), then, for each key in that list, the storage's element count (8 bytes)
    and its bytes. torch's loader allocates every storage the object's pickle declares, *uninitialized*,
    and fills only those the keys list names: a storage left out imports whatever the importing process's
    memory held there (heap pointers, other data), and a huge declared size makes a tiny file a huge
    checkpoint. The pickles are read here by torch's restricted unpickler, storages on the meta device (no
    bytes); every declared storage must be named, each name's count must be the declared one, and its
    bytes must be in the file.
    """
    from torch._weights_only_unpickler import Unpickler

    def unpickle(load: Callable[[Any], Any] | None = None) -> Any:
        unpickler = Unpickler(f, encoding="utf-8")
        if load is not None:
            unpickler.persistent_load = load  # type: ignore[method-assign]
        with warnings.catch_warnings():  # torch.load, which reads these pickles next, warns of them itself
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return unpickler.load()  # type: ignore[no-untyped-call]

    f.seek(0)
    try:
        magic = unpickle()
    except Exception:  # noqa: BLE001 - not a pickle: not a torch file (torch.load says so)
        magic = None
    if magic != LEGACY_MAGIC:
        return
    unpickle()  # the protocol version and the system's sizes: torch.load checks them
    unpickle()
    declared: dict[str, tuple[int, int]] = {}  # key -> its element count and bytes

    def persistent_load(pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) != 6:
            raise CorruptCheckpointError(f"{path}: the pickle names a storage as {pid!r:.80}")
        _, kind, key, _, numel, _ = pid
        dtype = getattr(kind, "dtype", None)
        if not isinstance(dtype, torch.dtype) or type(numel) is not int or numel < 0 or type(key) is not str:
            raise CorruptCheckpointError(f"{path}: the pickle names a storage as {pid!r:.80}")
        nbytes = numel * torch._utils._element_size(dtype)
        declared.setdefault(key, (numel, nbytes))  # torch allocates a key at its first declaration
        return torch.storage.TypedStorage(
            wrap_storage=torch.UntypedStorage(nbytes, device="meta"), dtype=dtype, _internal=True
        )

    unpickle(persistent_load)
    keys = unpickle()
    if type(keys) is not list or any(type(key) is not str for key in keys):
        raise CorruptCheckpointError(f"{path}: its list of storages is a {type(keys).__name__}, not a list of names")
    missing = declared.keys() - set(keys)
    if missing:
        key = min(missing)
        raise CorruptCheckpointError(
            f"{path}: storage {key!r:.40} ({declared[key][1]} bytes) is declared by the pickle but never stored in "
            "the file (its list of storages leaves it out), so torch would leave its memory uninitialized: the "
            "file is damaged or forged"
        )
    at, size = f.tell(), os.fstat(f.fileno()).st_size
    for key in keys:
        if key not in declared:
            raise CorruptCheckpointError(
                f"{path}: its list of storages names {key!r:.40}, which the pickle never declares"
            )
        numel, nbytes = declared[key]
        f.seek(at)
        head = f.read(8)
        count = struct.unpack("<q", head)[0] if len(head) == 8 else None
        if count is None or at + 8 + nbytes > size:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r:.40} is declared as {nbytes} bytes, but the file ends before them: it is "
                "truncated, damaged or forged"
            )
        if count != numel:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r:.40} is declared as {numel} elements, but the file counts {count} "
                "for it: the file is damaged or forged"
            )
        at += 8 + nbytes


def _check_crcs(path: Path) -> None:
    """Refuse a zip-format file any of whose records fails its CRC-32: ``torch.load`` never checks them, so
    a byte flipped after the file was written would be imported, checksummed anew and verify. One read of
    the stored records (and of ``data.pkl``, already bounded by the file's size), a MiB at a time; the
    import then reads them from the page cache. Other compressed records, which torch never reads, are not
    inflated. The zip must start at the file's first byte: zipfile reads the last zip of the file, torch's
    reader may read another."""
    bad = None
    try:
        with zipfile.ZipFile(path) as zf:
            if min((info.header_offset for info in zf.infolist()), default=-1) != 0:
                raise CorruptCheckpointError(
                    f"{path}: it has bytes before its zip (another zip, say), which torch.save never writes; torch "
                    "and the zip's checksums would each read a different archive"
                )
            for info in zf.infolist():
                if info.compress_type != zipfile.ZIP_STORED and not info.filename.endswith("data.pkl"):
                    continue
                try:
                    with zf.open(info) as f:
                        while f.read(1 << 20):
                            pass
                except zipfile.BadZipFile:
                    bad = info.filename
                    break
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: its zip cannot be read ({e})") from None
    if bad is not None:
        raise CorruptCheckpointError(
            f"{path}: record {bad!r:.80} fails its CRC-32 (the zip's own checksum): the file was damaged after "
            "it was written"
        )


def _refuse_compressed(path: Path) -> None:
    """Refuse a zip whose records are compressed (a torch.save file re-zipped by ``zip`` or ``zipfile``):
    torch.save stores them, and a mapped load cannot read a compressed record (torch fails on it with
    "Trying to resize storage that is not resizable", which says nothing of why)."""
    try:
        with zipfile.ZipFile(path) as z:
            packed = next((i.filename for i in z.infolist() if i.compress_type != zipfile.ZIP_STORED), None)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return  # torch's own reader opened it: its verdict on the bytes stands
    if packed is not None:
        raise UnsupportedValueError(
            f"{path}: its zip records are compressed ({packed!r:.80}), as re-zipping a torch.save file makes them; "
            "torch.save stores them as they are, and trainstate maps them from the file. Load it with torch.load "
            "and torch.save it again (or re-zip it without compression: zip -0)"
        )


def read(path: Path) -> Any:
    """The object a torch.save file holds, its tensors mapped from the file (see :func:`source_tensor`).

    Raises:
        UnsupportedValueError: the file holds a pickled object other than tensors, containers and plain
            values (refused by torch's restricted unpickler, never run).
        CorruptCheckpointError: the file is not a torch.save file.
    """
    torch = _torch()
    try:
        _check_storages(torch, path)
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap can only be used" not in str(e):
                raise
        return torch.load(path, map_location="cpu", weights_only=True)  # the legacy format: cannot be mapped
    except pickle.UnpicklingError as e:
        said = str(e)
        found = re.search(r"GLOBAL ([\w.]+)", said)
        if found is None:  # torch's restricted unpickler met bytes that are no pickle it knows
            reason = said.split("WeightsUnpickler error:")[-1].split("Check the documentation")[0]
            raise CorruptCheckpointError(f"{path} is not a torch.save file ({' '.join(reason.split()):.120})") from None
        raise UnsupportedValueError(
            f"{path} holds a pickled object other than tensors, containers and plain values (a "
            f"{found.group(1)}); trainstate never unpickles code. Save the weights as tensors "
            "(torch.save(model.state_dict(), ...)) or as safetensors, and import that"
        ) from None
    except CheckpointError:
        raise
    except OSError as e:
        if e.errno == errno.EINVAL:  # torch's reader on a truncated file: not the disk's fault
            raise CorruptCheckpointError(f"{path} is damaged or truncated: torch.load could not read it") from None
        raise StorageError(e.errno, f"cannot read {path}: {e.strerror}") from e
    except Exception as e:  # noqa: BLE001 - whatever torch.load says of a file that is not its format
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CorruptCheckpointError(f"{path} is not a torch.save file ({said:.120})") from None


VIEW_SLACK = 64 << 20  # bytes views may import beyond twice what their storages hold


class Views:
    """What the tensors of one file imported so far take, beside what their storages hold: distinct views of
    one storage (``x`` and ``x[0]``, or a fused ``qkv`` and its slices, under several names) are each imported
    in full, so a file of many views of one storage could become a checkpoint many times its size. Together
    the views may import twice their storages' bytes plus :data:`VIEW_SLACK`."""

    def __init__(self) -> None:
        self.stored: dict[int, int] = {}  # storage address -> its bytes
        self.used = 0  # bytes imported so far
        self.seen: set[object] = set()  # tensor identities already counted (a tied name counts once)

    def add(self, value: Any, identity: object, nbytes: int) -> int | None:
        """Count a tensor; the bytes imported when that is over the budget, else None."""
        if identity is None or identity in self.seen:
            return None
        self.seen.add(identity)
        storage = value.untyped_storage()
        self.stored.setdefault(storage.data_ptr(), storage.nbytes())
        self.used += nbytes
        return self.used if self.used > 2 * sum(self.stored.values()) + VIEW_SLACK else None


def source_tensor(value: Any, name: str, *, where: Path, views: Views | None = None) -> SourceTensor | None:
    """A torch tensor of a loaded file as a :class:`SourceTensor` (None for anything else): its bytes are
    read from the file's map when the writer reaches it; names of one tied tensor share an identity.

    Raises:
        UnsupportedValueError: the tensor is one trainstate does not store (sparse, quantized, a dtype it
            lacks), or its elements overlap in memory (an ``expand``-ed view): imported at full size it would
            take more bytes than the file gave it (``torch.zeros(1).expand(10**9)`` is 4 bytes in the file, 4 GB
            as a tensor); or, counted in ``views``, it is one view too many of one storage (:class:`Views`).
    """
    torch = _torch()
    if not isinstance(value, torch.Tensor):
        return None
    from trainstate._frameworks import torch as adapter

    try:
        code, shape, _ = adapter.describe(value)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"{where}: tensor {name!r:.80}: {e}") from None
    itemsize = dtypes.from_code(code).itemsize
    numel = math.prod(shape)
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(shape, value.stride())) if numel else 0
    if numel > span:  # elements that share bytes: a stride of 0 (expand), or windows over one another
        raise UnsupportedValueError(
            f"{where}: tensor {name!r:.80} is an expanded view: {numel} elements ({numel * itemsize} bytes) over "
            f"{span * itemsize} bytes stored, strides {value.stride()}. trainstate imports a tensor only as large "
            "as its bytes in the file; save it with .contiguous() (or save the tensor before expand)"
        )
    identity = adapter.identity(value)
    over = views.add(value, identity, numel * itemsize) if views is not None else None
    if over is not None:
        raise UnsupportedValueError(
            f"{where}: tensor {name!r:.80} is one view too many: the file's tensors would import {over} bytes from "
            f"storages of {sum(views.stored.values()) if views else 0} bytes (views of one storage are imported each "
            "in full; trainstate imports up to twice the stored bytes, plus 64 MiB). Save the tensors with "
            ".clone() if they are meant to be separate"
        )
    return SourceTensor(code, shape, numel * itemsize, partial(_bytes_of, value), identity)


def _bytes_of(t: Any) -> np.ndarray:
    from trainstate._frameworks import torch as adapter

    return np.frombuffer(adapter.byte_view(t), np.uint8)
