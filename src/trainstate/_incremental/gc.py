"""Mark and sweep of a run's shared pool: a pool file goes only when no manifest in the run names it.

**Mark**: every manifest directly under the run directory counts -- committed checkpoints, pinned ones,
copies a user made there, and the ``.old-`` / ``.del-`` / ``.tmp-`` leftovers a sweep may still put
back -- each read as plain JSON for its ``"pool": true`` files (no checksum needed to *keep* bytes). A
manifest that is not JSON at all is damaged past loading: every pool file whose name is still in its bytes
is kept while it is there (it may be mended by hand; retention deletes it in its turn), and the rest of
the pool is collected -- one damaged manifest used to stop every collection, and the pool grew with every
save. JSON of a shape this version does not know (perhaps a newer format's, naming its files otherwise),
and an entry that changed between the listing and the end of the mark (a leftover put back meanwhile),
may name what the mark missed: then the round deletes nothing. JSON of another shape that fails its own
checksum is no newer format but damage (a bit flip turning ``"files"`` into ``"fines"``), and JSON that
fails it is read as damaged bytes are, by the names in them: a pinned checkpoint so damaged used to stop
every collection for good, or lose the pool files a flipped ``"pool"`` no longer marked. **Sweep**: the pool was listed *before* the mark, so a save that commits meanwhile
cannot lose a file it just wrote; a listed file goes unless marked or protected (the manager's save in
flight and the files its next save may refer to). Where no lock keeps other writers out (object stores)
a file also needs to be untouched for an hour, unless this process wrote it itself, as for any leftover.

A kill at any point leaves at worst a file nobody names, taken by a later round; a file a kept
checkpoint names is never deleted, since deleting comes after the mark that found every such name.
"""

from __future__ import annotations

import errno
import json
import logging
import re
from collections.abc import Collection

from trainstate._format import manifest, manifest_limits
from trainstate._format.run_dir import POOL_DIR
from trainstate._incremental.pool import foreign, is_pool_file
from trainstate._storage import Storage
from trainstate.errors import CheckpointError, CorruptCheckpointError, StorageError

log = logging.getLogger("trainstate")


