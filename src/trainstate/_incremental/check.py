"""Whether the pool bytes a save is about to share are still the bytes the manifest it copies names.

An incremental save copies the chunk entries of unchanged tensors from the previous manifest. If the pool
file under a chunk was deleted or altered since (by hand, a tool, a disk), the new checkpoint would name
bytes that fail its checksums, and so would every save after it: one damaged file would take the whole
run's later checkpoints with it. So before a save shares a chunk, it checks the chunk's file:

- **stat**, every save: a file that is gone, not a plain file, or not of the size the manifest lists
  (a reader refuses it) is not shared.
- **its bytes**, read back and hashed against the chunk's stored checksum (and the file's safetensors
  header against the header checksum the manifest lists: a reader checks both), where the stat cannot
  vouch for them: the first time this process shares the chunk (after a restart nothing is known), and again
  whenever the file's size or modification time is not what it was when its bytes were last checked.
- A file whose modification time was less than :data:`RACY_SECONDS` before that check is read again the
  next time too: a write in the same tick of the file system's clock (some keep it to a few milliseconds,
  object stores to the second) would leave the time unchanged (git's "racily clean" files).
- Bytes checked more than :data:`RECHECK_SECONDS` ago are read again: what the stat cannot see -- bytes
  that change while the size and modification time stay (a bit flipped on the disk, a tool that restores
  the time) -- is shared for at most that long (or until a restart; ``trainstate verify`` finds it too).

Cost (bench/bench_pool_check.py): a save that shares files checked before pays a stat per shared file;
a restart, and each hour, one read of what is shared. A file damaged between this check and the commit
is named all the same; a load finds it by its checksums.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from trainstate import _checksum as checksum
from trainstate._format import datafile
from trainstate._format.manifest import Chunk, FileEntry
from trainstate._storage import Storage
from trainstate.errors import CorruptCheckpointError, StorageError

log = logging.getLogger("trainstate")

RACY_SECONDS = 2.0  # a modification time this close to when the bytes were checked may hide a later write
RECHECK_SECONDS = 3600.0  # bytes checked longer ago are read again: bounds how long unseen damage is shared
_BLOCK = 4 << 20  # read back in blocks this large (one buffer per thread)
_PARALLEL_BYTES = 64 << 20  # below this, checking on one thread costs less than starting more
_HEADER = (0, 0)  # stands for the file's header among the byte ranges found intact


@dataclass(frozen=True)
class _Checked:
    """A pool file as it was when chunks of it were last read back and found intact."""

    size: int
    mtime: float
    at: float  # wall-clock time of that stat
    ranges: frozenset[tuple[int, int]]  # the byte ranges found intact

    def vouches(self, size: int, mtime: float, now: float) -> bool:
        """Whether a file found of ``size`` and ``mtime`` at ``now`` still holds the bytes found intact."""
        if size != self.size or mtime != self.mtime or mtime == 0.0:
            return False
        return self.at - mtime >= RACY_SECONDS and 0.0 <= now - self.at < RECHECK_SECONDS


class PoolCheck:
    """Checks the pool files a save shares; remembers what it found intact, by size and modification time."""

    def __init__(self, storage: Storage, pool: str) -> None:
        self.storage = storage
        self.pool = pool
        self._checked: dict[str, _Checked] = {}

    def damaged(self, shared: Iterable[Chunk], files: Mapping[str, FileEntry], threads: int) -> set[str]:
        """The names of the pool files under ``shared`` that are gone, not of the size ``files`` lists (a
        reader refuses those), or no longer hold the header or the chunks' bytes the manifest names."""
        by_file: dict[str, dict[tuple[int, int], Chunk]] = {}
        for c in shared:
            by_file.setdefault(c.file, {})[c.byte_range] = c
        bad: set[str] = set()
        todo: dict[str, tuple[float, int, float, list[Chunk]]] = {}  # file -> (its stat time, size, mtime, chunks)
        for name, chunks in by_file.items():
            at = time.time()
            entry = files.get(name)
            info = self.storage.stat(self.storage.join(self.pool, name))
            if entry is None or info is None or info.is_dir or not info.regular or info.size != entry.size:
                bad.add(name)
                continue
            known = self._checked.get(name)
            vouched = known.ranges if known is not None and known.vouches(info.size, info.mtime, at) else frozenset()
            unread = [c for r, c in chunks.items() if r not in vouched]
            if unread or _HEADER not in vouched:
                if _HEADER not in vouched and not self._header_intact(name, entry):
                    bad.add(name)
                    continue
                todo[name] = (at, info.size, info.mtime, unread)
        if todo:
            bad |= self._read_back(todo, threads)
        for name in bad:
            self._checked.pop(name, None)
        return bad

    def _header_intact(self, name: str, entry: FileEntry) -> bool:
        """Whether the file's safetensors header is the one the manifest's header checksum names."""
        path = self.storage.join(self.pool, name)
        try:
            prefix = bytearray(8)
            if self.storage.read_into(path, 0, memoryview(prefix)) != 8:
                return False
            n = datafile.header_length(bytes(prefix))
            if n > entry.size:
                return False
            blob = bytearray(n)
            if self.storage.read_into(path, 0, memoryview(blob)) != n:
                return False
            return checksum.value_of(memoryview(blob)) == checksum.expected_value(entry.header_checksum, path)
        except StorageError as e:
            if e.errno == errno.ENOENT:
                return False
            raise
        except CorruptCheckpointError:
            return False  # a malformed length prefix, or a checksum this version cannot check

    def _read_back(self, todo: Mapping[str, tuple[float, int, float, list[Chunk]]], threads: int) -> set[str]:
        """Read the chunks of ``todo`` back; returns the files with a chunk that does not hash as named."""
        jobs = [(name, c) for name, (*_, chunks) in todo.items() for c in chunks]
        total = sum(c.byte_range[1] - c.byte_range[0] for _, c in jobs)
        if threads <= 1 or total < _PARALLEL_BYTES or len(jobs) == 1:
            intact = [self._intact(name, c) for name, c in jobs]
        else:
            with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="trainstate-check") as ex:
                intact = list(ex.map(lambda job: self._intact(*job), jobs))
        bad = {name for (name, _), ok in zip(jobs, intact) if not ok}
        for name, (at, size, mtime, chunks) in todo.items():
            if name in bad:
                continue
            known = self._checked.get(name)
            kept = known.ranges if known is not None and known.vouches(size, mtime, at) else frozenset()
            self._checked[name] = _Checked(size, mtime, at, kept | {c.byte_range for c in chunks} | {_HEADER})
        return bad

    def _intact(self, name: str, chunk: Chunk) -> bool:
        """Whether the chunk's stored bytes are in its pool file and hash to its checksum."""
        path = self.storage.join(self.pool, name)
        begin, end = chunk.byte_range
        buf = bytearray(min(_BLOCK, end - begin))
        hasher = checksum.Hasher()
        try:
            while begin < end:
                view = memoryview(buf)[: min(len(buf), end - begin)]
                got = self.storage.read_into(path, begin, view)
                if got != len(view):
                    return False
                hasher.update(view)
                begin += got
            return checksum.expected_value(hasher.result(), path) == checksum.expected_value(chunk.checksum, path)
        except StorageError as e:
            if e.errno == errno.ENOENT:
                return False
            raise
        except CorruptCheckpointError:
            return False  # a checksum this version cannot check: not shared, written again
