"""An incremental run's saves: unchanged tensors refer to the bytes already in the pool, the rest is written.

The save is the ordinary pipeline (``_save/write.py``) with two differences: the data files go into the
run's pool instead of the checkpoint's staging location, and only the tensors the index does not find
unchanged (index.py) are in them. The commit is the same: data first, manifest last, the checkpoint made
visible by the storage's commit. A save killed before its commit leaves pool files no manifest names,
which the next collection removes (gc.py); it never changes a byte a committed checkpoint uses, since
pool files are new names, written once. A save that fails leaves its pool files to the same collection,
which the manager runs right after the failure: it deletes them unless a manifest names them after all.

Before a save shares a chunk it checks that the pool file still holds the chunk's bytes (check.py): a
file deleted or altered since is never named again, and the tensors stored there are written anew.

While a save is in flight the pool files it wrote or refers to are :meth:`IncrementalSaver.protected`
(with those of the index the next save will dedupe against), so a collection never takes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from trainstate._format.manifest import Chunk, FileEntry, Manifest, TensorEntry
from trainstate._format.run_dir import POOL_DIR
from trainstate._incremental.check import PoolCheck
from trainstate._incremental.index import Index
from trainstate._incremental.pool import refuse_foreign, save_prefix
from trainstate._save.encode import Entry, Snapshot
from trainstate._save.options import SaveOptions
from trainstate._save.write import SaveResult, commit_manifest, plan_data, write_checkpoint, write_data
from trainstate._storage import Storage
from trainstate._storage.local import ensure_directory, fsync_path
from trainstate.errors import StorageError

log = logging.getLogger("trainstate")


class IncrementalSaver:
    """Writes a manager's checkpoints incrementally into ``root``'s pool; keeps the index between saves.

    ``base`` finds the manifest to dedupe against when this process has not saved yet (the newest
    checkpoint of the run, after a restart); None when there is none.
    """

    def __init__(self, storage: Storage, root: str, base: Callable[[], Manifest | None]) -> None:
        self.storage = storage
        self.pool = storage.join(root, POOL_DIR)
        refuse_foreign(storage, self.pool)  # at the manager's start, not at its first (perhaps background) save
        self._base = base
        self._index: Index | None = None  # None until the first save looks for one
        self._busy: frozenset[str] = frozenset()  # pool files of the save in flight (written or used)
        self._pending: Index | None = None  # a collective save's share, until it is known to have committed
        self._lock = threading.Lock()
        self._check = PoolCheck(storage, self.pool)
        self.written: set[str] = set()  # pool files this process's saves wrote: unnamed, they need no waiting

    def rebase(self) -> None:
        """Forget the index: the next save dedupes against the base the manager gives then."""
        with self._lock:
            self._index = None

    def protected(self) -> frozenset[str]:
        """Pool files a collection must keep whatever the manifests say: those of the save in flight, and
        those the next save may refer to."""
        with self._lock:
            index = set(self._index.files) if self._index is not None else set()
            return self._busy | index

    def save(self, final: str, snapshot: Snapshot, options: SaveOptions) -> SaveResult:
        """Save ``snapshot`` as the checkpoint ``final``, writing only what changed since the index.

        ``SaveResult.nbytes`` is what this save wrote (new pool files and the manifest), not what the
        checkpoint refers to.
        """
        start = time.perf_counter()
        if not snapshot.entries:  # nothing to share: an ordinary checkpoint, with its one (empty) data file
            result = write_checkpoint(final, snapshot, storage=self.storage, options=options)
            with self._lock:
                self._index = Index.empty()
            return result
        index, reused = self._dedupe(snapshot.entries, options.threads)
        new = [e for e in snapshot.entries if e.name not in reused]
        shared = {c.file for chunks in reused.values() for c in chunks}
        groups, names = plan_data(self.storage, new, options, save_prefix(self.storage)) if new else ([], [])
        with self._lock:
            self._busy = frozenset([*names, *shared])
            self.written.update(names)  # whatever becomes of the save: if nothing names them, they may go
        try:
            tensors, files, nbytes, at = self._write(final, snapshot, reused, new, groups, names, index, options)
        finally:
            with self._lock:
                self._busy = frozenset()
        with self._lock:
            self._index = Index.of(tensors, files)
        end = time.perf_counter()
        log.debug(
            "saved %s incrementally: %d of %d tensors unchanged, %d bytes written in %.3fs",
            final,
            len(reused),
            len(snapshot.entries),
            nbytes,
            end - start,
        )
        return SaveResult(str(final), nbytes, end - start, at - start, end - at)

    def write_share(
        self, entries: list[Entry], rank: int, options: SaveOptions
    ) -> tuple[tuple[FileEntry, ...], dict[str, TensorEntry]]:
        """This rank's share of a collective save (``trainstate._distributed.save``): the boxes whose bytes
        did not change refer to the pool files they are in (another rank's, after a change of world size),
        the rest is written into the pool, in files named for this rank and save. Returns the files and the
        tensors (in share order) for rank 0's manifest.

        The files stay protected until :meth:`settle` hears whether the save committed; a collection runs
        on rank 0 only between saves, when no rank is writing (the save's protocol orders it).
        """
        index, reused = self._dedupe(entries, options.threads)
        new = [e for e in entries if e.name not in reused]
        shared = {c.file for chunks in reused.values() for c in chunks}
        groups, names = plan_data(self.storage, new, options, save_prefix(self.storage, rank)) if new else ([], [])
        with self._lock:
            self._busy = frozenset([*names, *shared])
            self.written.update(names)
        written, fresh = self._write_pool(new, groups, names, options)
        files = (
            *(replace(f, pool=True, new=True) for f in written),
            *(replace(f, new=False) for name, f in index.files.items() if name in shared),
        )
        tensors = {
            e.name: TensorEntry(e.dtype, e.global_shape, e.kind, reused[e.name]) if e.name in reused else fresh[e.name]
            for e in entries
        }
        with self._lock:
            self._pending = Index.of(tensors, files)
        log.debug("wrote rank %d's share incrementally: %d of %d boxes unchanged", rank, len(reused), len(entries))
        return files, tensors

    def settle(self, committed: bool) -> None:
        """The collective save :meth:`write_share` took part in is over: committed (its share becomes the
        index the next save dedupes against) or not (the index stays; what it wrote is the collection's)."""
        with self._lock:
            if committed and self._pending is not None:
                self._index = self._pending
            self._pending = None
            self._busy = frozenset()

    def _dedupe(self, entries: list[Entry], threads: int) -> tuple[Index, dict[str, tuple[Chunk, ...]]]:
        """The index, and the entries it finds unchanged with their stored chunks, once the pool files
        under them are checked: a tensor stored in a file gone or altered is written again."""
        index = self._index if self._index is not None else self._load_base()
        reused = _unchanged(index, entries, threads)
        damaged = self._check.damaged((c for chunks in reused.values() for c in chunks), index.files, threads)
        if damaged:  # never name bytes that are gone or wrong: those tensors are written again
            log.warning(
                "pool files %s of %s are missing or damaged: the tensors stored there are written again",
                sorted(damaged),
                self.pool,
            )
            reused = {n: chunks for n, chunks in reused.items() if not any(c.file in damaged for c in chunks)}
            index = index.without_files(damaged)
        return index, reused

    def _write_pool(
        self, new: list[Entry], groups: list[list[Entry]], names: list[str], options: SaveOptions
    ) -> tuple[tuple[FileEntry, ...], dict[str, TensorEntry]]:
        """Write ``new`` into the pool, its names durable before a manifest names them."""
        storage = self.storage
        refuse_foreign(storage, self.pool)
        if storage.capabilities.makedirs:  # real directories (object stores have prefixes instead)
            ensure_directory(self.pool, "the shared pool")
        if not new:
            return (), {}
        written, fresh = write_data(storage, self.pool, new, groups, names, options)
        if options.fsync and storage.capabilities.makedirs:
            _fsync_directory(self.pool)
        return written, fresh

    def _write(
        self,
        final: str,
        snapshot: Snapshot,
        reused: dict[str, tuple[Chunk, ...]],
        new: list[Entry],
        groups: list[list[Entry]],
        names: list[str],
        index: Index,
        options: SaveOptions,
    ) -> tuple[dict[str, TensorEntry], tuple[FileEntry, ...], int, float]:
        """Write the new tensors into the pool and commit the manifest: its tensors and files, the bytes
        written, and the clock when the manifest was written."""
        storage = self.storage
        tmp = storage.begin(final, overwrite=options.overwrite)
        try:
            written, fresh = self._write_pool(new, groups, names, options)
            used = {c.file for chunks in reused.values() for c in chunks}
            files = (
                *(replace(f, pool=True, new=True) for f in written),
                *(replace(f, new=False) for name, f in index.files.items() if name in used),
            )
            tensors = {
                e.name: TensorEntry(e.dtype, e.global_shape, e.kind, reused[e.name])
                if e.name in reused
                else fresh[e.name]
                for e in snapshot.entries
            }
            size, at = commit_manifest(storage, tmp, final, snapshot, files, tensors, [], options)
        except BaseException:
            # Its pool files stay: whether a manifest names them (one whose write failed may still have
            # landed, or a commit may have failed after its rename) is the collection's to decide (gc.py).
            storage.abort(tmp, [])
            raise
        return tensors, files, size - sum(f.size for f in files if not f.new), at

    def _load_base(self) -> Index:
        """The index of the run's newest checkpoint (what of it is still in the pool is checked as it is
        shared, see check.py)."""
        manifest = self._base()
        return Index.empty() if manifest is None else Index.of(manifest.tensors, manifest.files)


_PARALLEL_BYTES = 64 << 20  # below this, hashing on one thread costs less than starting more


def _unchanged(index: Index, entries: list[Entry], threads: int) -> dict[str, tuple[Chunk, ...]]:
    """The entries the index finds unchanged, and their stored chunks; hashed on ``threads`` threads, each
    given about the same bytes (largest tensors dealt first)."""
    candidates = sorted((e for e in entries if e.name in index.tensors), key=lambda e: -e.nbytes)
    lanes: list[list[Entry]] = [[] for _ in range(max(1, threads))]
    if threads <= 1 or sum(e.nbytes for e in candidates) < _PARALLEL_BYTES:
        lanes = [candidates]
    else:
        loads = [0] * threads
        for e in candidates:
            i = loads.index(min(loads))
            lanes[i].append(e)
            loads[i] += e.nbytes

    def check(lane: list[Entry]) -> dict[str, tuple[Chunk, ...]]:
        found = ((e.name, index.unchanged(e)) for e in lane)
        return {name: chunks for name, chunks in found if chunks is not None}

    if len(lanes) == 1:
        return check(lanes[0])
    with ThreadPoolExecutor(len(lanes), thread_name_prefix="trainstate-dedupe") as pool:
        return {name: chunks for part in pool.map(check, lanes) for name, chunks in part.items()}


def _fsync_directory(path: str) -> None:
    try:
        fsync_path(path)
    except OSError as e:
        raise StorageError(e.errno, f"fsync failed for {path}: {e.strerror}") from e