class PoolCollector:
    """Collects a run directory's unreferenced pool files; caches what each manifest names."""

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage = storage
        self.root = root
        self.pool = storage.join(root, POOL_DIR)
        self._named: dict[str, tuple[tuple[str, int], frozenset[str]]] = {}  # path -> ((checksum, size), names)

    def collect(
        self, *, locked: bool, min_age: float, keep: Collection[str] = (), mine: Collection[str] = ()
    ) -> list[str]:
        """Delete the pool files no manifest names; returns their names.

        ``locked``: the caller holds the run's lock, so no other process saves here; else a file must be
        ``min_age`` seconds old (``mine``: files this process wrote need not). ``keep``: files to keep
        whatever the manifests say.
        """
        target = foreign(self.storage, self.pool)
        if target is not None:  # another run's pool, or one several runs share: its files are not all ours
            log.warning("not collecting %s: it is a symbolic link to %s, not this run's own pool", self.pool, target)
            return []
        candidates = [n for n in self.storage.list(self.pool) if is_pool_file(n) and n not in keep]
        if not candidates:
            return []
        named = self._mark()
        if named is None:
            return []
        removed = []
        for name in candidates:
            if name in named:
                continue
            path = self.storage.join(self.pool, name)
            if not locked and name not in mine and self.storage.age(path) < min_age:
                continue  # perhaps another writer's save in flight
            self.storage.delete(path)
            removed.append(name)
        if removed:
            log.info("removed %d pool file(s) of %s that no checkpoint uses: %s", len(removed), self.pool, removed)
        return removed

    def _mark(self) -> set[str] | None:
        """Every pool file a manifest in the run directory names; None when that cannot be told for sure."""
        entries = [n for n in self.storage.list(self.root) if n != POOL_DIR]
        named: set[str] = set()
        seen = set()
        for entry in entries:
            path = self.storage.join(self.root, entry, manifest.MANIFEST_NAME)
            info = self.storage.stat(path)
            if info is None or info.is_dir:
                continue  # not a checkpoint (or not committed: its save protects its own files)
            names = self._names(path, info.size)
            if names is None:
                return None
            named |= names
            seen.add(path)
        for path in set(self._named) - seen:
            del self._named[path]
        if [n for n in self.storage.list(self.root) if n != POOL_DIR] != entries:
            return None  # something moved meanwhile (a leftover put back): look again next time
        return named

    def _names(self, path: str, size: int) -> frozenset[str] | None:
        """The pool files the manifest at ``path`` names; None when it cannot be read as JSON.

        Cached by the checksum the manifest begins with (it covers the rest), read in a few bytes: not by
        modification time, which object stores keep to the second, so an overwrite within that second
        would look unchanged.
        """
        if size > manifest_limits.MAX_BYTES:
            log.warning("not collecting the pool: %s is too large to be a manifest", path)
            return None
        try:
            head = bytearray(min(size, _HEAD))
            got = self.storage.read_into(path, 0, memoryview(head))
            found = _CHECKSUM.match(bytes(head[:got]))
            key = (found.group(1).decode(), size) if found else None
            cached = self._named.get(path)
            if key is not None and cached is not None and cached[0] == key:
                return cached[1]
            raw = bytearray(size)
            got = self.storage.read_into(path, 0, memoryview(raw))
        except StorageError as e:
            if e.errno == errno.ENOENT:
                return None  # moved or deleted since the listing
            raise
        try:
            body = json.loads(bytes(raw[:got]))
        except (ValueError, RecursionError) as e:
            # Not JSON: damaged, so it cannot be loaded, but it may be mended by hand; every pool file whose
            # name is still in its bytes stays while it does (retention deletes it in its turn, see the
            # manager), and the rest of the pool is collected.
            names = frozenset(m.decode() for m in _POOL_NAME.findall(bytes(raw[:got])))
            log.warning(
                "%s is not JSON (%s): keeping the %d pool file(s) whose names are in its bytes while it is there",
                path,
                e,
                len(names),
            )
            return names
        if _damaged(raw[:got], body, path):  # a bit flip may leave JSON ("files" -> "fines", "pool" -> "pomm")
            names = frozenset(m.decode() for m in _POOL_NAME.findall(bytes(raw[:got])))
            log.warning(
                "%s fails its checksum: keeping the %d pool file(s) whose names are in its bytes while it is there",
                path,
                len(names),
            )
        else:
            try:
                files = body["files"]
                names = frozenset(
                    f["path"]
                    for f in files
                    if type(f) is dict and f.get("pool") is True and isinstance(f.get("path"), str)
                )
            except (
                KeyError,
                TypeError,
            ) as e:  # JSON of another shape: perhaps a newer format's, naming files otherwise
                log.warning("not collecting the pool: %s cannot be read (%s), so what it uses is unknown", path, e)
                return None
        if key is not None:
            self._named[path] = (key, names)
        return names


def _damaged(raw: bytes | bytearray, body: object, path: str) -> bool:
    """Whether a manifest's bytes fail their own checksum: damaged, not a newer format's. An encrypted
    manifest's MAC needs the key, which the collector does not have: not known to be damaged."""
    if not isinstance(body, dict) or not isinstance(body.get("checksum"), str):
        return False  # no checksum to fail: JSON of some other shape, not known to be damaged
    try:
        manifest._verify(raw, dict(body), None, path)
    except CorruptCheckpointError:
        return True
    except CheckpointError:  # an encrypted checkpoint's: the MAC cannot be checked here
        return False
    return False


_HEAD = 128  # enough for '{"checksum":"hmac-sha256:<64 hex digits>"' (docs/format.md §3: the first member)
_POOL_NAME = re.compile(rb"pool-[A-Za-z0-9_.-]{1,200}?\.safetensors")  # is_pool_file's names, as JSON holds them
_CHECKSUM = re.compile(rb'\{"checksum":"([a-z0-9_-]{1,16}:[0-9a-f]{1,64})"')
