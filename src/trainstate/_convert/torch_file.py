"""torch.save files: read without unpickling code, written a tensor at a time.

Reading never runs torch's unpickler: the pickle is read by trainstate's own restricted unpickler
(:mod:`trainstate._convert.torch_pickle`: tensors, containers and plain values; a pickled class is refused,
never run; building is bounded by the file's size), and each tensor is a view of its storage record, mapped
from the file as ``torch.load(mmap=True)`` maps it, so its bytes stay in the file until the writer reads
them. Every storage must be a stored record of exactly its declared size, and every record must pass the
zip's CRC-32. A file in torch's legacy (pre-1.6, non-zip) format cannot be mapped: its storages are read
into memory, each one the pickle declares found in the file first.

Writing produces exactly what ``torch.save(state_dict, path)`` writes (a zip of ``data.pkl`` naming each
tensor's storage, then one record per storage), but streams: the pickle only *names* the storages, so it
is built from dtypes and shapes, then each storage record is written as its tensor is produced and
dropped. ``torch.save`` needs every tensor in memory first. The zip is written by torch's own writer
(``torch._C.PyTorchFileWriter``, what ``torch.save`` uses), so alignment and checksums are torch's.
"""

from __future__ import annotations

import collections
import contextlib
import io
import math
import mmap
import os
import pickle
import struct
import sys
import warnings
import zipfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from trainstate._convert import safetensors_file, torch_pickle, unpickle
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


LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of a legacy torch.save file


def _read_zip(torch: Any, path: Path, held: bytes | None = None) -> Any:
    """A zip-format file (torch.save since 1.6), at ``path`` or ``held`` in memory (named ``path``): its pickle
    unpickled by :mod:`torch_pickle`, each storage a slice of one private map of the file (or of one copy of
    the bytes), as ``torch.load(mmap=True)`` makes them; every storage must be a stored (uncompressed) record of
    exactly its declared size, and every record must pass its CRC-32."""
    source: Any = path if held is None else io.BytesIO(held)
    try:
        reader = torch._C.PyTorchFileReader(str(path) if held is None else io.BytesIO(held))
    except RuntimeError as e:
        raise CorruptCheckpointError(f"{path} is damaged or truncated: its zip cannot be read ({e!s:.80})") from None
    records = set(reader.get_all_records())
    if "data.pkl" not in records:
        raise CorruptCheckpointError(f"{path} is not a torch.save file (its zip holds no data.pkl)")
    size = path.stat().st_size if held is None else len(held)
    if reader.get_record_size("data.pkl") > size:  # compressed past its file: a zip bomb
        raise CorruptCheckpointError(f"{path}: its pickle (data.pkl) claims more bytes than the whole file")
    _refuse_compressed(path, source)
    _check_crcs(path, source)
    _same_archive(path, source, reader, records)
    if "byteorder" in records and bytes(reader.get_record("byteorder")) != b"little":
        raise UnsupportedValueError(f"{path} was saved on a big-endian machine; trainstate imports little-endian files")
    data = bytes(reader.get_record("data.pkl"))
    if held is None:
        whole = torch.UntypedStorage.from_file(str(path), False, size)  # private and lazy: pages read on use
        # the tensors' bytes are read (copied) from this open file, not through the map (see _bytes_of)
        _OPEN[path] = (open(path, "rb"), whole.data_ptr(), size, whole)  # noqa: SIM115 - closed by forget()
    else:
        whole = torch.frombuffer(bytearray(held), dtype=torch.uint8).untyped_storage()

    def storage(key: str, dtype: Any, numel: int, location: str) -> torch_pickle.Storage:
        nbytes = numel * torch._utils._element_size(dtype)
        record = f"data/{key}"
        held = reader.get_record_size(record) if record in records else None
        if held != nbytes:
            raise CorruptCheckpointError(
                f"{path}: storage {key!r:.40} is declared as {numel} x {dtype} ({nbytes} bytes), but the file "
                + ("has no record of it" if held is None else f"holds {held} bytes for it")
                + ": the file is damaged or forged"
            )
        at = reader.get_record_offset(record)
        if at + nbytes > size:
            raise CorruptCheckpointError(f"{path}: storage {key!r:.40} lies past the end of the file")
        spans.append((at, at + nbytes, key))
        return torch_pickle.Storage(whole[at : at + nbytes], dtype)

    spans: list[tuple[int, int, str]] = []
    obj = torch_pickle.Unpickler(io.BytesIO(data), len(data), storage).load()
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:  # torch.save writes each storage once, records one after another
            raise CorruptCheckpointError(
                f"{path}: the records of storages {first!r:.40} and {second!r:.40} overlap in the file: it is forged"
            )
    return obj


