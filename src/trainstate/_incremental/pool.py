"""Where a run's shared pool is, and how its files are named (docs/format.md §11).

A checkpoint of an incremental run keeps no data files of its own: every data file it lists with
``"pool": true`` lives in the pool, the directory (object stores: the prefix) ``_shared`` beside the
checkpoint, in its run directory. Files there outlive any one checkpoint, so retention can delete a
checkpoint whose bytes a later one still uses; a pool file goes only when no manifest names it (gc.py).
The name is fixed by the format, never read from a manifest, so a manifest cannot point a reader outside
its run directory.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from collections.abc import Iterable

from trainstate._format.manifest import FileEntry
from trainstate._format.run_dir import POOL_DIR
from trainstate._storage import Storage
from trainstate.errors import CorruptCheckpointError, InvalidArgumentError

PREFIX = "pool"  # pool files are pool-<12 hex digits, new per save>[-r<rank>]-NNNNN.safetensors


def run_directory(storage: Storage, checkpoint: str) -> str:
    """The directory holding ``checkpoint``: its run directory when a manager wrote it.

    A link the user made to a checkpoint (``best -> runs/exp1/step_00001200``) stands for the checkpoint it
    points to, as in ``trainstate ls``, so its pool is found beside the real one.
    """
    if storage.capabilities.symlinks:
        return os.path.dirname(os.path.realpath(checkpoint))
    return posixpath.dirname(checkpoint.rstrip("/"))


def pool_directory(storage: Storage, checkpoint: str) -> str:
    """The pool a checkpoint's ``"pool": true`` files live in."""
    return storage.join(run_directory(storage, checkpoint), POOL_DIR)


def foreign(storage: Storage, pool: str) -> str | None:
    """Where a run's pool really is, when it is not the run's own directory (``_shared`` a symbolic link to
    another run's pool), else None. Collection deletes every pool file the run's own manifests do not name,
    so a pool two runs write into would lose each run's files to the other's collection."""
    if storage.capabilities.symlinks and os.path.islink(pool):
        return os.path.realpath(pool)
    return None


def refuse_foreign(storage: Storage, pool: str) -> None:
    """Raise when an incremental save would write into a pool that is not the run's own (:func:`foreign`).

    Raises:
        InvalidArgumentError: ``pool`` is a symbolic link.
    """
    target = foreign(storage, pool)
    if target is not None:
        raise InvalidArgumentError(
            f"the shared pool {pool} is a symbolic link to {target}: a run's pool must be its own directory, "
            "since each run's collection deletes the pool files its own checkpoints do not name (another run's "
            "among them). Remove the link; to keep a frozen part once for several runs, load it from one "
            "checkpoint into each run instead"
        )


def save_prefix(storage: Storage, rank: int | None = None) -> str:
    """The prefix of one save's pool files: ``pool-<id>``, unique to the save, and ``-r<rank>`` after it for
    a rank's share of a collective save (``pool-<id>-r00003``): files named per rank and save.

    Where the storage names data files uniquely per save itself (``in_place``), it adds the id.
    """
    own = "" if storage.capabilities.in_place else f"-{uuid.uuid4().hex[:12]}"
    return f"{PREFIX}{own}" + (f"-r{rank:05d}" if rank is not None else "")


def is_pool_file(name: str) -> bool:
    """Whether a name in the pool is one a save writes (anything else there is left alone)."""
    return name.startswith(PREFIX + "-") and name.endswith(".safetensors")


def locations(storage: Storage, checkpoint: str, files: Iterable[FileEntry]) -> dict[str, str]:
    """Where each pool file a manifest lists is (the others are in the checkpoint itself)."""
    pooled = [f.path for f in files if f.pool]
    if not pooled:
        return {}
    pool = pool_directory(storage, checkpoint)
    return {name: storage.join(pool, name) for name in pooled}


def missing(storage: Storage, checkpoint: str, file: str) -> CorruptCheckpointError:
    """The error for a pool file that is not there: the whole pool missing (a checkpoint copied away from
    its run) says how to copy one so that it stands alone."""
    pool = pool_directory(storage, checkpoint)
    if storage.stat(pool) is None:
        return CorruptCheckpointError(
            f"{checkpoint} is an incremental checkpoint: its data file {file} is in its run's shared pool "
            f"{pool}, which does not exist (was the checkpoint copied or moved without it?). Load it where it "
            "was saved, or copy it so that it stands alone with `trainstate consolidate SRC DST` (or "
            "trainstate.consolidate / trainstate.export) run on the original"
        )
    return CorruptCheckpointError(
        f"data file {file} of the incremental checkpoint {checkpoint} is missing from the shared pool {pool}: "
        "deleted by hand, or by a tool that does not know the pool. Restore another checkpoint"
    )
