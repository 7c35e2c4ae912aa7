"""file plan -> bytes -> manifest -> commit: the synchronous core of every save.

Tensor bytes go from the live tensors' memory straight to the file (no serialized copy of the state), each
hashed on the way; files are written by a small thread pool, one file per thread, so hashing and writing
overlap with each other and with fsync. A tensor larger than one piece (:data:`PIECE_BYTES`) is hashed and
written a piece at a time, while the piece is in cache: its checksum per piece (manifest ``pieces``, which
lets a reader check and copy the same way) and over the whole chunk (what a 1.0 reader checks). Small
tensors are gathered into one buffer per megabyte, so a state of many tiny tensors is not one system call
per tensor.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from trainstate import _checksum as checksum
from trainstate._format import datafile, dtypes, manifest
from trainstate._save.encode import Entry, Snapshot
from trainstate._save.files import PIECE_BYTES, each_file
from trainstate._save.options import SaveOptions
from trainstate._save.plan import FILE_TEMPLATE, plan_files
from trainstate._storage import Storage
from trainstate._version import VERSION

if TYPE_CHECKING:
    from trainstate._keys import Key

log = logging.getLogger("trainstate")
_R = TypeVar("_R")
_GATHER_BYTES = 1 << 20  # tensors under _SMALL_BYTES are written through a buffer of this size
_SMALL_BYTES = 64 << 10


@dataclass(frozen=True)
class SaveResult:
    """What a save did: where, how many bytes, and how long (writing the files vs. committing).

    Attributes:
        path: the checkpoint written.
        nbytes: bytes written (data files and manifest).
        seconds: the whole save.
        write_seconds: writing the data files and the manifest.
        commit_seconds: the commit (rename, and fsync of the directory).

    Example:
        >>> result = trainstate.save("ckpt", {"w": np.ones((2, 3), np.float32)})
        >>> result.path, result.nbytes
        ('ckpt', 640)
    """

    path: str
    nbytes: int
    seconds: float
    write_seconds: float = 0.0
    commit_seconds: float = 0.0


def write_checkpoint(
    final: str,
    snapshot: Snapshot,
    *,
    storage: Storage,
    options: SaveOptions,
    start: float | None = None,
) -> SaveResult:
    """Write a snapshot as a checkpoint and commit it: the synchronous core of every single-process save.

    Data files first, the manifest last, then the backend's commit; on any failure the staging
    location is thrown away and whatever was at ``final`` before is untouched. With ``options.key`` the
    manifest is authenticated (docs/encryption.md) and the chunks encrypted (``options.encoding``).
    """
    start = time.perf_counter() if start is None else start
    tmp = storage.begin(final, overwrite=options.overwrite)
    groups, names = plan_data(storage, snapshot.entries, options)
    unnamed = names  # data files no manifest names yet: what a failure deletes
    try:
        files, tensors = write_data(storage, tmp, snapshot.entries, groups, names, options)
        unnamed = []  # a manifest write that failed may still have landed, naming them
        nbytes, written = commit_manifest(storage, tmp, final, snapshot, files, tensors, names, options)
    except BaseException:
        storage.abort(tmp, unnamed)
        raise
    end = time.perf_counter()
    log.debug("saved %s: %d tensors, %d bytes in %.3fs", final, len(tensors), nbytes, end - start)
    return SaveResult(str(final), nbytes, end - start, written - start, end - written)


def commit_manifest(
    storage: Storage,
    tmp: str,
    final: str,
    snapshot: Snapshot,
    files: tuple[manifest.FileEntry, ...],
    tensors: Mapping[str, manifest.TensorEntry],
    names: list[str],
    options: SaveOptions,
    world_size: int = 1,
) -> tuple[int, float]:
    """Write the manifest naming ``files`` and ``tensors`` into ``tmp`` and commit it to ``final``.

    ``world_size``: the ranks that wrote the files (a collective save), recorded in the manifest. With
    ``options.key`` the manifest is authenticated with a MAC from the key.
    Returns the checkpoint's bytes and the clock when the manifest was written (before the commit).
    """
    raw = manifest_bytes(snapshot, files, tensors, world_size, options.key)
    storage.write(storage.join(tmp, manifest.MANIFEST_NAME), [memoryview(raw)], fsync=options.fsync)
    written = time.perf_counter()
    storage.commit(tmp, final, [*names, manifest.MANIFEST_NAME], overwrite=options.overwrite, fsync=options.fsync)
    return sum(f.size for f in files) + len(raw), written


def manifest_bytes(
    snapshot: Snapshot,
    files: tuple[manifest.FileEntry, ...],
    tensors: Mapping[str, manifest.TensorEntry],
    world_size: int = 1,
    key: Key | None = None,
) -> bytes:
    """The manifest file naming ``files`` and ``tensors``, for the state in ``snapshot`` (saved by
    ``world_size`` ranks, when a collective save wrote it); authenticated with ``key`` when given."""
    return manifest.Manifest(
        tree=snapshot.tree,
        tensors=tensors,
        files=files,
        metadata=snapshot.metadata,
        created=time.time(),
        writer=f"trainstate {VERSION}",
        world_size=world_size,
    ).to_json_bytes(key)


def plan_data(
    storage: Storage, entries: list[Entry], options: SaveOptions, prefix: str = "data"
) -> tuple[list[list[Entry]], list[str]]:
    """The data files of this save (of this rank's part, under ``prefix``): the entries in each, and its name."""
    caps = storage.capabilities
    n_files = options.threads
    if caps.target_file_bytes:  # remote: many moderate files, uploaded several at a time
        n_files = max(options.threads, -(-sum(e.nbytes for e in entries) // caps.target_file_bytes))
    groups = plan_files(entries, n_files)
    # Written in place beside a committed checkpoint: names of this save alone, never the old files'.
    if caps.in_place:
        prefix = f"{prefix}-{uuid.uuid4().hex[:12]}"
    return groups, [FILE_TEMPLATE.format(prefix, i) for i in range(len(groups))]


def write_data(
    storage: Storage,
    tmp: str,
    entries: list[Entry],
    groups: list[list[Entry]],
    names: list[str],
    options: SaveOptions,
) -> tuple[tuple[manifest.FileEntry, ...], dict[str, manifest.TensorEntry]]:
    """Write each group of entries as its data file; the files' and the tensors' manifest entries.

    ``options.writers(storage)`` files are written at once. With chunk transforms (``options.encoding``:
    compression, encryption) each tensor is cut into chunks and encoded on the way (``chunked.py``).
    """

    def write(name: str, group: list[Entry]) -> tuple[int, str, list[tuple[int, int]], _FileViews]:
        return _write_group(storage, storage.join(tmp, name), group, options.fsync)

    pipeline = options.encoding
    if pipeline is not None:
        from trainstate._save.chunked import write_encoded  # imports this module

        return write_encoded(storage, tmp, entries, groups, names, pipeline, options)
    results = each_file(write, names, groups, options.writers(storage))
    files = []
    tensors: dict[str, manifest.TensorEntry] = {}
    for name, group, (size, header_sum, ranges, views) in zip(names, groups, results):
        files.append(manifest.FileEntry(name, size, header_sum))
        for e, rng, digest, pieces in zip(group, ranges, views.sums, views.pieces):
            chunk = manifest.Chunk(name, rng, e.offset, e.shape, digest, (), pieces)
            tensors[e.name] = manifest.TensorEntry(e.dtype, e.global_shape, e.kind, (chunk,))
    return tuple(files), {e.name: tensors[e.name] for e in entries}


def _write_group(
    storage: Storage, path: str, group: list[Entry], fsync: bool
) -> tuple[int, str, list[tuple[int, int]], _FileViews]:
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
    return size, checksum.digest(header), ranges, views


class _FileViews:
    """A data file's bytes as views of the live arrays; each tensor is hashed on the first pass.

    Iterable more than once, so a storage may retry an upload from the start. Large tensors come out a
    piece at a time (hashed while the piece is in cache), small ones gathered into a buffer.
    """

    def __init__(self, header: bytes, group: list[Entry]) -> None:
        self.header = header
        self.group = group
        self.sums: list[str] = []  # per tensor, over its whole stored bytes
        self.pieces: list[manifest.Pieces | None] = []  # per tensor, for those larger than one piece

    def __iter__(self) -> Iterator[memoryview]:
        gathered = bytearray(memoryview(self.header))
        for i, e in enumerate(self.group):
            data = e.adapter.byte_view(e.value)
            n = data.nbytes
            hashing = i == len(self.sums)  # the first pass, even if an earlier one stopped part-way
            if hashing and n <= PIECE_BYTES:
                self.sums.append(checksum.digest(data))
                self.pieces.append(None)
            if n < _SMALL_BYTES and n <= PIECE_BYTES:  # gathered; never changed once handed out (a storage may keep it)
                if len(gathered) + n > _GATHER_BYTES:
                    yield memoryview(gathered)
                    gathered = bytearray()
                gathered += data
                continue
            if gathered:
                yield memoryview(gathered)
                gathered = bytearray()
            if n <= PIECE_BYTES:
                yield data
                continue
            yield from self._pieces(data, hashing)
            # Let go of this tensor before the next one's bytes are made: where they are made as the writer
            # goes (consolidate reads each tensor then), one large tensor is in memory at a time. The empty
            # view makes the storage drop the last piece it was handed, which would keep this one alive.
            del data
            yield memoryview(b"")
        if gathered:
            yield memoryview(gathered)

    def _pieces(self, data: memoryview, hashing: bool) -> Iterator[memoryview]:
        whole, sums = checksum.Hasher(), []
        for begin in range(0, data.nbytes, PIECE_BYTES):
            piece = data[begin : begin + PIECE_BYTES]
            if hashing:
                sums.append(checksum.digest(piece))
                whole.update(piece)  # from cache: the piece was just hashed
            yield piece
        if hashing:
            self.sums.append(whole.result())
            self.pieces.append(manifest.Pieces(PIECE_BYTES, tuple(sums)))