class _Window:
    """A mapped file read as a stream by the unpickler: a length in a pickle never sizes a read past the file."""

    def __init__(self, mapped: mmap.mmap) -> None:
        self.mapped, self.at = mapped, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.mapped) if n < 0 else min(self.at + n, len(self.mapped))
        chunk, self.at = self.mapped[self.at : end], end
        return chunk

    def readline(self) -> bytes:
        end = self.mapped.find(b"\n", self.at)
        return self.read(len(self.mapped) - self.at if end < 0 else end + 1 - self.at)


def _read_legacy(torch: Any, path: Path) -> Any:
    """A file in torch's legacy format (torch.save before 1.6, old Hugging Face ``.bin`` files).

    The format is five pickles (a magic number, a protocol version, the system's sizes, the object, the list
    of its storages' keys), then, for each key in that list, the storage's element count (8 bytes) and its
    bytes. Each storage the object's pickle declares is allocated when first declared (all of them together
    no larger than the file, where they must be), then filled from the file; every declared storage must be
    named in the list, with its declared count and its bytes in the file (torch's own loader leaves a storage
    the list omits uninitialized: the importing process's memory, imported as weights)."""
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # empty
            raise CorruptCheckpointError(f"{path} is not a torch.save file ({e!s:.80})") from None
        with mapped:
            window = _Window(mapped)
            size = len(mapped)
            declared: dict[str, torch_pickle.Storage] = {}
            total = 0  # bytes of the storages declared so far

            def storage(key: str, dtype: Any, numel: int, location: str) -> torch_pickle.Storage:
                nonlocal total
                nbytes = numel * torch._utils._element_size(dtype)
                total += nbytes
                if total > size:
                    raise CorruptCheckpointError(
                        f"{path}: its storages are declared larger than the whole file ({size} bytes): it is "
                        "truncated, damaged or forged"
                    )
                declared[key] = torch_pickle.Storage(torch.UntypedStorage(nbytes), dtype)  # filled below
                return declared[key]

            def unpickle(make: Any = None) -> Any:
                return torch_pickle.Unpickler(window, size, make or _no_storage, legacy=True).load()

            try:
                magic = unpickle()
            except CheckpointError:
                raise
            except Exception:  # noqa: BLE001 - not a pickle at all
                magic = None
            if magic != LEGACY_MAGIC:
                raise CorruptCheckpointError(
                    f"{path} is not a torch.save file trainstate reads (neither a zip nor torch's legacy format; "
                    "torch 0.3 and older saved a tar archive, which can be read only by running its pickles)"
                )
            unpickle()  # the protocol version
            sys_info = unpickle()
            if type(sys_info) is dict and sys_info.get("little_endian") is False:
                raise UnsupportedValueError(
                    f"{path} was saved on a big-endian machine; trainstate imports little-endian files"
                )
            obj = unpickle(storage)
            keys = unpickle()
            at = window.at
        if type(keys) is not list or any(type(key) is not str for key in keys) or len(set(keys)) != len(keys):
            raise CorruptCheckpointError(f"{path}: its list of storages is not a list of distinct names")
        missing = declared.keys() - set(keys)
        if missing:
            key = min(missing)
            raise CorruptCheckpointError(
                f"{path}: storage {key!r:.40} ({declared[key].data.nbytes()} bytes) is declared by the pickle but "
                "never stored in the file (its list of storages leaves it out): the file is damaged or forged"
            )
        for key in keys:
            if key not in declared:
                raise CorruptCheckpointError(
                    f"{path}: its list of storages names {key!r:.40}, which the pickle never declares"
                )
            into = torch.empty(0, dtype=torch.uint8).set_(declared[key].data).numpy()
            f.seek(at)
            head = f.read(8)
            count = struct.unpack("<q", head)[0] if len(head) == 8 else None
            numel = into.nbytes // torch._utils._element_size(declared[key].dtype)
            if count is None or at + 8 + into.nbytes > size:
                raise CorruptCheckpointError(
                    f"{path}: storage {key!r:.40} is declared as {into.nbytes} bytes, but the file ends before "
                    "them: it is truncated, damaged or forged"
                )
            if count != numel:
                raise CorruptCheckpointError(
                    f"{path}: storage {key!r:.40} is declared as {numel} elements, but the file counts {count} "
                    "for it: the file is damaged or forged"
                )
            if f.readinto(memoryview(into)) != into.nbytes:
                raise CorruptCheckpointError(f"{path}: storage {key!r:.40} was cut short while it was read")
            at += 8 + into.nbytes
    return obj


