"""CheckpointManager: when to save, what to keep, and resuming from the newest good checkpoint.

The manager is thin: policies decide (policies.py), the catalog lists and deletes (catalog.py), the
synchronous core writes (save.write_checkpoint), and async save is that same core run on one background
thread after the state was copied into a reused host buffer (staging.py). Retention runs only after a
new checkpoint has committed, so nothing is deleted before its replacement exists.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from .. import tree
from ..reader import Checkpoint
from ..restore import RESERVED_RNG_KEY, restore
from ..rng import RNGState
from ..storage import LocalStorage, Storage, resolve
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ..save import DEFAULT_THREADS, Snapshot, encode_state, write_checkpoint
from . import naming
from .catalog import META_KEY, Catalog, DirectoryLock, ensure_directory, facts
from .policies import (
    AtSteps,
    CheckpointInfo,
    EverySeconds,
    EverySteps,
    KeepBest,
    KeepEveryMinutes,
    KeepEverySteps,
    KeepLast,
    RetentionPlan,
    RetentionPolicy,
    SavePolicy,
    finite,
    plan_retention,
    reason_to_save,
    saved_order,
)
from .preemption import DEFAULT_SIGNALS, PreemptionWatcher
from .staging import StagingBuffer

log = logging.getLogger("trainstate")
RNG_KEY = RESERVED_RNG_KEY


@dataclass(frozen=True)
class SaveRecord:
    """One save as the manager saw it. Times in seconds."""

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


@dataclass
class _InFlight:
    future: Future[SaveRecord]
    buffer: StagingBuffer
    step: int
    reason: str
    blocking: float


class CheckpointManager:
    """Saves a training run's state on a schedule, keeps what the retention policies say, and resumes.

    Args:
        directory: where the checkpoints go, one ``step_00001200`` directory each.
        every_steps: save when ``step % every_steps == 0``.
        every_seconds: save when this much wall time passed since the last save.
        at_steps: save at these steps.
        keep_last: keep the newest N.
        keep_every_steps: keep every checkpoint whose step is a multiple of N.
        keep_every_minutes: keep one checkpoint per N minutes of wall time.
        keep_best: ``(metric, "min" | "max", k)``: keep the k best by a metric passed to ``save``.
        async_save: copy the state to host memory and write it on a background thread.
        max_in_flight: async saves allowed at once; each holds one staging buffer the size of the state's
            arrays, so async saving needs ``max_in_flight`` × that much extra host memory.
        staging_budget_bytes: a cap on one staging buffer; a state larger than this is saved synchronously.
        capture_rng: when ``state`` is a dict without an :class:`RNGState`, save and restore one anyway
            (under the key ``"_rng"``), so resumed runs draw the same random numbers.
        save_on_preemption: on SIGTERM / SIGINT / SIGUSR1, save at the next ``save()`` call.
        fsync: flush to stable storage before each commit.
        threads: writer threads per save.
        metadata: plain values recorded in every checkpoint's manifest.
        storage: where the checkpoints live (default: chosen from ``directory``).
        read_only: list, restore and pin only: no lock, no sweep, no saves or deletions (for tools
            beside a running job).

    Example:
        >>> mgr = trainstate.CheckpointManager("runs/exp1", every_steps=500, keep_last=3, async_save=True)
        >>> start = mgr.restore_latest(state) or 0
        >>> for step in range(start, total_steps):
        ...     train_step()
        ...     mgr.save(step, state, metrics={"val_loss": v})
        ...     if mgr.preempted:
        ...         break
        >>> mgr.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        at_steps: list[int] | tuple[int, ...] | None = None,
        keep_last: int | None = None,
        keep_every_steps: int | None = None,
        keep_every_minutes: float | None = None,
        keep_best: tuple[str, str, int] | None = None,
        async_save: bool = False,
        max_in_flight: int = 1,
        staging_budget_bytes: int | None = None,
        capture_rng: bool = True,
        save_on_preemption: bool = True,
        preemption_signals: tuple[str, ...] = DEFAULT_SIGNALS,
        fsync: bool = True,
        threads: int = DEFAULT_THREADS,
        metadata: dict[str, Any] | None = None,
        save_policies: list[SavePolicy] | None = None,
        retention_policies: list[RetentionPolicy] | None = None,
        storage: Storage | None = None,
        read_only: bool = False,
    ) -> None:
        for name, value in (("every_steps", every_steps), ("keep_last", keep_last),
                            ("keep_every_steps", keep_every_steps), ("max_in_flight", max_in_flight)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.storage, self.directory = resolve(directory, storage)
        self.read_only = read_only
        self.catalog = Catalog(self.storage, self.directory)
        self._lock = None
        self.swept: builtins.list[str] = []
        if not read_only:
            ensure_directory(self.storage, self.directory)
            if isinstance(self.storage, LocalStorage):
                self._lock = DirectoryLock(Path(self.directory))
            self.swept = self.catalog.sweep()
        self.save_policies: list[SavePolicy] = list(save_policies or [])
        if every_steps:
            self.save_policies.append(EverySteps(every_steps))
        if every_seconds:
            self.save_policies.append(EverySeconds(every_seconds))
        if at_steps:
            self.save_policies.append(AtSteps(frozenset(at_steps)))
        self.retention: list[RetentionPolicy] = list(retention_policies or [])
        if keep_last:
            self.retention.append(KeepLast(keep_last))
        if keep_every_steps:
            self.retention.append(KeepEverySteps(keep_every_steps))
        if keep_every_minutes:
            self.retention.append(KeepEveryMinutes(keep_every_minutes))
        if keep_best:
            self.retention.append(KeepBest(*keep_best))
        self.async_save = async_save
        self.staging_budget_bytes = staging_budget_bytes
        self.capture_rng = capture_rng
        self._rng = RNGState()
        self.max_in_flight = max_in_flight
        self.fsync = fsync
        self.threads = threads
        self.metadata = dict(metadata or {})
        self._preemption = PreemptionWatcher(preemption_signals) if save_on_preemption and not read_only else None
        self._preemption_saved = False
        self._last_save_time = time.time()
        self._last_step: int | None = None
        self._history: list[SaveRecord] = []
        self._buffers = [StagingBuffer() for _ in range(max_in_flight)] if async_save else []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainstate-async") if async_save else None
        self._in_flight: list[_InFlight] = []
        self._error: BaseException | None = None
        self._closed = False
        self.last_retention: RetentionPlan | None = None

    # -- queries (manifests only) -----------------------------------------------------------------

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        return self.catalog.list()

    def latest(self) -> CheckpointInfo | None:
        """The most recently committed checkpoint (after a rollback: the new timeline's, not a higher step)."""
        items = self.list()
        return max(items, key=saved_order) if items else None

    def best(self, metric: str | None = None, mode: str | None = None) -> CheckpointInfo | None:
        """The best checkpoint by ``metric`` (default: the keep_best metric)."""
        policy = next((p for p in self.retention if isinstance(p, KeepBest)), None)
        metric = metric or (policy.metric if policy else None)
        mode = mode or (policy.mode if policy else "min")
        if metric is None:
            raise ValueError("best() needs a metric (or keep_best set on the manager)")
        scored = [c for c in self.list() if finite(c.metrics.get(metric))]
        if not scored:
            return None
        pick = min if mode == "min" else max
        return pick(scored, key=lambda c: c.metrics[metric])

    def path_for(self, step: int) -> str:
        return self.catalog.path(naming.name_for(step))

    def history(self) -> builtins.list[SaveRecord]:
        """Every save this manager made, with its timings (background ones once they finished)."""
        self._collect(block=False)
        return list(self._history)

    @property
    def preempted(self) -> bool:
        """True once a preemption signal arrived and its checkpoint was saved: time to exit."""
        return self._preemption_saved

    # -- restore ------------------------------------------------------------------------------------

    def restore_latest(self, state: Any, **load_kwargs: Any) -> int | None:
        """Restore the newest loadable checkpoint into ``state``; returns the step to continue from.

        That is the saved step + 1 (``save(step)`` records that ``step`` is done), or None when there is
        nothing to resume. "Newest" is the most recently committed. A checkpoint that turns out damaged
        (or was deleted meanwhile) is skipped with a warning for the one before it.
        """
        for info in sorted(self.list(), key=saved_order, reverse=True):
            try:
                self._restore_into(self.catalog.path(info.name), state, **load_kwargs)
            except (CorruptCheckpointError, CheckpointNotFoundError, IncompleteCheckpointError) as e:
                log.warning("checkpoint %s cannot be restored (%s); trying the one before it", info.name, e)
                continue
            log.info("resumed from %s", info.name)
            self._last_step = info.step
            self.prepare(state)  # now that optimizer moments exist, the buffer gets its full size
            return info.step + 1
        self.prepare(state)
        return None

    def prepare(self, state: Any) -> None:
        """Get async saving ready for ``state``: allocate and touch its staging buffer on a helper thread.

        Called by :meth:`restore_latest`; call it yourself if you do not restore. Without it the first
        async save pays for fresh memory while the loop waits.
        """
        if not self.async_save or self.read_only or self._buffers[0].capacity:
            return
        snapshot = encode_state(self._with_rng(state))  # cheap: no array is copied
        threading.Thread(target=self._buffers[0].reserve, args=(snapshot,), name="trainstate-reserve",
                         daemon=True).start()

    def restore(self, step: int, state: Any, **load_kwargs: Any) -> Any:
        """Restore the checkpoint of ``step`` into ``state`` (see :func:`trainstate.load`)."""
        return self._restore_into(self.path_for(step), state, **load_kwargs)

    def _restore_into(self, path: str, state: Any, **load_kwargs: Any) -> Any:
        with Checkpoint(path, self.storage) as ck:
            top = ck.manifest.tree
            saved_rng = isinstance(top, dict) and top.get("t") == "dict" and any(
                k == RNG_KEY for k, _ in tree.dict_items(top))
            target = self._with_rng(state) if saved_rng else state
            restore(ck, target, **load_kwargs)
        if target is not state:
            state.update((k, v) for k, v in target.items() if k != RNG_KEY)
        return state

    def _with_rng(self, state: Any) -> Any:
        """The state plus the manager's own RNGState, unless the user's state already has one."""
        if not self.capture_rng or not isinstance(state, dict) or any(isinstance(v, RNGState) for v in state.values()):
            return state
        return {**state, RNG_KEY: self._rng}

    # -- save ---------------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, metrics: dict[str, float] | None = None, epoch: int | None = None,
             force: bool = False, metadata: dict[str, Any] | None = None) -> bool:
        """Save ``state`` as step ``step`` if a policy says so (or ``force``); returns whether it did.

        Raises the error of a failed background save, if one failed since the last call.
        """
        self._check_open()
        self._raise_pending()
        now = time.time()
        preempting = self._preemption is not None and self._preemption.requested and not self._preemption_saved
        if preempting:
            reason: str | None = f"preemption ({self._preemption.signal_name})"  # type: ignore[union-attr]
        elif force:
            reason = "forced"
        else:
            reason = reason_to_save(self.save_policies, step, now, self._last_save_time)
        if reason is None or (step == self._last_step and not preempting and not force):
            return False
        if self.catalog.is_pinned(naming.name_for(step)):
            raise CheckpointExistsError(
                f"step {step} is pinned in {self.directory}; unpin it (mgr.unpin({step})) to save over it")
        self._save(step, state, reason, metrics, epoch, metadata, background=self.async_save and not preempting)
        if preempting:
            self._preemption_saved = True
        return True

    def _save(self, step: int, state: Any, reason: str, metrics: dict[str, float] | None, epoch: int | None,
              metadata: dict[str, Any] | None, background: bool) -> None:
        start = time.perf_counter()
        if background:
            buffer = self._free_buffer()  # waits for an in-flight save if all buffers are busy
        else:
            self._collect(block=True)  # one writer at a time: retention never races itself
        self._raise_pending()  # a save we just waited for may have failed
        meta = {**self.metadata, **(metadata or {}), META_KEY: facts(step, epoch, metrics, reason, time.time())}
        snapshot = encode_state(self._with_rng(state), meta)
        self._last_step, self._last_save_time = step, time.time()
        if background and self.staging_budget_bytes is not None and snapshot.nbytes > self.staging_budget_bytes:
            log.warning("step %d: state is %d bytes, over the staging budget of %d; saving synchronously",
                        step, snapshot.nbytes, self.staging_budget_bytes)
            background = False
            self._collect(block=True)
            self._raise_pending()
        if not background:
            record = self._write(step, reason, snapshot, background=False, blocking_start=start)
            self._history.append(record)
            return
        staged = buffer.stage(snapshot, threads=self.threads)
        blocking = time.perf_counter() - start
        assert self._pool is not None
        buffer.in_use.set()
        future = self._pool.submit(self._write, step, reason, staged, True, None, blocking)
        self._in_flight.append(_InFlight(future, buffer, step, reason, blocking))
        log.debug("step %d: async save started, blocked %.3fs", step, blocking)

    def _write(self, step: int, reason: str, snapshot: Snapshot, background: bool,
               blocking_start: float | None, blocking: float = 0.0) -> SaveRecord:
        result = write_checkpoint(self.path_for(step), snapshot, storage=self.storage, overwrite=True,
                                  fsync=self.fsync, threads=self.threads)
        deleted = self._apply_retention()
        if blocking_start is not None:
            blocking = time.perf_counter() - blocking_start
        log.info("saved step %d (%s): %.1f MB, blocked %.3fs, wrote %.3fs, committed %.3fs%s", step, reason,
                 result.nbytes / 1e6, blocking, result.write_seconds, result.commit_seconds,
                 f", deleted {list(deleted)}" if deleted else "")
        return SaveRecord(step, reason, result.path, background, blocking, result.write_seconds,
                          result.commit_seconds, result.nbytes, deleted)

    def prune(self, *, dry_run: bool = False) -> RetentionPlan:
        """Apply the retention policies now (without saving); returns what was kept and deleted, and why.

        A dry run only plans, and works on a read-only manager too.
        """
        if dry_run:
            return plan_retention(self.list(), self.retention)
        self._check_open()
        self._collect(block=True)
        self._apply_retention()
        assert self.last_retention is not None
        return self.last_retention

    def _apply_retention(self) -> tuple[str, ...]:
        plan = plan_retention(self.list(), self.retention)
        self.last_retention = plan
        for name in plan.delete:
            self.catalog.delete(name)
        return tuple(plan.delete)

    def _free_buffer(self) -> StagingBuffer:
        while len(self._in_flight) >= self.max_in_flight:
            self._collect(block=True, first_only=True)
        busy = {id(f.buffer) for f in self._in_flight}
        return next(b for b in self._buffers if id(b) not in busy)

    def _collect(self, block: bool, first_only: bool = False) -> None:
        """Move finished background saves into the history; remember the first error."""
        still = []
        for i, job in enumerate(self._in_flight):
            if block and (not first_only or i == 0):
                try:
                    job.future.result()
                except BaseException:
                    pass
            if job.future.done():
                job.buffer.in_use.clear()
                error = job.future.exception()
                if error is not None:
                    self._error = self._error or error
                    self._history.append(SaveRecord(job.step, job.reason, str(self.path_for(job.step)), True,
                                                    job.blocking, error=repr(error)))
                else:
                    self._history.append(job.future.result())
            else:
                still.append(job)
        self._in_flight = still

    def _raise_pending(self) -> None:
        self._collect(block=False)
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"a background save failed: {error!r}") from error

    # -- lifecycle ----------------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every in-flight save has committed; raise if one failed."""
        self._collect(block=True)
        self._raise_pending()

    def pin(self, step: int, reason: str = "") -> None:
        """Keep this checkpoint whatever the retention policies say.

        Allowed on a read-only manager: a pin is one small file beside the checkpoint, safe to add
        while another process trains and prunes in the same directory.
        """
        self.catalog.pin(naming.name_for(step), reason)

    def unpin(self, step: int) -> None:
        self.catalog.unpin(naming.name_for(step))

    def close(self, step: int | None = None, state: Any = None, *, metrics: dict[str, float] | None = None) -> None:
        """Wait for in-flight saves; with ``step`` and ``state``, save a final checkpoint first."""
        if self._closed:
            return
        try:
            if state is not None and step is not None and step != self._last_step:
                self._collect(block=True)
                self._save(step, state, "at close", metrics, None, None, background=False)
            self.wait()
        finally:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._preemption is not None:
                self._preemption.close()
            if self._lock is not None:
                self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")
        if self.read_only:
            raise CheckpointError("this CheckpointManager is read-only")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
