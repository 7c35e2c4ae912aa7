"""A torch.distributed.checkpoint directory's ``.metadata``, read as the untrusted input a download is.

DCP pickles its metadata and loads it with ``pickle.load``: a hostile directory would run code, and even a
pickle that builds only DCP's classes can BUILD a class object itself (``setattr(pathlib.PosixPath,
"exists", ...)``) and change the importing process. Here the pickle is run by an unpickler that calls only
the constructors a real DCP save uses, BUILDs only instances of DCP's metadata dataclasses (never a class),
fills only plain dicts and lists, and refuses a dict key given twice (two storage entries for one chunk
would otherwise silently replace each other). What it built is then walked: only the types a real save
produces may appear.

:func:`read` then checks what the metadata promises before anything is allocated or read: each tensor's
chunks tile it exactly (no gap, whose bytes would be the importer's uninitialised memory; no overlap; none
out of bounds), every storage file is a file of the folder (no ``..``, no absolute path, no symlink out),
every byte range lies inside its file and no two overlap, and no tensor declares more bytes than its
stored bytes can hold (zstd-compressed entries: :data:`ZSTD_RATIO` times their length at most).
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import Any, NamedTuple

from trainstate._convert import unpickle
from trainstate._format import boxes, dtypes, manifest
from trainstate._optional import optional
from trainstate.errors import CorruptCheckpointError, UnsupportedValueError

METADATA = ".metadata"
ZSTD = "stream.zstd/1"  # DCP's zstd stream extension (torch.distributed.checkpoint._extension.ZStandard)
ZSTD_RATIO = 1 << 15  # zstd's ceiling: a 4-byte RLE block stands for 128 KiB
MAX_NDIM = manifest.MAX_RANK  # the most dimensions a tensor may declare: what a manifest holds
BYTES_LIMIT = 64 << 20  # a compressed non-tensor value (a step count, param groups) decompresses to this at most
FRAMING = 64 << 10  # torch.save's zip around a chunk's bytes (about 1.5 kB in practice)
_DCP = "torch.distributed.checkpoint"
_CLASSES = {  # module -> names a real save's metadata pickle refers to
    f"{_DCP}.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    f"{_DCP}.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # storage_meta.checkpoint_id
}


class Stored(NamedTuple):
    """Where one chunk (or non-tensor value) is: a file of the folder, a byte range, whether it is
    zstd-compressed, and how many bytes it may decompress to."""

    file: Path
    offset: int
    length: int
    compressed: bool
    limit: int


class Tensor(NamedTuple):
    """A tensor the metadata declares: trainstate dtype code, shape, byte size."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class Checked(NamedTuple):
    """The metadata, and what :func:`read` found in it."""

    md: Any
    tensors: dict[str, Tensor]
    plain: list[str]
    where: dict[str, tuple[Any, ...]]  # fqn -> the nested keys DCP flattened it from
    stored: dict[Any, Stored]  # MetadataIndex -> its bytes


def _torch() -> Any:
    with optional("torch", extra="torch", needed_for="importing a torch.distributed.checkpoint directory"):
        import torch
        import torch.distributed.checkpoint  # noqa: F401 - the classes the unpickler builds
    return torch


