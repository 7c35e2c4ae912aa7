"""The history file of a run directory: ``_history/<seq>-<session>.json``, one small JSON record per save.

One file per save rather than one appended file: object stores cannot append (a PUT replaces a whole
object), and a local append killed half-way leaves a torn line that later appends build on. A record is a
new name, written once, after the save it describes committed or failed (its commit seconds are known only
then), by the thread that ran the save (a background thread for async saves). So a kill can lose the record
of the save in flight, or leave that one record torn (skipped with a warning when read), and nothing else:
no checkpoint and no earlier record is ever touched. Records are not fsynced; the checkpoints are.

Restarts add records under a new session id (random, one per manager); nothing is rewritten or deleted, not
even by retention, so the history still shows a deleted checkpoint's step, timings and metrics. Under a
process group only rank 0 writes. Readers order records by ``seq`` (the commit sequence number the save
took, docs/format.md §6a), never by a clock, which may step back.

Example:
    ``runs/exp1/_history/0000000003-5f0c1e2a9b7d.json``::

        {"trainstate_history": 1, "session": "5f0c1e2a9b7d", "seq": 3, "step": 200, "reason": "every 100 steps",
         "time": 1767225600.25, "epoch": null, "metrics": {"loss": 0.42, "grad_norm": "nan"},
         "background": true, "blocking_seconds": 0.004, "write_seconds": 0.21, "commit_seconds": 0.002,
         "nbytes": 1048576, "deleted": ["step_00000000"], "error": null}
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from trainstate._format.run_dir import HISTORY_DIR
from trainstate._storage import Storage
from trainstate._storage.local import ensure_directory
from trainstate.errors import StorageError

log = logging.getLogger("trainstate")


@dataclass(frozen=True)
class SaveRecord:
    """One save as the manager saw it. Times in seconds. ``CheckpointManager.history()`` returns these.

    Attributes:
        step: the step saved.
        reason: why it was saved (``"every 500 steps"``, ``"forced"``, ``"preemption (SIGTERM)"``, ...).
        path: the checkpoint's path.
        background: whether it was written on the background thread (async).
        blocking_seconds: how long ``save()`` held up the training loop.
        write_seconds: writing the data files and the manifest (in the background when async).
        commit_seconds: the commit: rename and fsync of the directory.
        nbytes: bytes written.
        deleted: the checkpoints retention deleted after this one committed.
        error: why the save failed, or None.

    Example:
        >>> record = mgr.history()[-1]
        >>> record.step, record.reason, record.blocking_seconds < record.write_seconds
        (1500, 'every 500 steps', True)
    """

    step: int
    reason: str
    path: str
    background: bool
    blocking_seconds: float  # how long save() held up the training loop
    write_seconds: float = 0.0  # writing data files and manifest (in the background when async)
    commit_seconds: float = 0.0  # rename + fsync of the directory
    nbytes: int = 0
    deleted: tuple[str, ...] = ()
    error: str | None = None


VERSION = 1  # "trainstate_history" in every record; a reader takes the fields it knows from any version
MAX_RECORD_BYTES = 1 << 20  # a record is a few hundred bytes; anything this large is not one of ours


@dataclass(frozen=True)
class Record:
    """One save as its record says (times in seconds; ``time`` is the wall clock when the save began)."""

    name: str  # the record's file name
    session: str
    seq: int
    step: int
    reason: str
    time: float | None
    epoch: int | None
    metrics: dict[str, float]
    background: bool
    blocking_seconds: float
    write_seconds: float
    commit_seconds: float
    nbytes: int
    deleted: tuple[str, ...]
    error: str | None


def _number(value: float) -> float | str:
    """A float as strict JSON: NaN and the infinities as the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    return value if math.isfinite(value) else str(value)


def encode(facts: Mapping[str, Any], record: SaveRecord, session: str) -> bytes:
    """The record of one save: ``facts`` are the ones its manifest carries (step, seq, time, metrics...)."""
    metrics = facts.get("metrics") or {}
    doc = {
        "trainstate_history": VERSION,
        "session": session,
        "seq": int(facts["seq"]),
        "step": record.step,
        "reason": record.reason,
        "time": _number(float(facts["time"])),
        "epoch": facts.get("epoch"),
        "metrics": {str(k): _number(float(v)) for k, v in metrics.items()},
        "background": record.background,
        "blocking_seconds": record.blocking_seconds,
        "write_seconds": record.write_seconds,
        "commit_seconds": record.commit_seconds,
        "nbytes": record.nbytes,
        "deleted": list(record.deleted),
        "error": record.error,
    }
    return json.dumps(doc, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()


def _float(value: Any, what: str) -> float:
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is not a number: {value!r:.40}")
    return float(value)


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} is not a non-negative integer: {value!r:.40}")
    return value