def _no_storage(key: str, dtype: Any, numel: int, location: str) -> torch_pickle.Storage:
    raise CorruptCheckpointError(f"a pickle of the file's header names storage {key!r:.40}")


def _check_crcs(path: Path, source: Any) -> None:
    """Refuse a zip-format file any of whose records fails its CRC-32: ``torch.load`` never checks them, so
    a byte flipped after the file was written would be imported, checksummed anew and verify. One read of
    the stored records (and of ``data.pkl``, already bounded by the file's size), a MiB at a time; the
    import then reads them from the page cache. Other compressed records, which torch never reads, are not
    inflated. The zip must start at the file's first byte: zipfile reads the last zip of the file, torch's
    reader may read another."""
    bad = None
    try:
        with zipfile.ZipFile(source) as zf:
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


def _same_archive(path: Path, source: Any, reader: Any, records: set[str]) -> None:
    """Refuse a file in which torch's zip reader and Python's ``zipfile`` (whose view the CRC and compression
    checks read) see different archives: two central directories, one found through the zip64 locator's
    offset (torch) and one just before it (zipfile), could give torch a record those checks never saw. Every
    record must be listed by both, at the same offset, with the same size."""
    seen: dict[str, tuple[int, int]] = {}
    try:
        with zipfile.ZipFile(source) as z:
            infos = z.infolist()
            fp = z.fp
            assert fp is not None
            for info in infos:
                prefix, _, name = info.filename.partition("/")
                fp.seek(info.header_offset)
                head = fp.read(30)
                if len(head) != 30 or not name:
                    raise CorruptCheckpointError(f"{path}: its zip's record {info.filename!r:.80} is malformed")
                n, m = struct.unpack("<HH", head[26:30])
                seen[name] = (info.header_offset + 30 + n + m, info.file_size)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CorruptCheckpointError(f"{path}: its zip cannot be read ({e!s:.80})") from None
    theirs = {name: (reader.get_record_offset(name), reader.get_record_size(name)) for name in records}
    if seen != theirs:
        differ = sorted(seen.keys() ^ theirs.keys()) or sorted(k for k in seen if seen[k] != theirs[k])
        raise CorruptCheckpointError(
            f"{path}: torch's zip reader and the zip's own directory read different archives (record "
            f"{differ[0]!r:.80} differs): the file is forged"
        )


def _refuse_compressed(path: Path, source: Any) -> None:
    """Refuse a zip whose records are compressed (a torch.save file re-zipped by ``zip`` or ``zipfile``):
    torch.save stores them, and a mapped load cannot read a compressed record (torch fails on it with
    "Trying to resize storage that is not resizable", which says nothing of why)."""
    try:
        with zipfile.ZipFile(source) as z:
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
    """The object a torch.save file holds, its tensors views of storages mapped from the file (zip format) or
    read from it (legacy format); see :mod:`trainstate._convert.torch_pickle` for what is unpickled.

    Raises:
        UnsupportedValueError: the file holds a pickled object other than tensors, containers and plain
            values (refused, never run), or a tensor trainstate does not store.
        CorruptCheckpointError: the file is not a torch.save file, or is damaged or forged.
    """
    torch = _torch()
    with _errors(path):
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.load's own test of the format
        return _read_zip(torch, path) if zipped else _read_legacy(torch, path)