class _Unpickler(unpickle.Restricted):
    """The restricted unpickler (:mod:`trainstate._convert.unpickle`) allowed what a DCP save writes: the
    constructors it calls, and instances of DCP's metadata dataclasses, created and given their fields."""

    dispatch: dict[int, Any] = dict(unpickle.Restricted.dispatch)
    repeated_keys = "refused"  # two storage entries for one chunk would otherwise replace each other

    def __init__(self, file: Any, size: int) -> None:
        super().__init__(file, size)
        torch = _torch()
        from torch.distributed.checkpoint import filesystem, metadata
        from torch.serialization import _get_layout

        self.dataclasses = {getattr(metadata, n) for n in _CLASSES[f"{_DCP}.metadata"]} - {
            metadata._MEM_FORMAT_ENCODING
        } | {filesystem._StorageInfo}
        self.size = torch.Size
        self.callables = {
            torch.Size,
            _get_layout,
            metadata._MEM_FORMAT_ENCODING,
            *map(_path_class, _CLASSES["pathlib"]),
        }

    def find_class(self, module: str, name: str) -> Any:
        if name in _CLASSES.get(module, ()):
            return (
                _path_class(name) if module == "pathlib" else super(unpickle.Restricted, self).find_class(module, name)
            )
        if module == "torch":  # a dtype (torch.float32) is pickled as a global
            torch = _torch()
            found = getattr(torch, name, None)
            if isinstance(found, torch.dtype):
                return found
        raise UnsupportedValueError(
            f"the DCP metadata asks to build {module}.{name}, which is not part of DCP's metadata; trainstate "
            "never unpickles code"
        )

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        if not any(func is c for c in self.callables):
            raise unpickle.Refused(f"it calls {unpickle.type_name(func)}, which a DCP save never calls")
        if func is self.size and len(args) == 1 and type(args[0]) is tuple:
            self.charge(len(args[0]))
            return self.tuple_of(list(args[0]), func)  # a tuple: its depth counts
        self.charge(sum(len(a) for a in args if isinstance(a, (str, tuple, list))))
        return func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if cls not in self.dataclasses or args != ():
            raise unpickle.Refused(
                f"it creates a {unpickle.type_name(cls)}, which is not one of DCP's metadata classes"
            )
        self.append(cls.__new__(cls))

    def build(self, inst: Any, state: Any) -> None:
        cls = type(inst)
        if cls not in self.dataclasses:  # a class, a module, a function: never changed
            raise unpickle.Refused(
                f"it sets attributes of {unpickle.type_name(inst)}, which is not a DCP metadata instance"
            )
        if cls.__name__ == "TensorProperties" and type(state) is tuple:
            inst.__setstate__(state)  # DCP's own: sets the instance's five fields
            return
        fields = {f.name for f in dataclasses.fields(cls)}
        if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
            raise unpickle.Refused(f"it gives a {cls.__name__} fields it does not have")
        inst.__dict__.update(state)


_Unpickler.dispatch[pickle.NEWOBJ[0]] = _Unpickler.load_newobj


def _path_class(name: str) -> type:
    """A path is data here: a pure path, never a concrete one with methods that touch the disk."""
    return PurePosixPath if name in ("PosixPath", "PurePosixPath") else PureWindowsPath


def load(path: Path) -> Any:
    """The DCP ``Metadata`` of directory ``path``, unpickled as the module docstring says, and walked."""
    file = path / METADATA
    _torch()
    _inside(path, file, METADATA)
    try:
        with open(file, "rb") as f:  # whole: a length in the pickle then never sizes a read of the file
            md = _Unpickler(io.BytesIO(data := f.read()), len(data)).load()
    except UnsupportedValueError as e:  # the unpickler's own refusal: code asked for
        raise UnsupportedValueError(f"{file}: {e}") from None
    except unpickle.Refused as e:
        raise CorruptCheckpointError(f"{file} is not DCP metadata trainstate can read: {e}") from None
    except Exception as e:  # noqa: BLE001 - what a damaged pickle raises is anyone's guess
        raise CorruptCheckpointError(f"{file} is not readable DCP metadata ({e!s:.120})") from None
    _walk(file, md)
    return md


def _walk(file: Path, md: Any) -> None:
    """Refuse a type a real save's metadata never holds, anywhere in it."""
    torch = _torch()
    from torch.distributed.checkpoint import filesystem, metadata

    if type(md) is not metadata.Metadata:
        raise CorruptCheckpointError(f"{file} holds a {unpickle.type_name(md)}, not DCP's Metadata")
    leaves = (str, int, bool, type(None), torch.Size, torch.dtype, torch.layout, torch.memory_format)
    records = {getattr(metadata, n) for n in _CLASSES[f"{_DCP}.metadata"]} | {filesystem._StorageInfo}
    seen: set[int] = set()
    todo: list[Any] = [md]
    while todo:  # a loop, not recursion: the pickle chooses the depth
        obj = todo.pop()
        if id(obj) in seen or type(obj) in leaves or isinstance(obj, (PurePath, metadata._MEM_FORMAT_ENCODING)):
            continue
        seen.add(id(obj))
        if type(obj) is dict:
            todo.extend(obj)
            todo.extend(obj.values())
        elif type(obj) in (list, tuple):
            todo.extend(obj)
        elif type(obj) in records:
            todo.extend(vars(obj).values())
        else:
            raise CorruptCheckpointError(f"{file} holds a {unpickle.type_name(obj)}, which DCP's metadata never holds")


