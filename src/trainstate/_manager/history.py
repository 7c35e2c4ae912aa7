""":func:`trainstate.history`: a run's saves, each joined with what became of its checkpoint.

Two sources, neither trusted for more than it knows: the records in ``_history/`` (log.py) know each save's
timings and metrics, including saves whose checkpoints retention deleted since; the manifests in the
directory (the manager's catalog) know which checkpoints exist now. A record is matched to the checkpoint of
its step when the manifest carries the record's ``seq``; a checkpoint with no record (written by an older
trainstate, or its process killed between the commit and the record) still gets an entry, without timings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainstate import _arguments as arguments
from trainstate import _keys
from trainstate._format import run_dir as naming
from trainstate._format.manifest import MANIFEST_NAME
from trainstate._format.run_dir import HISTORY_DIR
from trainstate._history.log import Record, read
from trainstate._manager.catalog import Catalog
from trainstate._manager.policies import CheckpointInfo
from trainstate._storage import Storage, resolve
from trainstate.errors import CheckpointNotFoundError, InvalidArgumentError

log = logging.getLogger("trainstate")


@dataclass(frozen=True)
class HistoryEntry:
    """One save of a run, and what became of its checkpoint. Times in seconds; None where not known.

    Attributes:
        step: the step saved.
        name: the checkpoint's directory name in the run directory (``step_00001200``).
        status: ``"kept"`` (its checkpoint is in the directory), ``"deleted"`` (by retention, ``trainstate
            prune`` or by hand), ``"replaced"`` (a later save of the same step, after a rollback, wrote over
            it), ``"failed"`` (the save raised: ``error`` says what; nothing was committed) or ``"damaged"``
            (committed, but its manifest no longer reads: ``note`` says why).
        time: Unix time when the save began (display only: a clock can step back; entries are in commit
            order, by ``seq``).
        seq: the commit sequence number the save took (docs/format.md §6a).
        reason: why it saved (``"every 100 steps"``, ``"forced"``, ``"preemption (SIGTERM)"``, ...).
        epoch: the ``epoch`` passed to ``save``.
        metrics: the ``metrics`` passed to ``save``, as floats.
        nbytes: bytes the save wrote (data files and manifest); for an incremental run only what changed.
        blocking_seconds: how long ``save()`` held up the training loop.
        write_seconds: writing the data files and the manifest (in the background for async saves).
        commit_seconds: the commit (renames and directory syncs).
        background: whether it was an async save.
        pinned: whether its checkpoint is pinned now.
        session: an id of the manager (process) that saved it: a restart starts a new one.
        error: why the save failed (``status == "failed"``).
        note: anything else worth a look: which save's retention deleted it, a new process, no timing record.

    Example:
        >>> h = trainstate.history("runs/exp1")
        >>> [(e.step, e.status, e.blocking_seconds) for e in h][-2:]
        [(900, 'kept', 0.0041), (1000, 'kept', 0.0039)]
        >>> pandas.DataFrame(h).plot(x="step", y="write_seconds")  # a list of dataclasses is a table
    """

    step: int
    name: str
    status: str
    time: float | None = None
    seq: int | None = None
    reason: str = ""
    epoch: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    nbytes: int | None = None
    blocking_seconds: float | None = None
    write_seconds: float | None = None
    commit_seconds: float | None = None
    background: bool | None = None
    pinned: bool = False
    session: str | None = None
    error: str | None = None
    note: str = ""


def history(
    directory: str | os.PathLike[str],
    *,
    storage: Storage | None = None,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> list[HistoryEntry]:
    """Every save a :class:`CheckpointManager` made in ``directory``, in commit order, with its timings,
    metrics and what became of its checkpoint (kept, deleted by retention, failed, ...).

    Reads the run's ``_history/`` records and its manifests, never a tensor; takes no lock, so it works
    beside a running job (a save in flight appears once it committed) and on object stores. Checkpoints
    from before the history existed are listed without timings. Unreadable records (a kill while one was
    written) are skipped with a warning on the ``trainstate`` logger.

    Args:
        directory: the run directory a CheckpointManager saved into (a path or URL).
        storage: the storage backend (default: chosen from ``directory``).
        key: an encrypted run's key (its manifests are authenticated with it), as for the manager.
        key_env: the name of an environment variable holding that key.

    Raises:
        CheckpointNotFoundError: nothing is at ``directory``.
        InvalidArgumentError: ``directory`` is one checkpoint, not a run directory.
        KeyRequiredError: the run is encrypted and no key was given.

    Example:
        >>> for e in trainstate.history("runs/exp1"):
        ...     print(e.step, e.status, e.blocking_seconds, e.metrics.get("loss"))
        0 deleted 0.0052 2.31
        100 kept 0.0041 0.87
    """
    backend, root = resolve(arguments.location(directory), storage)
    resolved_key = _keys.resolve(key, key_env)
    if backend.stat_followed(backend.join(root, MANIFEST_NAME)) is not None:
        raise InvalidArgumentError(
            f"{os.fspath(directory)} is a checkpoint, not a run directory: history lists the saves of a "
            "CheckpointManager's directory; pass the directory that holds it (its parent)"
        )
    names = backend.list(root)
    if not names and backend.stat_followed(root) is None:
        raise CheckpointNotFoundError(f"no such run directory: {os.fspath(directory)}")
    catalog = Catalog(backend, root, resolved_key)
    infos = catalog.list()
    records, unreadable = read(backend, root)
    if unreadable:
        log.warning(
            "skipped %d unreadable history record(s) in %s (torn by a kill, or not trainstate's): %s",
            len(unreadable),
            backend.join(root, HISTORY_DIR),
            ", ".join(unreadable[:5]) + (", ..." if len(unreadable) > 5 else ""),
        )
    entries = join(records, infos, dict(catalog.damaged))
    if not entries:
        others = [n for n in names if naming.step_of(n) is None and _is_checkpoint(backend, backend.join(root, n))]
        if others:
            log.warning("%s", unmanaged_message(os.fspath(directory), others))
    return entries


def _is_checkpoint(backend: Storage, path: str) -> bool:
    try:
        return backend.stat_followed(backend.join(path, MANIFEST_NAME)) is not None
    except Exception:  # noqa: BLE001 - a name that cannot be looked at is not a checkpoint to mention
        return False


def unmanaged_message(directory: str, names: list[str]) -> str:
    """Why a directory holding trainstate checkpoints has no history: no CheckpointManager saved there."""
    shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"no save history in {directory}: it holds {len(names)} trainstate checkpoint(s) ({shown}) that no "
        "CheckpointManager saved (Lightning's TrainstateCheckpointIO and trainstate.save record no history); "
        f"see each with `trainstate inspect {directory}/NAME`"
    )


def join(records: list[Record], infos: list[CheckpointInfo], damaged: Mapping[str, str]) -> list[HistoryEntry]:
    """Records and the directory's checkpoints as entries, in commit order (see the module docstring)."""
    records = sorted(records, key=lambda r: (r.seq, r.time if r.time is not None else 0.0, r.name))
    by_name = {i.name: i for i in infos}
    matched: set[str] = set()
    entries: list[HistoryEntry] = []
    sessions: list[str] = []
    for i, r in enumerate(records):
        name = naming.name_for(r.step)
        info = by_name.get(name)
        notes = []
        if r.session and sessions and r.session not in sessions:
            notes.append("new process")
        if r.session and r.session not in sessions:
            sessions.append(r.session)
        if r.error is not None:
            status = "failed"
        elif info is not None and (info.seq is None or info.seq == r.seq):
            status = "kept"
            matched.add(name)
        elif info is not None:
            status = "replaced"
        elif name in damaged:
            status = "damaged"
            notes.append(damaged[name])
        else:
            status = "deleted"
            by = next((later for later in records[i + 1 :] if name in later.deleted), None)
            if by is not None:
                notes.append(f"retention after step {by.step}")
        entries.append(
            HistoryEntry(
                step=r.step,
                name=name,
                status=status,
                time=r.time,
                seq=r.seq,
                reason=r.reason,
                epoch=r.epoch,
                metrics=dict(r.metrics),
                nbytes=r.nbytes if r.error is None else None,
                blocking_seconds=r.blocking_seconds,
                write_seconds=r.write_seconds if r.error is None else None,
                commit_seconds=r.commit_seconds if r.error is None else None,
                background=r.background,
                pinned=info.pinned if status == "kept" and info is not None else False,
                session=r.session or None,
                error=r.error,
                note="; ".join(notes),
            )
        )
    recorded_names = {naming.name_for(r.step) for r in records}
    for info in infos:
        if info.name in matched:
            continue
        entries.append(
            HistoryEntry(
                step=info.step,
                name=info.name,
                status="kept",
                time=info.created,
                seq=info.seq,
                epoch=info.epoch,
                metrics=dict(info.metrics),
                nbytes=info.nbytes - info.shared,  # what that save wrote (less its manifest)
                pinned=info.pinned,
                note="no timing record" if info.name not in recorded_names else "no timing record of this save",
            )
        )
    for name, why in damaged.items():
        step = naming.step_of(name)
        if step is not None and name not in recorded_names:
            entries.append(HistoryEntry(step=step, name=name, status="damaged", note=why))
    order = {id(e): n for n, e in enumerate(entries)}
    # commit order: by seq (a checkpoint without one, from trainstate 0.1, is older than any with one)
    entries.sort(key=lambda e: (e.seq is not None, e.seq if e.seq is not None else e.step, order[id(e)]))
    return entries