def read_bytes(data: bytes, where: Path) -> Any:
    """:func:`read` for the bytes of a zip-format torch.save file held in memory (an entry of a DCP file),
    named ``where`` in errors."""
    torch = _torch()
    with _errors(where):
        return _read_zip(torch, where, data)


@contextlib.contextmanager
def _errors(path: Path) -> Iterator[None]:
    """Whatever reading a torch.save file raises, as a :class:`CheckpointError` naming it."""
    try:
        yield
    except unpickle.Refused as e:
        raise CorruptCheckpointError(f"{path}: its pickle is refused: {e}") from None
    except UnsupportedValueError as e:
        raise e if str(path) in str(e) else UnsupportedValueError(f"{path}: {e}") from None
    except CheckpointError:
        raise
    except OSError as e:
        raise StorageError(e.errno, f"cannot read {path}: {e.strerror}") from e
    except Exception as e:  # noqa: BLE001 - what a damaged pickle raises (EOFError, UnpicklingError, ...)
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CorruptCheckpointError(f"{path} is not a torch.save file ({said:.120})") from None


VIEW_SLACK = 64 << 20  # bytes views may import beyond twice the file's size


class Views:
    """What the tensors of one file imported so far take: distinct views of one storage (``x`` and ``x[0]``,
    or a fused ``qkv`` and its slices, under several names) are each imported in full, so a file of many views
    of its bytes could become a checkpoint many times its size. Together the tensors of a file of ``size``
    bytes may import twice that plus :data:`VIEW_SLACK`: counted against the file, not against its storages,
    which a forged file can make overlap (legacy views, zip records inside one another)."""

    def __init__(self, size: int) -> None:
        self.limit = 2 * size + VIEW_SLACK
        self.used = 0  # bytes imported so far
        self.seen: set[object] = set()  # tensor identities already counted (a tied name counts once)

    def add(self, identity: object, nbytes: int) -> int | None:
        """Count a tensor; the bytes imported when that is over the limit, else None."""
        if identity is None or identity in self.seen:
            return None
        self.seen.add(identity)
        self.used += nbytes
        return self.used if self.used > self.limit else None


_OPEN: dict[Path, tuple[BinaryIO, int, int, Any]] = {}  # a zip read: its file, its map's address and size


def forget() -> None:
    """Close the files :func:`read` left open for their tensors' bytes (an import calls it when done)."""
    while _OPEN:
        _OPEN.popitem()[1][0].close()


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
    over = views.add(identity, numel * itemsize) if views is not None else None
    if over is not None:
        raise UnsupportedValueError(
            f"{where}: tensor {name!r:.80} is one view too many: the file's tensors would import {over} bytes, more "
            f"than {views.limit if views else 0} (views of one storage are imported each in full; trainstate imports "
            "up to twice the file's bytes, plus 64 MiB). Save the tensors with .clone() if they are meant to be "
            "separate"
        )
    return SourceTensor(code, shape, numel * itemsize, partial(_bytes_of, value, where), identity)


def _bytes_of(t: Any, where: Path) -> np.ndarray:
    """A tensor's bytes. One of a zip-format file is read (a copy) from the file, the span its view covers, not
    through the map its tensor was built on: a file truncated while it is imported would kill the process
    (SIGBUS) at a page past its new end, where a read comes back short and is an error."""
    from trainstate._frameworks import torch as adapter

    opened = _OPEN.get(where)
    storage = t.untyped_storage()
    if opened is None or not opened[1] <= storage.data_ptr() < opened[1] + opened[2] or t.numel() == 0:
        return np.frombuffer(adapter.byte_view(t), np.uint8)  # the legacy format: read into memory already
    torch = _torch()
    handle, base, _, _ = opened
    itemsize = t.element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    at = storage.data_ptr() - base + t.storage_offset() * itemsize
    raw = safetensors_file.read_range(handle, where, at, span * itemsize)
    view = torch.as_strided(torch.from_numpy(raw).view(t.dtype), t.shape, t.stride())
    if t.is_conj():
        view = view.conj()
    if t.is_neg():
        view = view._neg_view()
    return np.frombuffer(adapter.byte_view(view), np.uint8)