def decode(raw: bytes, name: str) -> Record:
    """A record from its file's bytes; ValueError if they are not one (torn by a kill, or not ours)."""
    try:
        doc = json.loads(raw)
    except RecursionError:  # nested deeper than the parser goes: no record either
        raise ValueError("not a trainstate history record (nested too deep)") from None
    if not isinstance(doc, dict) or type(doc.get("trainstate_history")) is not int:
        raise ValueError("not a trainstate history record")
    metrics = doc.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise ValueError("metrics is not an object")
    deleted = doc.get("deleted") or []
    epoch, error, reason, session = doc.get("epoch"), doc.get("error"), doc.get("reason", ""), doc.get("session", "")
    if not isinstance(deleted, list) or not all(isinstance(d, str) for d in deleted):
        raise ValueError("deleted is not a list of names")
    return Record(
        name=name,
        session=session if isinstance(session, str) else "",
        seq=_int(doc.get("seq"), "seq"),
        step=_int(doc.get("step"), "step"),
        reason=reason if isinstance(reason, str) else "",
        time=_float(doc["time"], "time") if doc.get("time") is not None else None,
        epoch=epoch if type(epoch) is int else None,
        metrics={str(k): _float(v, f"metrics[{k!r}]") for k, v in metrics.items()},
        background=doc.get("background") is True,
        blocking_seconds=_float(doc.get("blocking_seconds", 0.0), "blocking_seconds"),
        write_seconds=_float(doc.get("write_seconds", 0.0), "write_seconds"),
        commit_seconds=_float(doc.get("commit_seconds", 0.0), "commit_seconds"),
        nbytes=_int(doc.get("nbytes", 0), "nbytes"),
        deleted=tuple(deleted),
        error=error if isinstance(error, str) else None,
    )


class HistoryLog:
    """Writes one manager's records into its run directory's ``_history/``.

    Best effort: the save a record describes has committed (or failed) already, so a record that cannot be
    written (a full disk, a store that went away) is logged once and never raised.
    """

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage = storage
        self.directory = storage.join(root, HISTORY_DIR)
        self.session = uuid.uuid4().hex[:12]  # tells this manager's saves from those of earlier processes
        self._ready = False
        self._warned = False

    def append(self, facts: Mapping[str, Any], record: SaveRecord) -> None:
        path = self.storage.join(self.directory, f"{int(facts['seq']):010d}-{self.session}.json")
        try:
            data = encode(facts, record, self.session)
            if not self._ready and self.storage.capabilities.makedirs:
                ensure_directory(self.directory, "the history directory")
            self._ready = True
            self.storage.write(path, [memoryview(data)], fsync=False)
        except Exception as e:  # noqa: BLE001 - the save is done either way: never fail it for its record
            with contextlib.suppress(Exception):
                self.storage.delete(path)  # a record cut short (a full disk) would only be skipped later
            if not self._warned:
                log.warning(
                    "could not write the history record of step %d (the checkpoint is unaffected): %s", record.step, e
                )
                self._warned = True


def read(storage: Storage, root: str) -> tuple[list[Record], list[str]]:
    """Every record in ``root/_history``, in no particular order, and the names of files there that are not
    readable records (torn by a kill, or put there by hand)."""
    directory = storage.join(root, HISTORY_DIR)
    names = [n for n in storage.list(directory) if n.endswith(".json") and not n.startswith(".")]

    def one(name: str) -> Record | None:
        path = storage.join(directory, name)
        try:
            info = storage.stat(path)
            if info is None or info.is_dir or info.size > MAX_RECORD_BYTES:
                return None
            raw = bytearray(info.size)
            got = storage.read_into(path, 0, memoryview(raw))
            return decode(bytes(raw[:got]), name)
        except (StorageError, ValueError, KeyError, TypeError):
            return None

    workers = min(16, storage.capabilities.read_parallelism, len(names))
    if workers > 1:  # object stores: a request per record, so many at once
        with ThreadPoolExecutor(workers, thread_name_prefix="trainstate-history") as pool:
            found = list(pool.map(one, names))
    else:
        found = [one(n) for n in names]
    records = [r for r in found if r is not None]
    return records, [n for n, r in zip(names, found) if r is None]
