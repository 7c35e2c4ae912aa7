"""The newest checkpoint that restores: one rule for ``CheckpointManager.restore_latest`` and the Hugging Face
callback's ``resume_point``, which used to keep a copy each (and their lists of fatal errors drifted apart).

:func:`newest_restorable` tries a run's checkpoints newest first (the most recently committed) and returns the
first one its caller's ``attempt`` could use. It owns the one decision both need: which failure moves on to the
checkpoint before it, and which one is raised at once (:data:`FATAL`, see :func:`newest_restorable`); and it
lists again when a running job's retention deleted what was being read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from trainstate._manager.catalog import Catalog
from trainstate._manager.policies import CheckpointInfo, saved_order
from trainstate._manager.ranks import ManagerRanks, SingleProcess
from trainstate.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DistributedError,
    EncryptionKeyError,
    FormatVersionError,
    InvalidArgumentError,
    StateMismatchError,
)

log = logging.getLogger("trainstate")
RELISTS = 20  # lists again at most this often when checkpoints vanish under it (a running job's retention)

# Not damage: the checkpoint before would fail the same way, or trying it would hide the mistake.
FATAL: tuple[type[CheckpointError], ...] = (
    StateMismatchError,  # the state given does not fit: a user error; an older checkpoint would "fit" worse
    InvalidArgumentError,  # a wrong argument (a pattern that matches nothing, a state that cannot change in place)
    EncryptionKeyError,  # no key, a wrong key, or a key for a plain run: every checkpoint of the run is the same
    FormatVersionError,  # written by a newer trainstate: upgrade, never resume from older and save over it
    DistributedError,  # another rank failed or fell silent: no fault of this checkpoint
)

T = TypeVar("T")


@dataclass(frozen=True)
class Found(Generic[T]):
    """The checkpoint chosen: its name and step, what ``attempt`` returned, and the newer ones skipped."""

    name: str
    step: int
    value: T
    skipped: list[str]


def first_line(error: BaseException) -> str:
    """What failed, in one line: an error's first line (its message says what, the rest what to do)."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def newest_restorable(
    listing: Callable[[], list[CheckpointInfo]],
    catalog: Catalog,
    attempt: Callable[[str], T],
    *,
    ranks: ManagerRanks | SingleProcess | None = None,
    doing: str = "restored",
    advice: Callable[[list[tuple[str, str]]], str] = lambda failures: "",
) -> Found[T] | None:
    """The newest checkpoint ``attempt(name)`` succeeds on, or None when the run has no checkpoint at all.

    Newest first by commit order. ``attempt`` raises a :class:`~trainstate.errors.CheckpointError` when it
    cannot use a checkpoint; what happens next depends on the error:

    * fatal (:data:`FATAL`), raised at once: :class:`StateMismatchError` (the state given does not fit: a user
      error, and an older checkpoint would hide it), :class:`InvalidArgumentError` (a wrong argument),
      :class:`EncryptionKeyError` (the key does not fit; every checkpoint of a run has the same key),
      :class:`FormatVersionError` (a newer trainstate wrote it: resuming from an older one would save over
      it), :class:`DistributedError` (another rank failed or fell silent: not this checkpoint's fault);
    * any other CheckpointError (corrupt, incomplete, a data file missing, an unreadable manifest, a storage
      error reading it): the checkpoint is damaged; a warning, and the one before it is tried;
    * a checkpoint that is no longer committed when its attempt failed was deleted while it was read (a
      running job's retention, beside a read-only reader): not damage; the directory is listed again
      (at most :data:`RELISTS` times).

    Any other exception (a bug, KeyboardInterrupt) goes through. Under a process group (``ranks``) every rank
    works from rank 0's listing and never lists again on its own; ``attempt`` exchanges the ranks' outcomes.

    Raises:
        CorruptCheckpointError: there are checkpoints, but none could be used (the message lists each one and
            why, then ``advice(failures)``).
    """
    ranks = ranks or SingleProcess()
    failures: list[tuple[str, str]] = []
    for _ in range(RELISTS):
        candidates = [(info.name, info.step) for info in sorted(listing(), key=saved_order, reverse=True)]
        failures = [(name, f"unreadable manifest: {why}") for name, why in catalog.damaged.items()]
        vanished = ranks.relists and bool(catalog.vanished)
        candidates, failures = ranks.from_leader((candidates, failures), "restore_latest (listing)")
        for name, step in candidates:
            try:
                value = attempt(name)
            except FATAL:
                raise
            except CheckpointError as e:
                if ranks.relists and not catalog.committed(name):
                    log.info("checkpoint %s was deleted while it was being %s; trying another", name, doing)
                    vanished = True
                    continue
                why = first_line(e)
                log.warning("checkpoint %s cannot be %s (%s); trying the one before it", name, doing, why)
                failures.append((name, why))
                continue
            return Found(name, step, value, [n for n, _ in failures])
        if ranks.relists and any(not catalog.committed(name) for name, _ in failures):
            vanished = True  # what looked damaged was being deleted (a remote store's delete is not atomic)
        if not vanished:
            break
    if failures:
        lines = "\n".join(f"  {name}: {why}" for name, why in failures)
        raise CorruptCheckpointError(
            f"none of the {len(failures)} checkpoint(s) in {catalog.root} could be {doing}:\n{lines}{advice(failures)}"
        )
    return None