def _inside(root: Path, file: Path, name: str) -> Path:
    """``file`` resolved (symlinks followed), refused unless it is a file inside ``root``."""
    try:
        real, home = file.resolve(), root.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise CorruptCheckpointError(f"{root / METADATA}: {name!r:.120} cannot be resolved ({e!s:.120})") from None
    if not real.is_relative_to(home):
        raise CorruptCheckpointError(f"{root / METADATA}: {name!r:.120} is outside {root} (a link or a path out)")
    if not real.is_file():
        raise CorruptCheckpointError(f"{root / METADATA}: {name!r:.120} is not a file of {root}")
    return real


def read(path: Path) -> Checked:
    """The metadata of DCP directory ``path`` and what it declares, checked as the module docstring says.

    Raises:
        CorruptCheckpointError: the metadata is not DCP's, or declares what its files cannot hold.
        UnsupportedValueError: it asks for code, a dtype or a storage transform trainstate does not read.
    """
    md = load(path)  # first: without torch, it raises MissingDependencyError naming the extra
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    file = path / METADATA
    entries, storage, planner_data = (
        getattr(md, k, None) for k in ("state_dict_metadata", "storage_data", "planner_data")
    )
    if type(entries) is not dict or type(storage) is not dict or type(planner_data) not in (dict, type(None)):
        raise CorruptCheckpointError(f"{file}: state_dict_metadata and storage_data are not mappings")
    stored = _stored(path, storage)
    tensors: dict[str, Tensor] = {}
    plain: list[str] = []
    where: dict[str, tuple[Any, ...]] = {}
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            raise CorruptCheckpointError(f"{file}: a value is named by a {unpickle.type_name(fqn)}, not a string")
        keys = (planner_data or {}).get(fqn) or (fqn,)
        if type(keys) is not tuple or not all(type(k) in (str, int) for k in keys):
            raise CorruptCheckpointError(f"{file}: {fqn!r:.80} is placed at {keys!r:.80}, not a tuple of keys")
        where[fqn] = keys
        if type(entry) is TensorStorageMetadata:
            tensors[fqn] = _tensor(file, fqn, entry, stored)
        elif type(entry) is BytesStorageMetadata:
            plain.append(fqn)
            if MetadataIndex(fqn) not in stored:  # the key DCP's planner reads a value by
                raise CorruptCheckpointError(f"{file}: no storage is given for {fqn!r:.80}")
        else:
            raise CorruptCheckpointError(f"{file}: {fqn!r:.80} is described by a {unpickle.type_name(entry)}")
    return Checked(md, tensors, plain, where, stored)


