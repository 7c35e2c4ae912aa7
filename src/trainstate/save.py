"""save(): state → entries → file plan → bytes → manifest → commit.

Tensor bytes go from the live tensors' memory straight to the file (no serialized copy of the state), each
hashed on the way; files are written by a small thread pool, one file per thread, so hashing and writing
overlap with each other and with fsync.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import tree
from .format import checksum, datafile, dtypes, manifest
from .frameworks import adapter_for
from .storage import Storage, resolve

log = logging.getLogger("trainstate")

DEFAULT_THREADS = 2
FILE_TEMPLATE = "{}-{:05d}.safetensors"


@dataclass
class _Entry:
    name: str
    value: Any
    adapter: ModuleType
    dtype: str
    shape: tuple[int, ...]
    kind: str
    nbytes: int


class TensorTable:
    """Collects the arrays met while encoding; an array met twice (tied weights) is stored once."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self._by_identity: dict[tuple[object, ...], str] = {}
        self._names: set[str] = set()

    def add(self, path: tuple[str, ...], value: Any) -> str:
        adapter = adapter_for(value)
        assert adapter is not None
        dtype, shape, kind = adapter.describe(value)  # also refuses what cannot be stored
        ident = adapter.identity(value)
        if ident is not None and ident in self._by_identity:
            return self._by_identity[ident]
        name = tree.join(path) or "_"
        base, n = name, 1
        while name in self._names:  # e.g. {"a.b": x, "a": {"b": y}}
            n += 1
            name = f"{base}~{n}"
        self._names.add(name)
        nbytes = dtypes.from_code(dtype).itemsize * math.prod(shape)
        self.entries.append(_Entry(name, value, adapter, dtype, shape, kind, nbytes))
        if ident is not None:
            self._by_identity[ident] = name
        return name


@dataclass(frozen=True)
class SaveResult:
    """What a save did: where, how many bytes, and how long (writing the files vs. committing)."""

    path: str
    nbytes: int
    seconds: float
    write_seconds: float = 0.0
    commit_seconds: float = 0.0


def save(
    path: str | os.PathLike[str],
    state: Any,
    *,
    metadata: Any = None,
    overwrite: bool = False,
    fsync: bool = True,
    threads: int = DEFAULT_THREADS,
    storage: Storage | None = None,
) -> SaveResult:
    """Save ``state`` as a checkpoint directory at ``path``, atomically.

    Args:
        path: the checkpoint directory to create.
        state: nested dicts / lists / tuples of tensors, arrays, plain values and objects with
            ``state_dict()`` / ``load_state_dict()``.
        metadata: plain values (no arrays) stored in the manifest, readable without touching tensors.
        overwrite: replace an existing checkpoint at ``path`` (atomically).
        fsync: flush files and directories to stable storage before the commit.
        threads: writer threads; tensors are spread over this many data files.
        storage: where to write (default: chosen from ``path``; the local filesystem for plain paths).

    Returns:
        A :class:`SaveResult` with the path, bytes written and seconds taken.

    Example:
        >>> trainstate.save("ckpt/step_1200", {"model": model, "step": 1200}, metadata={"run": "exp1"})
    """
    start = time.perf_counter()
    backend, root = resolve(path, storage)
    snapshot = encode_state(state, metadata)
    return write_checkpoint(
        root, snapshot, storage=backend, overwrite=overwrite, fsync=fsync, threads=threads, start=start
    )


@dataclass
class Snapshot:
    """A state flattened for writing: the encoded tree, its metadata, and the arrays to store."""

    tree: Any
    metadata: Any
    entries: list[_Entry]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def encode_state(state: Any, metadata: Any = None) -> Snapshot:
    """Flatten ``state`` (calling ``state_dict()`` on statefuls) without copying any array."""
    table = TensorTable()
    tree_node = tree.encode(state, table.add)
    return Snapshot(tree_node, tree.encode_plain(metadata), table.entries)


