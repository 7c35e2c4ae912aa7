"""The part of a manager's save that may run in the background: write, commit, apply retention.

It holds the catalog and the manager's settings, never the manager itself, so a manager dropped while a
save is in flight can be collected at once (its finalizer then waits for the save, see background.py).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import time
from typing import Any

from trainstate._format import run_dir as naming
from trainstate._format.manifest import Manifest
from trainstate._history.log import HistoryLog, SaveRecord
from trainstate._incremental.save import IncrementalSaver
from trainstate._manager.catalog import Catalog
from trainstate._manager.policies import (
    CheckpointInfo,
    RetentionPlan,
    plan_retention,
    saved_order,
)
from trainstate._manager.ranks import ManagerRanks
from trainstate._manager.settings import Settings
from trainstate._restore.checkpoint import _read_manifest
from trainstate._save import SaveResult, Snapshot, write_checkpoint
from trainstate.errors import CheckpointError, FormatVersionError, StorageError

log = logging.getLogger("trainstate")


class Committer:
    """Writes a snapshot, commits it and applies retention: the part of a save that may run in the
    background. It holds the catalog and the settings, never the manager."""

    def __init__(self, catalog: Catalog, config: Settings, ranks: ManagerRanks | None = None) -> None:
        self.catalog = catalog
        self.config = config
        self.ranks = ranks  # under a process group: every rank writes its share, rank 0 applies retention
        self.last_retention: RetentionPlan | None = None
        # incremental runs: unchanged tensors refer to the run's shared pool (trainstate._incremental)
        self.incremental = (
            IncrementalSaver(config.storage, config.directory, self._newest_manifest)
            if config.options.incremental
            else None
        )
        self.restored_from: str | None = None  # what restore_latest restored, if it ran
        self.unrestorable: set[str] = set()  # checkpoints restore_latest found damaged
        # each save's record in the run's _history/, for `trainstate history` (rank 0 writes, see _history/log.py)
        self.history = HistoryLog(config.storage, config.directory) if ranks is None or ranks.leader else None

    def list(self) -> builtins.list[CheckpointInfo]:
        items = self.catalog.list()
        if self.catalog.newer and not self.config.options.read_only:
            name, why = next(iter(self.catalog.newer.items()))
            raise FormatVersionError(
                f"{self.catalog.path(name)} was written by a newer trainstate ({why}). Resuming from an older "
                "checkpoint would save over it: upgrade trainstate to continue this run."
            )
        return items

    def write(
        self,
        step: int,
        reason: str,
        snapshot: Snapshot,
        background: bool,
        blocking_start: float | None,
        blocking: float = 0.0,
        facts: dict[str, Any] | None = None,
    ) -> SaveRecord:
        """Write, commit and apply retention; then, given the ``facts`` the manifest carries, append the
        save's record to the run's history: its timings, or why it failed (the failure is raised)."""
        try:
            record = self._write(step, reason, snapshot, background, blocking_start, blocking)
        except BaseException as e:
            if facts is not None and self.history is not None:
                took = time.perf_counter() - blocking_start if blocking_start is not None else blocking
                path = self.catalog.path(naming.name_for(step))
                self.history.append(facts, SaveRecord(step, reason, path, background, took, error=repr(e)))
            raise
        if facts is not None and self.history is not None:
            self.history.append(facts, record)
        return record

    def _write(
        self,
        step: int,
        reason: str,
        snapshot: Snapshot,
        background: bool,
        blocking_start: float | None,
        blocking: float,
    ) -> SaveRecord:
        c = self.config
        path = self.catalog.path(naming.name_for(step))
        if self.ranks is None:
            if self.incremental is not None:
                try:
                    result = self.incremental.save(path, snapshot, c.options)
                except BaseException:
                    with contextlib.suppress(Exception):  # the save's own error is the one to report
                        self._collect_pool()  # what the failed save wrote, unless a manifest names it after all
                    raise
            else:
                result = write_checkpoint(path, snapshot, storage=c.storage, options=c.options)
            deleted = self.apply_retention()
        else:
            result, deleted = self._write_collective(step, path, snapshot, None)
        if blocking_start is not None:
            blocking = time.perf_counter() - blocking_start
        log.info(
            "saved step %d (%s): %.1f MB, blocked %.3fs, wrote %.3fs, committed %.3fs%s",
            step,
            reason,
            result.nbytes / 1e6,
            blocking,
            result.write_seconds,
            result.commit_seconds,
            f", deleted {list(deleted)}" if deleted else "",
        )
        return SaveRecord(
            step,
            reason,
            result.path,
            background,
            blocking,
            result.write_seconds,
            result.commit_seconds,
            result.nbytes,
            deleted,
        )

    def _write_collective(
        self, step: int, path: str, snapshot: Snapshot | None, error: Exception | None
    ) -> tuple[SaveResult, tuple[str, ...]]:
        """This rank's share of the group's checkpoint, then retention on rank 0; every rank raises if
        any part failed anywhere."""
        from trainstate._distributed.save import write_collective

        assert self.ranks is not None
        c = self.config
        result = write_collective(
            self.ranks.saves,
            path,
            snapshot,
            error,
            storage=c.storage,
            options=c.options,
            start=time.perf_counter(),
            share_writer=self.incremental,  # incremental runs: each rank writes its share into the pool
        )
        deleted: tuple[str, ...] = ()
        failure: Exception | None = None
        if self.ranks.leader:
            try:
                deleted = self.apply_retention()
            except Exception as e:  # noqa: BLE001 - raised on every rank just below
                failure = e
        self.ranks.saves.agree(failure, f"retention after the save of step {step}")
        return result, deleted

    def refuse(self, step: int, error: Exception) -> None:
        """Take part in the group's save of ``step`` with this rank's failure (its state did not encode), so
        the other ranks raise too instead of waiting for its share; raises ``error``."""
        self._write_collective(step, self.catalog.path(naming.name_for(step)), None, error)
        raise error  # pragma: no cover - write_collective raised it already

    def apply_retention(self) -> tuple[str, ...]:
        """Delete what the retention policies let go -- damaged checkpoints too, as they fall out (see
        :func:`plan_retention`): kept forever, one would keep its pool files, and while its manifest cannot
        be read, the pool's collection cannot tell what it names."""
        items = self.list()
        damaged = {c.name: c for c in self.catalog.damaged_list()}
        plan = plan_retention(items, self.config.retention, list(damaged.values()))
        for name in plan.delete:
            if name in damaged:
                log.warning(
                    "deleting the damaged checkpoint %s (%s): the retention policies let it go",
                    self.catalog.path(name),
                    self.catalog.damaged.get(name, "its manifest cannot be read"),
                )
        deleted = tuple(name for name in plan.delete if self.catalog.delete(name))  # a pin found late wins
        self.last_retention = RetentionPlan(plan.keep, list(deleted)) if deleted != tuple(plan.delete) else plan
        self._collect_pool()
        return deleted

    def _collect_pool(self) -> None:
        """Delete the pool files no checkpoint uses any more (incremental runs). Best effort: what is left
        is only garbage, which a later pass takes, so a failure here never fails the save that ran it."""
        saver = self.incremental
        try:
            removed = self.catalog.collect_pool(
                locked=self.config.storage.capabilities.locking,
                keep=saver.protected() if saver is not None else (),
                mine=saver.written if saver is not None else (),
            )
        except StorageError as e:
            log.warning("could not collect the shared pool of %s (a later pass will): %s", self.config.directory, e)
            return
        if saver is not None:
            saver.written.difference_update(removed)

    def resumed(self, restored: str, unrestorable: builtins.list[str]) -> None:
        """``restore_latest`` restored ``restored`` after finding ``unrestorable`` damaged: the next
        incremental save shares bytes with what was restored, never with a checkpoint that failed (its
        damaged bytes would pass for unchanged ones once the replayed run reproduces them)."""
        self.restored_from = restored
        self.unrestorable.update(unrestorable)
        if self.incremental is not None:
            self.incremental.rebase()

    def _newest_manifest(self) -> Manifest | None:
        """The manifest an incremental save dedupes against when this process has not saved yet: the
        checkpoint ``restore_latest`` restored, else the run's newest readable one that did not fail to
        restore."""
        infos = sorted(self.list(), key=saved_order, reverse=True)
        if self.restored_from is not None:
            infos = [i for i in infos if i.name == self.restored_from]
        for info in infos:
            if info.name in self.unrestorable:
                continue
            try:
                return _read_manifest(self.config.storage, self.catalog.path(info.name), self.config.options.key)
            except CheckpointError as e:
                log.warning("not deduplicating against %s: %s", info.name, e)
        return None