def _stored(root: Path, storage: dict[Any, Any]) -> dict[Any, Stored]:
    """Each storage entry's file (inside ``root``) and byte range (inside the file, none overlapping)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    file = root / METADATA
    out: dict[Any, Stored] = {}
    real: dict[str, Path] = {}
    for key, info in storage.items():
        if type(key) is not MetadataIndex or type(info) is not _StorageInfo:
            raise CorruptCheckpointError(
                f"{file}: storage_data maps a {unpickle.type_name(key)} to a {unpickle.type_name(info)}"
            )
        found: list[Any] = [getattr(info, k, None) for k in ("relative_path", "offset", "length")]
        name, offset, length = found
        transforms = list(getattr(info, "transform_descriptors", None) or ())
        if type(name) is not str or not all(type(n) is int and n >= 0 for n in (offset, length)):
            raise CorruptCheckpointError(f"{file}: the storage of {key.fqn!r:.80} is not a file name and byte range")
        if transforms not in ([], [ZSTD]):
            raise UnsupportedValueError(
                f"{file}: {key.fqn!r:.80} is stored through {transforms}; trainstate reads {ZSTD}"
            )
        if name not in real:
            parts = PurePosixPath(name).parts
            if not parts or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name:
                raise CorruptCheckpointError(f"{file}: storage file {name!r:.120} is outside {root}")
            real[name] = _inside(root, root / name, name)
        limit = min(length * ZSTD_RATIO, BYTES_LIMIT) if transforms else length  # a tensor's: its chunk's size
        out[key] = Stored(real[name], offset, length, bool(transforms), limit)
    by_file: dict[tuple[int, int], tuple[Path, list[tuple[int, int, str]]]] = {}
    for key, s in out.items():  # by the file itself: hard links to one file are one file's bytes
        st = s.file.stat()
        by_file.setdefault((st.st_dev, st.st_ino), (s.file, []))[1].append((s.offset, s.length, key.fqn))
    for path, ranges in by_file.values():
        size = path.stat().st_size
        ranges.sort()
        for (at, n, fqn), (then, _, other) in zip(ranges, ranges[1:] + [(size, 0, "its end")]):
            if at + n > then:  # one byte counted twice would let a small file declare a large tensor
                raise CorruptCheckpointError(
                    f"{file}: the bytes of {fqn!r:.80} in {path.name} overlap {other if other == 'its end' else repr(other)[:80]} "
                    f"(a file of {size} bytes)"
                )
    return out


def _tensor(file: Path, fqn: str, entry: Any, stored: dict[Any, Stored]) -> Tensor:
    """What tensor ``fqn`` declares, refused unless its chunks tile it and its stored bytes can hold it."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    torch = _torch()
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    if type(dtype) is not torch.dtype:
        raise CorruptCheckpointError(f"{file}: {fqn!r:.80} has no dtype")
    found = dtypes.BY_TORCH_NAME.get(str(dtype).removeprefix("torch."))
    if found is None:
        raise UnsupportedValueError(f"{file}: {fqn!r:.80} is a {dtype} tensor, a dtype trainstate does not store")
    itemsize = dtypes.from_code(found.code).itemsize
    shape = _dims(file, fqn, getattr(entry, "size", None), None)
    chunks = getattr(entry, "chunks", None)
    if type(chunks) is not list or not all(type(c) is ChunkStorageMetadata for c in chunks):
        raise CorruptCheckpointError(f"{file}: {fqn!r:.80} has no list of chunks")
    layout = []
    for i, chunk in enumerate(chunks):
        offsets = _dims(file, fqn, getattr(chunk, "offsets", None), len(shape))
        sizes = _dims(file, fqn, getattr(chunk, "sizes", None), len(shape))
        if any(o + n > d for o, n, d in zip(offsets, sizes, shape)):
            raise CorruptCheckpointError(
                f"{file}: {fqn!r:.80} of shape {list(shape)} has chunks out of its bounds (at {list(offsets)}, "
                f"{list(sizes)})"
            )
        where = stored.get(MetadataIndex(fqn, offsets, i))
        if where is None:
            raise CorruptCheckpointError(f"{file}: {fqn!r:.80} has chunks with no storage (at {list(offsets)})")
        nbytes = math.prod(sizes) * itemsize
        if nbytes > where.length * (ZSTD_RATIO if where.compressed else 1):
            raise CorruptCheckpointError(
                f"{file}: {fqn!r:.80} declares a chunk of {nbytes} bytes, but {where.file.name} holds "
                f"{where.length} bytes for it"
            )
        stored[MetadataIndex(fqn, offsets, i)] = where._replace(limit=nbytes + FRAMING)
        layout.append((offsets, sizes))
    if sum(math.prod(n) for _, n in layout) != math.prod(shape) or _overlap(layout):
        raise CorruptCheckpointError(
            f"{file}: {fqn!r:.80} of shape {list(shape)} has chunks that do not cover it exactly once (a gap or "
            "an overlap, or a layout too irregular to check): the gap would be uninitialised memory"
        )
    return Tensor(found.code, shape, math.prod(shape) * itemsize)


def _dims(file: Path, fqn: str, value: Any, ndim: int | None) -> tuple[int, ...]:
    torch = _torch()
    bad = type(value) is not torch.Size or len(value) > MAX_NDIM or any(n < 0 for n in value)
    if bad or (ndim is not None and len(value) != ndim):
        raise CorruptCheckpointError(f"{file}: {fqn!r:.80} has a shape or chunks that are not lists of sizes")
    return tuple(int(n) for n in value)


OVERLAP_COMPARISONS = 2_000_000  # pairs the general check compares before it gives up (a few seconds)


def _overlap(layout: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two of these boxes (offsets, sizes) share an element; also True for a layout too irregular to
    check in :data:`OVERLAP_COMPARISONS` comparisons (no save makes one): :func:`trainstate._format.boxes.overlap`."""
    return boxes.overlap(layout, OVERLAP_COMPARISONS) is not None