def write_checkpoint(
    final: str,
    snapshot: Snapshot,
    *,
    storage: Storage,
    overwrite: bool = False,
    fsync: bool = True,
    threads: int = DEFAULT_THREADS,
    start: float | None = None,
) -> SaveResult:
    """Write a snapshot as a checkpoint and commit it: the synchronous core of every save.

    Data files first, the manifest last, then the backend's commit; on any failure the staging
    location is thrown away and whatever was at ``final`` before is untouched.
    """
    start = time.perf_counter() if start is None else start
    tmp = storage.begin(final, overwrite=overwrite)
    try:
        files, tensors = _write_files(storage, tmp, snapshot.entries, fsync=fsync, threads=threads)
        body = manifest.Manifest(
            tree=snapshot.tree,
            tensors=tensors,
            files=files,
            metadata=snapshot.metadata,
            created=time.time(),
            writer=f"trainstate {_version()}",
        )
        raw = body.to_json_bytes()
        storage.write(storage.join(tmp, manifest.MANIFEST_NAME), [memoryview(raw)], fsync=fsync)
        written = time.perf_counter()
        storage.commit(tmp, final, overwrite=overwrite, fsync=fsync)
    except BaseException:
        storage.abort(tmp)
        raise
    total = sum(f.size for f in files) + len(raw)
    end = time.perf_counter()
    log.debug("saved %s: %d tensors, %d bytes in %.3fs", final, len(tensors), total, end - start)
    return SaveResult(str(final), total, end - start, written - start, end - written)


def _version() -> str:
    from . import __version__

    return __version__


def plan_files(entries: list[_Entry], n_files: int) -> list[list[_Entry]]:
    """Spread entries over at most ``n_files`` files with balanced byte counts, keeping state order inside."""
    n_files = max(1, min(n_files, len(entries)))
    loads = [0] * n_files
    owner: dict[int, int] = {}
    for i in sorted(range(len(entries)), key=lambda i: -entries[i].nbytes):
        f = loads.index(min(loads))
        owner[i] = f
        loads[f] += entries[i].nbytes
    return [[e for i, e in enumerate(entries) if owner[i] == f] for f in range(n_files)]


def _write_files(
    storage: Storage, tmp: str, entries: list[_Entry], *, fsync: bool, threads: int
) -> tuple[tuple[manifest.FileEntry, ...], dict[str, manifest.TensorEntry]]:
    n_files = threads
    if storage.target_file_bytes:  # remote: many moderate files, uploaded several at a time
        n_files = max(threads, -(-sum(e.nbytes for e in entries) // storage.target_file_bytes))
    groups = plan_files(entries, n_files)
    prefix = storage.new_file_prefix()
    names = [FILE_TEMPLATE.format(prefix, i) for i in range(len(groups))]

    def write(name: str, group: list[_Entry]) -> tuple[int, str, list[tuple[int, int]], list[str]]:
        return _write_group(storage, storage.join(tmp, name), group, fsync)

    workers = min(len(groups), max(threads, 8 if storage.in_place else threads))
    if workers <= 1:
        results = [write(name, group) for name, group in zip(names, groups)]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="trainstate-save") as pool:
            results = list(pool.map(write, names, groups))
    files = []
    tensors: dict[str, manifest.TensorEntry] = {}
    for name, group, (size, header_sum, ranges, sums) in zip(names, groups, results):
        files.append(manifest.FileEntry(name, size, header_sum))
        for e, rng, digest in zip(group, ranges, sums):
            chunk = manifest.Chunk(name, rng, (0,) * len(e.shape), e.shape, digest)
            tensors[e.name] = manifest.TensorEntry(e.dtype, e.shape, e.kind, (chunk,))
    return tuple(files), {e.name: tensors[e.name] for e in entries}


def _write_group(
    storage: Storage, path: str, group: list[_Entry], fsync: bool
) -> tuple[int, str, list[tuple[int, int]], list[str]]:
    header_entries = []
    for e in group:
        if dtypes.from_code(e.dtype).safetensors:
            header_entries.append(datafile.HeaderEntry(e.name, e.dtype, e.shape, e.nbytes))
        else:  # readable as raw bytes by safetensors; the manifest has the real dtype
            header_entries.append(datafile.HeaderEntry(e.name, "U8", (e.nbytes,), e.nbytes))
    header, offsets = datafile.build_header(header_entries, {"format": "trainstate"})
    ranges = [(o, o + e.nbytes) for o, e in zip(offsets, group)]
    views = _FileViews(header, group)
    size = storage.write(path, views, fsync=fsync)
    return size, checksum.digest(header), ranges, views.sums


class _FileViews:
    """A data file's bytes as views of the live arrays; each tensor is hashed on the first pass.

    Iterable more than once, so a storage may retry an upload from the start.
    """

    def __init__(self, header: bytes, group: list[_Entry]) -> None:
        self.header = header
        self.group = group
        self.sums: list[str] = []

    def __iter__(self) -> Iterator[memoryview]:
        yield memoryview(self.header)
        for i, e in enumerate(self.group):
            data = e.adapter.byte_view(e.value)
            if i == len(self.sums):
                self.sums.append(checksum.digest(data))
            yield data
