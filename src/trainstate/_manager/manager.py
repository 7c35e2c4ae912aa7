"""CheckpointManager: when to save, what to keep, and resuming from the newest good checkpoint.

The manager is thin: its arguments are checked into fixed settings (settings.py), policies decide
(policies.py), the catalog lists and deletes (catalog.py), the committer writes, commits and applies retention
(committer.py), the writer runs those saves in order, in the background when asked, after the state was
copied into a reused host buffer (async_writer.py, staging.py), the RNG capture adds the process's RNG to
what is saved (rng_capture.py), and the restorer resumes (resume.py). Retention runs only after a new
checkpoint has committed, so nothing is deleted before its replacement exists.
"""

from __future__ import annotations

import builtins
import logging
import os
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

from trainstate import _arguments as arguments
from trainstate import _keys
from trainstate._cores import DEFAULT_THREADS
from trainstate._format import run_dir as naming
from trainstate._history.log import SaveRecord
from trainstate._manager.async_writer import AsyncWriter
from trainstate._manager.catalog import META_KEY, Catalog, facts
from trainstate._manager.committer import Committer
from trainstate._manager.copy_behind import CopyBehind
from trainstate._manager.keep_best import warn_missing_metrics
from trainstate._manager.local_tier import LocalEvery, LocalTier, Tier, claim, tier_peers
from trainstate._manager.lock import DirectoryLock
from trainstate._manager.policies import (
    CheckpointInfo,
    KeepBest,
    RetentionPlan,
    RetentionPolicy,
    SavePolicy,
    finite,
    plan_retention,
    reason_to_save,
    saved_order,
)
from trainstate._manager.preemption import DEFAULT_SIGNALS, PreemptionWatcher
from trainstate._manager.ranks import ManagerRanks, SingleProcess, manager_ranks
from trainstate._manager.resume import Restorer
from trainstate._manager.rng_capture import RNGCapture
from trainstate._manager.settings import Configured, settings
from trainstate._save import encode_state
from trainstate._save.background import raise_background
from trainstate._storage import Storage
from trainstate._storage.local import ensure_directory
from trainstate.errors import (
    CheckpointError,
    CheckpointExistsError,
    InvalidArgumentError,
)

log = logging.getLogger("trainstate")


