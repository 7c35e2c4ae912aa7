"""pack(): one checkpoint as one file, or as bytes, to embed in an application (docs/format.md §10).

The archive holds the checkpoint's own files unchanged (the manifest and every data file it lists, with
their checksums), so ``trainstate.open`` / ``trainstate.load`` read it with every check a directory gets.
Packing streams: the archive is written a file at a time, each in blocks straight from the source's
memory map where it has one, so memory stays near one block when writing to a file. Returning bytes
needs the archive's size in memory, once: the bytes are built in place, never copied at the end.

Bytes are copied as they are, not re-checked: a damaged checkpoint packs into a damaged archive, which
fails its checks when it is read, like the directory would (``trainstate verify`` checks either).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, overload

from trainstate import _keys
from trainstate._format import archive, manifest
from trainstate._format.run_dir import staging_name
from trainstate._restore.checkpoint import Checkpoint
from trainstate._save.options import SaveOptions, save_options
from trainstate._storage import LocalStorage, Source, Storage
from trainstate.errors import CheckpointExistsError, CorruptCheckpointError, InvalidArgumentError, StorageError

BLOCK = 16 << 20  # bytes copied at a time from a data file


@overload
def pack(
    ckpt: Source,
    out: None = None,
    *,
    storage: Storage | None = None,
    overwrite: bool = False,
    fsync: bool = True,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> bytes: ...


@overload
def pack(
    ckpt: Source,
    out: str | os.PathLike[str] | BinaryIO,
    *,
    storage: Storage | None = None,
    overwrite: bool = False,
    fsync: bool = True,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> int: ...


def pack(
    ckpt: Source,
    out: str | os.PathLike[str] | BinaryIO | None = None,
    *,
    storage: Storage | None = None,
    overwrite: bool = False,
    fsync: bool = True,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> bytes | int:
    """Pack the checkpoint ``ckpt`` into one archive: returned as bytes, or written to ``out``.

    Args:
        ckpt: a checkpoint directory or URL (or a packed checkpoint, packed again as it is).
        out: None to return the bytes; a local file path to write them to (atomically: a temporary file
            beside it, renamed into place); or a binary file object open for writing (written from its
            current position, left open).
        storage: where ``ckpt`` is read from (default: chosen from the path).
        overwrite: replace an existing file at the path ``out``.
        fsync: flush the file at ``out`` to stable storage before it is renamed into place.
        key: the key of an encrypted checkpoint: it is authenticated before it is packed, and packed as it
            is (still encrypted; it opens with the same key).
        key_env: the name of an environment variable that holds the key, instead of ``key``.

    Returns:
        The archive's bytes when ``out`` is None, else how many bytes were written.

    Example:
        >>> blob = trainstate.pack("ckpt/step_1200")           # bytes, to embed
        >>> trainstate.load(blob, state)                          # checked like the directory
        >>> trainstate.pack("ckpt/step_1200", "model.tsar")       # a file; trainstate.load("model.tsar")
    """
    options = save_options(overwrite=overwrite, fsync=fsync)  # the archive's; key and key_env read ckpt
    with Checkpoint(ckpt, storage, key=key, key_env=key_env) as ck:
        if any(f.pool for f in ck.manifest.files):  # an archive holds one checkpoint's files, no run's pool
            raise InvalidArgumentError(
                f"{ck.path} is an incremental checkpoint: part of its data is in its run's shared pool, which an "
                "archive cannot refer to. Make a copy that stands alone first (trainstate.consolidate(src, dst), "
                "or `trainstate consolidate SRC DST`) and pack that"
            )
        raw = _manifest_bytes(ck)
        files = [(manifest.MANIFEST_NAME, len(raw)), *((f.path, f.size) for f in ck.manifest.files)]
        head, members, total = archive.layout(files)
        views = _archive(ck, raw, head, members)
        if out is None:
            buffer = io.BytesIO()
            buffer.seek(total - 1)
            buffer.write(b"\0")  # the archive's size allocated once, then filled in place
            buffer.seek(0)
            _write_all(buffer, views)
            return buffer.getvalue()  # CPython hands over its buffer: no second copy
        if isinstance(out, (str, os.PathLike)):
            _write_file(out, views, options)
        elif hasattr(out, "write"):
            _write_all(out, views)
        else:
            raise InvalidArgumentError(
                f"out must be None, a file path or a binary file object open for writing, got {type(out).__name__}"
            )
        return total


def _manifest_bytes(ck: Checkpoint) -> bytes:
    """The manifest file's own bytes (the archive keeps them, checksum and all), read after the checkpoint
    was opened: they must be that checkpoint's, not those of a save that replaced it meanwhile."""
    path = ck.storage.join(ck.path, manifest.MANIFEST_NAME)
    info = ck.storage.stat(path)
    raw = bytearray(info.size if info is not None else 0)
    got = ck.storage.read_into(path, 0, memoryview(raw)) if info is not None else -1
    again = manifest.parse(raw, path, ck._key) if got == len(raw) else None
    if again is None or again.files != ck.manifest.files or again.created != ck.manifest.created:
        raise CorruptCheckpointError(f"{ck.path} changed while it was packed (a save replaced it?): pack it again")
    return bytes(raw)


def _archive(ck: Checkpoint, raw: bytes, head: bytes, members: list[archive.Member]) -> Iterator[memoryview]:
    """The archive's bytes in order: head, then each member after its zero padding."""
    yield memoryview(head)
    at = len(head)
    for m in members:
        yield memoryview(bytes(m.offset - at))
        if m.name == manifest.MANIFEST_NAME:
            yield memoryview(raw)
        else:
            yield from _blocks(ck, m.name, m.length)
        at = m.offset + m.length


def _blocks(ck: Checkpoint, name: str, size: int) -> Iterator[memoryview]:
    """A data file in blocks: views of its map where the storage maps files, else read into one buffer."""
    mm = ck.files.map(name)
    buffer = memoryview(bytearray(min(BLOCK, size))) if mm is None else None
    for begin in range(0, size, BLOCK):
        end = min(size, begin + BLOCK)
        if buffer is None:
            assert mm is not None
            with ck.files.mapped(mm, name, begin, end) as view:
                yield view
        else:
            ck.files.pread(name, buffer[: end - begin], begin)
            yield buffer[: end - begin]


def _write_all(out: BinaryIO, views: Iterator[memoryview]) -> None:
    for view in views:
        done = 0
        while done < view.nbytes:  # a raw file object may write less than it was given
            n = out.write(view[done:])
            done += view.nbytes - done if n is None else n


def _write_file(path: str | os.PathLike[str], views: Iterator[memoryview], options: SaveOptions) -> None:
    """Write a new file atomically: into a hidden temporary sibling, then renamed over ``path``."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text or "://" in text:
        raise InvalidArgumentError(
            f"pack writes a local file; got {path!r:.60}. For another store, pass a binary file object open for "
            "writing (e.g. fsspec.open(url, 'wb')), or take the bytes"
        )
    target = Path(text)
    if target.is_dir():
        raise CheckpointExistsError(f"{target} is a directory; pack writes one file: name the file")
    if target.exists() and not options.overwrite:
        raise CheckpointExistsError(f"{target} exists; pass overwrite=True to replace it")
    tmp = target.parent / staging_name(target.name, "tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        LocalStorage().write(str(tmp), views, fsync=options.fsync)
        os.replace(tmp, target)
        if options.fsync:  # the rename itself is durable
            fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, StorageError):
            raise
        raise StorageError(e.errno, f"cannot write {target}: {e.strerror or e}") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