class CheckpointManager(Configured):
    """Saves a training run's state on a schedule, keeps what the retention policies say, and resumes.

    Args:
        directory: where the checkpoints go, one ``step_00001200`` directory each.
        every_steps: save when ``step % every_steps == 0``. Without any save policy (no ``every_steps``,
            ``every_seconds``, ``at_steps`` or ``save_policies``) every ``save()`` call saves.
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
            Default: this process's share of its cores (``TRAINSTATE_THREADS`` sets it; README, "Threads").
        metadata: plain values recorded in every checkpoint's manifest.
        storage: where the checkpoints live (default: chosen from ``directory``).
        save_policies: more save policies (:class:`EverySteps`, :class:`EverySeconds`, :class:`AtSteps`, or
            your own with ``reason_to_save``), combined with the ones the keywords above make: any one saves.
        retention_policies: more retention policies (:class:`KeepLast`, :class:`KeepBest`, ..., or your own
            with ``votes``), combined with the keywords': a checkpoint goes only when none keeps it.
        read_only: list, restore and pin only: no lock, no sweep, no saves or deletions (for tools
            beside a running job).
        collective: inside an initialized torch.distributed process group of several ranks, every rank
            builds the manager on the same directory and calls it the same way; the ranks save each
            checkpoint together and decide together when to save, what to keep and where to resume
            (docs/distributed.md). That is the default there; ``collective=False`` makes this rank's
            manager its own (give each rank a directory of its own then).
        timeout: seconds a rank waits for the others under a process group before it raises
            DistributedError (default 600, or the TRAINSTATE_DIST_TIMEOUT environment variable); a rank that
            died is named sooner: at most 60 s (TRAINSTATE_DIST_ARRIVAL_TIMEOUT) when it never came.
        incremental: write only the tensors whose bytes changed since the previous save; the others are
            shared with earlier checkpoints through the run's pool ``_shared/`` (docs/incremental.md). Every
            checkpoint still loads on its own where it was saved; copy one away with ``consolidate``.
            Under a process group each rank shares its own unchanged shards, in the one pool.
        compression: ``"zstd"`` or ``"zstd:LEVEL"``: every checkpoint's tensors compressed in chunks, as
            ``trainstate.save(compression=...)`` does (under a process group too: each rank compresses its own
            chunks). Restoring needs no argument.
        key: encrypt every checkpoint with this key (32 bytes, 64 hex digits or base64) and authenticate every
            manifest it reads with it, for listing, retention and resuming (docs/encryption.md); under a
            process group each rank encrypts its own chunks. A run's
            checkpoints all use one key: with a key the manager refuses plain or differently keyed ones.
        key_env: the name of an environment variable that holds the key, instead of ``key``.
        local: a :class:`LocalTier`: besides the checkpoints in ``directory``, one every few steps on a fast
            node-local path (tmpfs, a local disk), written in the background; ``restore_latest`` resumes from
            the newest of either (docs/tiers.md).

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
        collective: bool | None = None,
        timeout: float | None = None,
        incremental: bool = False,
        compression: str | None = None,
        key: _keys.KeyLike | None = None,
        key_env: str | None = None,
        local: LocalTier | None = None,
    ) -> None:
        # Every argument is checked before anything is acquired (lock, signal handlers, threads).
        given = {name: value for name, value in locals().items() if name not in ("self", "timeout", "local")}
        self._config = settings(**given)
        if local is not None and not isinstance(local, LocalTier):
            raise InvalidArgumentError(f"local= takes a trainstate.LocalTier, got {type(local).__name__}")
        options, storage_, root = self._config.options, self._config.storage, self._config.directory
        self.catalog = Catalog(storage_, root, options.key)
        # under a process group (collective): built on every rank, in the same order
        group = None if options.read_only else manager_ranks(collective, timeout)
        self._ranks: ManagerRanks | SingleProcess = group or SingleProcess()  # no "is there a group?" below
        self._committer = Committer(self.catalog, self._config, group)
        self._writer = AsyncWriter(self._committer)  # starts no thread before the first async save
        self._writer.agreed_errors_only = group is not None
        self._rng = RNGCapture(bool(capture_rng))
        self._restorer = Restorer(self.catalog, self._ranks, self._rng, self._config)
        self._closed = False
        self._preemption_saved = False
        self._seq = 0  # the highest commit sequence number this manager has handed out
        self._warned: set[str] = set()  # keep_best metrics warned about, or seen in a save (keep_best.py)
        self.swept: builtins.list[str] = []
        self._lock: DirectoryLock | None = None
        self._preemption: PreemptionWatcher | None = None
        leader = self._ranks.leader
        try:
            failed: BaseException | None = None
            try:
                if not options.read_only and leader:  # one rank locks and sweeps; the others wait for it below
                    if storage_.capabilities.makedirs:
                        ensure_directory(root, "checkpoint directory")
                    if storage_.capabilities.locking:
                        self._lock = DirectoryLock(Path(root))
                    self.swept = self.catalog.sweep(locked=self._lock is not None)
            except Exception as e:  # noqa: BLE001 - raised on every rank by setup()
                failed = e
            self._ranks.setup(failed)
            if not options.read_only:
                self.list()  # refuses to start beside a checkpoint written by a newer trainstate
                if save_on_preemption:
                    self._preemption = PreemptionWatcher(preemption_signals)
        except BaseException:
            _release(self._lock, self._preemption, self._writer)
            raise
        self._local: Tier | None = None
        self._local_view: tuple[int, int] | None = None  # a local tier's own manager: (rank, world size)
        self._copy_behind: CopyBehind | None = None  # a local tier's own manager, when it copies behind training
        self._durable_base: int | None = None  # with a local tier: the durable tier's newest commit number
        if local is not None:
            try:
                self._local = self._local_tier(local, given)
            except BaseException:
                _release(self._lock, self._preemption, self._writer)
                raise
        # Dropped without close() (a notebook cell run again): let go of the lock and the signal handlers.
        self._finalizer = weakref.finalize(self, _release, self._lock, self._preemption, self._writer)

    def _local_tier(self, local: LocalTier, given: dict[str, Any]) -> Tier:
        """The local tier's own manager, on this process's folder of the tier's path (``w{world}/rank{r}``):
        asynchronous, never compressed or incremental, encrypted with the run's key, saving this process's own
        view. Under a process group, with the peers that hold its copies (tier_peers.py)."""
        rank, world = self._ranks.rank, self._ranks.world
        read_only = self._config.options.read_only  # a tool beside the job: the tier is listed and restored
        world_root = claim(local, self.directory, read_only) / f"w{world}"
        peers = tier_peers(self._ranks, local, world_root) if isinstance(self._ranks, ManagerRanks) else None
        inner = CheckpointManager(
            world_root / f"rank{rank:05d}",
            save_policies=[LocalEvery(local.every_steps)],
            # under a process group one more: while one rank's newest commits and another's is in flight,
            # the step before is the newest every rank has (a kill then still finds a common step)
            keep_last=local.keep + (1 if peers is not None else 0),
            async_save=True,
            capture_rng=given["capture_rng"],
            save_on_preemption=False,
            fsync=local.fsync,
            threads=given["threads"],
            metadata=given["metadata"],
            collective=False,
            key=given["key"],
            key_env=given["key_env"],
            read_only=read_only,
        )
        view = inner._local_view = (rank, world)
        if local.copy_behind:
            inner._copy_behind = CopyBehind(inner._writer)

        def nbytes(state: Any) -> int:
            return encode_state(inner._rng.wrap(state)[0], local_view=view).nbytes

        return Tier(local, inner, inner._writer, nbytes, view, peers, self._config.options.key, self.directory)

    # -- queries (manifests only) -----------------------------------------------------------------

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints, by step.

        Raises:
            FormatVersionError: a checkpoint here was written by a newer trainstate (a read-only manager
                lists the others instead).

        Example:
            >>> [info.step for info in mgr.list()]
            [500, 1000, 1500]
        """
        return self._committer.list()

    @property
    def last_retention(self) -> RetentionPlan | None:
        """What the latest retention pass kept and deleted, and why (None before the first one).

        Example:
            >>> mgr.save(1500, state, force=True)
            >>> mgr.last_retention.delete       # ['step_00000500'] with keep_last=2
        """
        return self._committer.last_retention

    def latest(self) -> CheckpointInfo | None:
        """The most recently committed checkpoint (after a rollback: the new timeline's, not a higher step).

        None when the directory has no checkpoint.

        Example:
            >>> info = mgr.latest()
            >>> info.step, info.name
            (1500, 'step_00001500')
        """
        items = self.list()
        return max(items, key=saved_order) if items else None

    def best(self, metric: str | None = None, mode: str | None = None) -> CheckpointInfo | None:
        """The best checkpoint by ``metric`` (default: the keep_best metric), or None if none has it.

        Args:
            metric: a metric name given to ``save(..., metrics=...)``; default: the ``keep_best`` one.
            mode: ``"min"`` or ``"max"``; default: the ``keep_best`` one, else ``"min"``.

        Example:
            >>> best = mgr.best("val_loss", "min")
            >>> trainstate.load(mgr.path_for(best.step), {"model": model}, include="model.*")   # to evaluate
        """
        policy = next((p for p in self.retention if isinstance(p, KeepBest)), None)
        metric = metric or (policy.metric if policy else None)
        mode = mode or (policy.mode if policy else "min")
        if metric is None:
            raise InvalidArgumentError("best() needs a metric (or keep_best set on the manager)")
        if mode not in ("min", "max"):
            raise InvalidArgumentError(f"best() mode must be 'min' or 'max', got {mode!r:.40}")
        scored = [c for c in self.list() if finite(c.metrics.get(metric))]
        if not scored:
            return None
        pick = min if mode == "min" else max
        return pick(scored, key=lambda c: c.metrics[metric])

    def path_for(self, step: int) -> str:
        """The path (or URL) of the checkpoint of ``step`` in this manager's directory, saved or not.

        Example:
            >>> mgr.path_for(1200)
            'runs/exp1/step_00001200'
            >>> trainstate.open(mgr.path_for(1200)).metadata
        """
        return self.catalog.path(naming.name_for(arguments.step(step)))

    def history(self) -> builtins.list[SaveRecord]:
        """Every save this manager made, with its timings (background ones once they finished), by step; with
        a local tier, its saves too (their reason says ``local tier``).

        Example:
            >>> for record in mgr.history():
            ...     print(record.step, record.blocking_seconds, record.write_seconds, record.nbytes)
        """
        self._writer.collect(block=False)
        if self._local is None:
            return list(self._writer.history)
        local = self._local.inner.history()  # its reason names the tier: "local tier: every 10 steps"
        return sorted([*self._writer.history, *local], key=lambda r: r.step)

    @property
    def preempted(self) -> bool:
        """True once a preemption signal arrived and its checkpoint was saved: time to exit.

        Example:
            >>> for step in range(start, total_steps):
            ...     train_step()
            ...     mgr.save(step, state)       # saves at once after SIGTERM / SIGINT / SIGUSR1
            ...     if mgr.preempted:
            ...         break
        """
        return self._preemption_saved

    # -- restore ------------------------------------------------------------------------------------

    def restore_latest(self, state: Any, **load_kwargs: Any) -> int | None:
        """Restore the newest loadable checkpoint into ``state``; returns the step to continue from.

        That is the saved step + 1 (``save(step)`` records that ``step`` is done), or None when the
        directory has no checkpoint at all. "Newest" is the most recently committed. A checkpoint that
        cannot be restored (damaged, a lying manifest) is skipped with a warning for the one before it,
        which is then restored completely, so nothing half-restored from the bad one remains. One deleted
        while it was being listed or read (a running job's retention, beside a read-only reader) is not
        damage: the directory is listed again. Under a process group every rank calls it and the tensors
        several ranks hold are read from storage once between them (``collective=False``: each rank reads
        all it holds; docs/distributed.md).

        Raises:
            CorruptCheckpointError: there are checkpoints, but none could be restored (the message lists
                each one and why); ``state`` may be partly overwritten: do not train from it.
            StateMismatchError: ``state`` does not fit the newest checkpoint (a user error, not damage).
            InvalidArgumentError: ``state`` cannot be restored in place (a JAX array or pytree, such as a Flax
                ``TrainState``, at its top): keep it in a dict, or use :meth:`restore`, which returns it.
            FormatVersionError: a checkpoint here was written by a newer trainstate.
            EncryptionKeyError: the manager's key does not fit the checkpoints (not damage: raised at once).
            DistributedError: under a process group, another rank failed or fell silent.

        Example:
            >>> start = mgr.restore_latest(state) or 0   # 0 on a fresh run
            >>> for step in range(start, total_steps):
            ...     ...
        """
        base: int | None = None  # the durable tier's newest commit number (None: it holds no checkpoint)
        if self._local is not None:  # a local checkpoint written after the durable tier's newest
            latest = self.latest() if self._ranks.leader else None
            base = self._ranks.from_leader(None if latest is None else latest.seq or 0, "restore_latest (tiers)")
            self._durable_base = base or 0
            local = self._local.restore_newest(state, base, load_kwargs)
            if local is not None:
                self.prepare(state)
                return local + 1
        found = self._restorer.newest(state, self.list, load_kwargs)
        if self._local is not None and base is not None:
            # the newest durable ones did not restore: a local one written after the durable one that did
            mine = next((c.seq or 0 for c in self.list() if found is not None and c.name == found.name), None)
            restored = self._ranks.from_leader(mine if self._ranks.leader else None, "restore_latest (tiers)")
            if found is None or restored != base:
                local = self._local.restore_newest(state, restored, load_kwargs, below=base)
                if local is not None:
                    self.prepare(state)
                    return local + 1
        if found is None:
            self.prepare(state)
            return None
        log.info("resumed from %s", found.name)
        self._committer.resumed(found.name, found.skipped)
        self._writer.last_step = found.step
        self.prepare(state)  # now that optimizer moments exist, the buffer gets its full size
        return found.step + 1

    def prepare(self, state: Any) -> None:
        """Get async saving ready for ``state``: allocate and touch its staging buffer on a helper thread.

        Called by :meth:`restore_latest`; call it yourself if you do not restore. Without it the first
        async save pays for fresh memory while the loop waits.

        Example:
            >>> mgr = trainstate.CheckpointManager("runs/exp1", every_steps=500, async_save=True)
            >>> mgr.prepare(state)   # a fresh run that does not call restore_latest
        """
        if not self.read_only:
            shard = self._ranks.shard  # as save() encodes: a rank's part under a process group
            self._writer.reserve(lambda: encode_state(self._rng.wrap(state)[0], rank=shard))  # no array is copied

    def restore(self, step: int, state: Any, **load_kwargs: Any) -> Any:
        """Restore the checkpoint of ``step`` into ``state`` (see :func:`trainstate.load`); returns the restored
        state: ``state`` itself, or a new one where it cannot change in place (a JAX array or pytree).
        Under a process group it is collective, as :meth:`restore_latest` is: every rank calls it (or each
        passes ``collective=False`` to restore alone).

        Example:
            >>> mgr.restore(1000, state)                          # roll back to step 1000
            >>> mgr.restore(mgr.best().step, {"model": model}, include="model.*")   # the best weights only
        """
        return self._restorer.into(self.path_for(step), state, **load_kwargs)

    # -- save ---------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: dict[str, float] | None = None,
        epoch: int | None = None,
        force: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Save ``state`` as step ``step`` if a policy says so (or ``force``); returns whether it did.

        ``step``, ``epoch`` and metric values may be NumPy scalars or one-element tensors.
        Raises the error of a failed background save, if one failed since the last call; a preemption
        checkpoint is written first, and such an older error reported after it.

        Args:
            step: the step just completed; the checkpoint is ``step_NNNNNNNN`` and a resume continues at step + 1.
            state: what to save (as :func:`trainstate.save` takes it).
            metrics: numbers for ``keep_best`` and ``best()``, recorded in the manifest.
            epoch: the epoch, recorded for display.
            force: save now whatever the policies say.
            metadata: plain values recorded in this checkpoint's manifest, beside the manager's ``metadata``.

        Example:
            >>> mgr.save(step, state, metrics={"val_loss": 0.31})   # True when a policy said save
            >>> mgr.save(step, state, force=True)                    # save now, e.g. before an evaluation
        """
        self._check_open()
        step = arguments.step(step)
        force = arguments.flag(force, "force")
        epoch = None if epoch is None else arguments.step(epoch, "epoch")
        values = arguments.metrics(metrics)
        saved = self._save_durable(step, state, values, epoch, force, metadata)
        if self._local is not None and not self._preemption_saved:
            self._local.maybe_save(step, state, saved, values, self._durable_seq())
        return saved

    def _durable_seq(self) -> int:
        """The durable tier's newest commit number as this manager knows it (a local checkpoint records it)."""
        if self._durable_base is None:  # a fresh run that did not restore: rank 0 lists once
            mine = self.catalog.next_seq() - 1 if self._ranks.leader else None
            self._durable_base = int(self._ranks.from_leader(mine, "CheckpointManager.save() (local tier)"))
        return max(self._durable_base, self._seq)

    def _save_durable(
        self,
        step: int,
        state: Any,
        values: dict[str, float],
        epoch: int | None,
        force: bool,
        metadata: dict[str, Any] | None,
    ) -> bool:
        """:meth:`save` in the durable tier: whether it saved."""
        preempting = self._preemption_pending()
        by_policy = reason_to_save(self.save_policies, step, time.monotonic(), self._writer.last_save_time)
        # the same answers on every rank
        agreed = self._ranks.decide(step, by_policy is not None, preempting, force, self._writer.failed())
        preempting, force = agreed.preempting, agreed.forced
        if agreed.by_policy and by_policy is None:
            by_policy = "rank 0's save policy"
        elif not agreed.by_policy:
            by_policy = None
        if agreed.failed and not preempting:
            self._ranks.raise_failed(self._writer)
        stale = self._writer.take_error() if preempting else None
        if preempting:
            reason: str | None = f"preemption ({self._preemption_signal()})"
        elif force:
            reason = "forced"
        else:
            reason = by_policy
        if reason is None or (step == self._writer.last_step and not preempting and not force):
            return False
        if self._pinned(step):
            raise CheckpointExistsError(
                f"step {step} is pinned in {self.directory}; unpin it (mgr.unpin({step})) to save over it"
            )
        self._save(step, state, reason, values, epoch, metadata, background=self.async_save and not preempting)
        if preempting:
            self._preemption_saved = True
            if stale is not None:
                raise_background(stale)
        return True

    def _pinned(self, step: int) -> bool:
        """Whether ``step`` is pinned, as rank 0 sees it under a process group."""
        mine = self.catalog.is_pinned(naming.name_for(step)) if self._ranks.leader else None
        return bool(self._ranks.from_leader(mine, "CheckpointManager.save() (pins)"))

    def _preemption_pending(self) -> bool:
        """Whether a preemption signal came and the save it asks for is still to be made (the next save()
        makes it): for a caller that wants to finish its step's bookkeeping first."""
        return self._preemption is not None and self._preemption.requested and not self._preemption_saved

    def _preemption_signal(self) -> str:
        name = self._preemption.signal_name if self._preemption is not None else None
        return name or "signalled on another rank"

    def _save(
        self,
        step: int,
        state: Any,
        reason: str,
        metrics: dict[str, float],
        epoch: int | None,
        metadata: dict[str, Any] | None,
        background: bool,
    ) -> None:
        start = time.perf_counter()
        warn_missing_metrics(self.retention, self._warned, self.catalog, step, metrics)
        self._writer.ready(background)  # a free staging buffer, or (synchronous) no save in flight
        self._seq = max(self._seq, self.catalog.next_seq() - 1) + 1
        saved, added = self._rng.wrap(state)
        recorded = facts(step, epoch, metrics, reason, time.time(), self._seq, added)
        meta = {**self._config.metadata, **(metadata or {}), META_KEY: recorded}
        try:
            snapshot = encode_state(saved, meta, rank=self._ranks.shard, local_view=self._local_view)
        except Exception as e:  # noqa: BLE001 - other ranks wait for its share: tell them why there is none
            self._ranks.refuse(step, e, background, self._writer, self._committer)
            raise
        behind = self._copy_behind.picker(saved) if self._copy_behind is not None and background else None
        self._writer.write(step, reason, snapshot, background, start, recorded, later=behind)

    def prune(self, *, dry_run: bool = False) -> RetentionPlan:
        """Apply the retention policies now (without saving); returns what was kept and deleted, and why.

        A dry run only plans, and works on a read-only manager too. Under a process group, call it on every
        rank: rank 0 deletes, and every rank returns its plan.

        Example:
            >>> mgr.prune(dry_run=True).delete    # what the policies would delete now
            >>> mgr.prune()                         # delete it
        """
        if dry_run:
            return plan_retention(self.list(), self.retention, self.catalog.damaged_list())
        self._check_open()
        self._writer.collect(block=True)
        failed: Exception | None = None  # rank 0 deletes; every rank learns what
        if self._ranks.leader:
            try:
                self._committer.apply_retention()
            except Exception as e:  # noqa: BLE001 - raised on every rank just below
                failed = e
        self._ranks.agree(failed, "prune()")
        self._committer.last_retention = self._ranks.from_leader(self.last_retention, "prune()")
        assert self.last_retention is not None
        return self.last_retention

    # -- lifecycle ----------------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every in-flight save has committed; raise if one failed.

        Example:
            >>> mgr.save(step, state, force=True)    # async: returns once the state is copied
            >>> mgr.wait()                           # committed now: safe to copy the directory
        """
        if self._local is not None:
            self._local.wait()
        self._writer.wait()

    def pin(self, step: int, reason: str = "") -> bool:
        """Keep this checkpoint whatever the retention policies say; False if it was already pinned.

        An existing pin keeps its reason (unpin, then pin, to change it). Allowed on a read-only manager:
        a pin is one small file beside the checkpoint, safe to add while another process trains and
        prunes in the same directory — a pin this returns from is never deleted.

        Example:
            >>> mgr.pin(1000, "submitted to the leaderboard")
            True
            >>> trainstate.CheckpointManager("runs/exp1", read_only=True).pin(1500)   # beside a running job
        """
        return self.catalog.pin(naming.name_for(arguments.step(step)), str(reason))

    def unpin(self, step: int) -> None:
        """Let the retention policies decide about the checkpoint of ``step`` again.

        Example:
            >>> mgr.unpin(1000)   # the next retention pass may delete it
        """
        self.catalog.unpin(naming.name_for(arguments.step(step)))

    def close(self, step: int | None = None, state: Any = None, *, metrics: dict[str, float] | None = None) -> None:
        """Wait for in-flight saves; with ``step`` and ``state``, save a final checkpoint first.

        The final checkpoint is written even if an earlier background save failed; that error is raised
        afterwards. A failed final save raises its own error.

        Example:
            >>> mgr.close(step, state)   # a final checkpoint, whatever the policies say, then wait
            >>> with trainstate.CheckpointManager("runs/exp1", every_steps=500) as mgr:
            ...     ...                  # close() on leaving the block
        """
        if (step is None) != (state is None):
            raise InvalidArgumentError(
                "close(step, state) saves a final checkpoint and needs both; close() alone waits"
            )
        if self._closed:
            if state is not None:
                raise CheckpointError("this CheckpointManager is closed: the final checkpoint was not saved")
            return
        try:
            if state is not None and step is not None:
                step = arguments.step(step)
                values = arguments.metrics(metrics)
                self._writer.collect(block=True)
                stale = self._writer.take_error()
                if step != self._writer.last_step:
                    self._save(step, state, "at close", values, None, None, background=False)
                if stale is not None:
                    raise_background(stale)
            self.wait()
        finally:
            self._closed = True
            try:
                if self._local is not None:
                    self._local.close()
                if self._copy_behind is not None:
                    self._copy_behind.close()
            finally:
                self._finalizer()
                self._ranks.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")
        if self.read_only:
            raise CheckpointError("this CheckpointManager is read-only")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _release(lock: DirectoryLock | None, preemption: PreemptionWatcher | None, writer: AsyncWriter) -> None:
    """Give back what a manager holds; also its finalizer, so it must not refer to the manager.

    Saves still in flight finish first (their commits and retention run under the lock).
    """
    try:
        if preemption is not None:
            preemption.close()
        writer.close()
    finally:
        if lock is not None:
            lock.release()
