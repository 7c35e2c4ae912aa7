"""Save and retention policies: small dataclasses with pure decision methods, composed as a union.

Save policies answer "save at this step, now?" with a reason or None. Retention policies look at the
committed checkpoints and vote per checkpoint: a reason to keep it, ``None`` to let it go, or no entry to
abstain. A checkpoint is deleted only if some policy lets it go and none keeps it. The newest checkpoint
and pinned ones are always kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from trainstate import _arguments as arguments


def saved_order(c: CheckpointInfo) -> tuple[int, int]:
    """The order checkpoints were committed in: by the manager's commit sequence number, never a clock.

    Each save takes the highest sequence number in the directory + 1, so after a rollback (resuming from
    an older step) the fresh checkpoints are the newest whatever their step numbers say, and a host whose
    clock is behind the last one's cannot make its new saves look old. Checkpoints without a number
    (written by hand, or by trainstate before 0.2) come first, by step.
    """
    return (c.seq if c.seq is not None else -1, c.step)


@dataclass(frozen=True)
class CheckpointInfo:
    """What a manager knows about one committed checkpoint, from its manifest alone.

    ``CheckpointManager.list()``, ``latest()`` and ``best()`` return these; retention policies vote on them.

    Attributes:
        name: the checkpoint's directory name in the manager's directory (``step_00001200``).
        step: the step it was saved at.
        created: wall-clock time of the save (seconds since the epoch): for display and
            ``KeepEveryMinutes``, never for order.
        metrics: the metrics passed to ``save(..., metrics=...)``.
        epoch: the epoch passed to ``save(..., epoch=...)``, if any.
        pinned: kept whatever the retention policies say (``mgr.pin(step)``).
        nbytes: bytes the checkpoint's data files take (shared pool files included), without its manifest.
        manifest_nbytes: bytes of its ``manifest.json``; ``nbytes + manifest_nbytes`` is the "size" that
            ``trainstate ls``, ``inspect`` and ``prune`` show.
        seq: the commit sequence number: what "newest" means (None for checkpoints written without a manager).
        pin_reason: the reason given to ``pin``.
        shared: of ``nbytes``, bytes in shared pool files an earlier save wrote (incremental checkpoints).
        pooled: of ``nbytes``, bytes in the run's shared pool: what deleting this checkpoint does not free.
        path: where the checkpoint is: the manager's directory joined to ``name``, in the form its storage
            uses, as ``mgr.path_for(step)`` gives it (``""`` for one built by hand). On a local disk that is
            a path that ``trainstate.open``, ``load`` and ``export`` take as it is; on an object store it has
            no ``s3://`` scheme, so open it with ``storage=mgr.storage``.

    Example:
        >>> for info in mgr.list():
        ...     print(info.step, info.metrics.get("val_loss"), info.nbytes, "pinned" if info.pinned else "")
        >>> trainstate.export(mgr.latest().path, "release/")
        >>> trainstate.open(mgr.latest().path, storage=mgr.storage)   # on any storage
        >>> trainstate.CheckpointInfo("step_00000100", 100, created=0.0, seq=0)  # by hand, to try a policy
    """

    name: str
    step: int
    created: float  # wall-clock time of the save: for display (and one-per-N-minutes), never for order
    metrics: Mapping[str, float] = field(default_factory=dict)
    epoch: int | None = None
    pinned: bool = False
    nbytes: int = 0
    seq: int | None = None  # commit sequence number: what "newest" means
    pin_reason: str = ""
    shared: int = 0  # of nbytes, in shared pool files an earlier save wrote (incremental checkpoints)
    pooled: int = 0  # of nbytes, in the run's shared pool (shared or not): what deleting it does not free
    path: str = ""  # the checkpoint's directory, as the manager's storage names it (mgr.path_for(step))
    manifest_nbytes: int = 0  # bytes of its manifest.json (nbytes counts the data files only)


# -- when to save -----------------------------------------------------------------------------------


class SavePolicy(Protocol):
    """When to save: a reason to save at ``step`` now (shown in the checkpoint's facts), or None.

    Pass your own to ``CheckpointManager(save_policies=[...])``; the manager saves when any policy gives a reason.

    Example:
        >>> class EveryEpochEnd:  # any object with this method is a save policy
        ...     def __init__(self, steps_per_epoch: int) -> None:
        ...         self.steps_per_epoch = steps_per_epoch
        ...     def reason_to_save(self, step: int, now: float, last_save_time: float) -> str | None:
        ...         return "end of epoch" if (step + 1) % self.steps_per_epoch == 0 else None
        >>> mgr = trainstate.CheckpointManager("runs/exp1", save_policies=[EveryEpochEnd(390)])
    """

    def reason_to_save(self, step: int, now: float, last_save_time: float) -> str | None:
        """A reason to save at ``step`` now, or None; ``now`` and ``last_save_time`` are ``time.monotonic()``.

        Example:
            >>> trainstate.EverySteps(500).reason_to_save(1000, now=0.0, last_save_time=0.0)
            'every 500 steps'
        """
        ...


@dataclass(frozen=True)
class EverySteps:
    """Save when ``step % n == 0`` (what ``every_steps=n`` builds).

    Attributes:
        n: the interval in steps (a positive int).

    Example:
        >>> trainstate.CheckpointManager("runs/exp1", save_policies=[trainstate.EverySteps(500)])
    """

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", arguments.positive_int(self.n, "EverySteps(n)"))

    def reason_to_save(self, step: int, now: float, last_save_time: float) -> str | None:
        """``"every N steps"`` when ``step`` is a multiple of ``n``, else None.

        Example:
            >>> trainstate.EverySteps(500).reason_to_save(1001, now=0.0, last_save_time=0.0) is None
            True
        """
        return f"every {self.n} steps" if step % self.n == 0 else None


@dataclass(frozen=True)
class EverySeconds:
    """Save when this many seconds (a monotonic clock) passed since the last save (``every_seconds=``).

    Attributes:
        seconds: the interval (a positive number).

    Example:
        >>> mgr = trainstate.CheckpointManager("runs/exp1", save_policies=[trainstate.EverySeconds(1800)])
    """

    seconds: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "seconds", arguments.positive_number(self.seconds, "EverySeconds(seconds)"))

    def reason_to_save(self, step: int, now: float, last_save_time: float) -> str | None:
        """``"every S s"`` once ``now - last_save_time >= seconds``, else None.

        Example:
            >>> trainstate.EverySeconds(1800).reason_to_save(7, now=2000.0, last_save_time=100.0)
            'every 1800 s'
        """
        return f"every {self.seconds:g} s" if now - last_save_time >= self.seconds else None


@dataclass(frozen=True)
class AtSteps:
    """Save at these steps (``at_steps=``).

    Attributes:
        steps: the steps to save at (any iterable of ints; kept as a frozenset).

    Example:
        >>> mgr = trainstate.CheckpointManager("runs/exp1", save_policies=[trainstate.AtSteps({1000, 5000})])
    """

    steps: frozenset[int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", frozenset(arguments.step(s, "AtSteps(steps[])") for s in self.steps))

    def reason_to_save(self, step: int, now: float, last_save_time: float) -> str | None:
        """``"at step"`` when ``step`` is one of ``steps``, else None.

        Example:
            >>> trainstate.AtSteps({10, 20}).reason_to_save(10, now=0.0, last_save_time=0.0)
            'at step'
        """
        return "at step" if step in self.steps else None


def reason_to_save(policies: Sequence[SavePolicy], step: int, now: float, last_save_time: float) -> str | None:
    """The first reason any policy gives, or None."""
    for p in policies:
        reason = p.reason_to_save(step, now, last_save_time)
        if reason:
            return reason
    return None


# -- what to keep -----------------------------------------------------------------------------------

Votes = dict[str, "str | None"]


class RetentionPolicy(Protocol):
    """What to keep: for each checkpoint, a reason to keep it, or None to let it go.

    Pass your own to ``CheckpointManager(retention_policies=[...])``. A checkpoint is deleted only when no
    policy keeps it and at least one lets it go; the newest and pinned ones are always kept. Pure: no I/O.

    Example:
        >>> class KeepBelowLoss:  # any object with this method is a retention policy
        ...     def __init__(self, limit: float) -> None:
        ...         self.limit = limit
        ...     def votes(self, checkpoints):
        ...         return {c.name: "good loss" for c in checkpoints if c.metrics.get("loss", 1e9) < self.limit}
        >>> mgr = trainstate.CheckpointManager("runs/exp1", keep_last=2, retention_policies=[KeepBelowLoss(0.1)])
    """

    def votes(self, checkpoints: Sequence[CheckpointInfo]) -> Votes:
        """For each checkpoint's name: a reason to keep it, None to let it go; a name left out abstains.

        Example:
            >>> infos = [trainstate.CheckpointInfo(f"step_{s:08d}", s, created=0.0, seq=s) for s in (1, 2, 3)]
            >>> trainstate.KeepLast(2).votes(infos)
            {'step_00000003': 'last 2', 'step_00000002': 'last 2', 'step_00000001': None}
        """
        ...


@dataclass(frozen=True)
class KeepLast:
    """Keep the newest ``n`` checkpoints (by commit order, not clock) (``keep_last=n``).

    Attributes:
        n: how many to keep (a positive int).

    Example:
        >>> trainstate.CheckpointManager("runs/exp1", every_steps=500,
        ...     retention_policies=[trainstate.KeepLast(3), trainstate.KeepBest("val_loss", "min", 2)])
    """

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", arguments.positive_int(self.n, "KeepLast(n)"))

    def votes(self, checkpoints: Sequence[CheckpointInfo]) -> Votes:
        """``"last N"`` for the ``n`` most recently committed, None for the others.

        Example:
            >>> infos = [trainstate.CheckpointInfo(f"step_{s:08d}", s, created=0.0, seq=s) for s in (1, 2, 3)]
            >>> trainstate.KeepLast(1).votes(infos)
            {'step_00000003': 'last 1', 'step_00000002': None, 'step_00000001': None}
        """
        ordered = sorted(checkpoints, key=saved_order, reverse=True)
        return {c.name: (f"last {self.n}" if i < self.n else None) for i, c in enumerate(ordered)}


@dataclass(frozen=True)
class KeepEverySteps:
    """Keep every checkpoint whose step is a multiple of ``n`` (``keep_every_steps=n``).

    Attributes:
        n: the step interval (a positive int).

    Example:
        >>> mgr = trainstate.CheckpointManager("runs/exp1", every_steps=500, keep_last=3,
        ...     retention_policies=[trainstate.KeepEverySteps(10_000)])  # plus a long-term milestone
    """

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", arguments.positive_int(self.n, "KeepEverySteps(n)"))

    def votes(self, checkpoints: Sequence[CheckpointInfo]) -> Votes:
        """``"every N steps"`` for steps that are multiples of ``n``, None for the others.

        Example:
            >>> infos = [trainstate.CheckpointInfo(f"step_{s:08d}", s, created=0.0) for s in (100, 200)]
            >>> trainstate.KeepEverySteps(200).votes(infos)
            {'step_00000100': None, 'step_00000200': 'every 200 steps'}
        """
        return {c.name: (f"every {self.n} steps" if c.step % self.n == 0 else None) for c in checkpoints}


@dataclass(frozen=True)
class KeepEveryMinutes:
    """One checkpoint per ``minutes`` of wall time: the oldest, then the first at least that much newer.

    Attributes:
        minutes: the interval of wall time (a positive number), by the checkpoints' ``created`` times.

    Example:
        >>> mgr = trainstate.CheckpointManager("runs/exp1", every_steps=100, keep_last=3,
        ...     retention_policies=[trainstate.KeepEveryMinutes(60)])  # plus one per hour
    """

    minutes: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "minutes", arguments.positive_number(self.minutes, "KeepEveryMinutes(minutes)"))

    def votes(self, checkpoints: Sequence[CheckpointInfo]) -> Votes:
        """``"one per M min"`` for the oldest and each first checkpoint ``minutes`` after the last kept one.

        Example:
            >>> infos = [trainstate.CheckpointInfo(f"step_{s:08d}", s, created=60.0 * s) for s in (100, 200, 300)]
            >>> trainstate.KeepEveryMinutes(150).votes(infos)
            {'step_00000100': 'one per 150 min', 'step_00000200': None, 'step_00000300': 'one per 150 min'}
        """
        out: Votes = {}
        last_kept = -math.inf
        for c in sorted(checkpoints, key=lambda c: c.step):
            if c.created - last_kept >= self.minutes * 60:
                out[c.name] = f"one per {self.minutes:g} min"
                last_kept = c.created
            else:
                out[c.name] = None
        return out


@dataclass(frozen=True)
class KeepBest:
    """The best ``k`` by a metric; checkpoints without the metric get no vote from this policy.

    On a tie the earlier checkpoint ranks first, as in Lightning's top-k and the HF Trainer (a new best must be
    strictly better), and ``CheckpointManager.best`` picks the same one.

    Attributes:
        metric: the name of a metric passed to ``CheckpointManager.save(..., metrics=...)``.
        mode: ``"min"`` (lower is better) or ``"max"``.
        k: how many to keep.

    Example:
        >>> mgr = trainstate.CheckpointManager("runs/exp1", every_steps=500, keep_last=1,
        ...     retention_policies=[trainstate.KeepBest("val_acc", "max", 3)])
        >>> mgr.save(step, state, metrics={"val_acc": 0.91})
    """

    metric: str
    mode: str = "min"
    k: int = 1

    def __post_init__(self) -> None:
        metric, mode, k = arguments.keep_best((self.metric, self.mode, self.k))
        object.__setattr__(self, "metric", metric)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "k", k)

    def votes(self, checkpoints: Sequence[CheckpointInfo]) -> Votes:
        """``"best K METRIC (MODE)"`` for the ``k`` best; None for the rest of those with a finite value.

        Example:
            >>> infos = [trainstate.CheckpointInfo(f"step_{s:08d}", s, created=0.0, metrics={"loss": 1 / s})
            ...          for s in (1, 2)]
            >>> trainstate.KeepBest("loss", "min", 1).votes(infos)
            {'step_00000002': 'best 1 loss (min)', 'step_00000001': None}
        """
        scored = [c for c in checkpoints if finite(c.metrics.get(self.metric))]
        scored.sort(key=lambda c: (c.metrics[self.metric] if self.mode == "min" else -c.metrics[self.metric], c.step))
        return {
            c.name: (f"best {self.k} {self.metric} ({self.mode})" if i < self.k else None) for i, c in enumerate(scored)
        }


def finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class RetentionPlan:
    """What a retention pass decided: each kept checkpoint with its reasons, and the names deleted.

    Attributes:
        keep: each kept checkpoint's name and the reasons it is kept (``["newest"]``, ``["last 3"]``, ...).
        delete: the names of the checkpoints deleted (or, on a dry run, to delete).

    Example:
        >>> plan = mgr.prune(dry_run=True)
        >>> plan.delete                      # ['step_00000100', ...]
        >>> plan.keep["step_00000500"]       # ['newest', 'last 3']
    """

    keep: dict[str, list[str]]  # name -> reasons
    delete: list[str]


def plan_retention(
    checkpoints: Sequence[CheckpointInfo],
    policies: Sequence[RetentionPolicy],
    damaged: Sequence[CheckpointInfo] = (),
) -> RetentionPlan:
    """Decide what to keep and delete. Pure: no I/O.

    ``damaged``: committed checkpoints whose manifest cannot be read, known by name, step, pin and the
    time of their manifest only. The policies decide about each as about any other, with its commit
    order taken as the oldest (it cannot be read); it never takes the place of a readable checkpoint,
    whose fate is decided among the readable ones alone. One that is kept says ``"damaged manifest"``.
    """
    plan = _plan(checkpoints, policies)
    if not damaged:
        return plan
    joint = _plan([*checkpoints, *(replace(d, seq=None) for d in damaged)], policies)
    keep = dict(plan.keep)
    for d in damaged:
        if d.name in joint.keep:
            keep[d.name] = [*joint.keep[d.name], "damaged manifest"]
    delete = sorted([*plan.delete, *(d.name for d in damaged if d.name not in joint.keep)])
    return RetentionPlan(keep, delete)


def _plan(checkpoints: Sequence[CheckpointInfo], policies: Sequence[RetentionPolicy]) -> RetentionPlan:
    keep: dict[str, list[str]] = {c.name: [] for c in checkpoints}
    released: set[str] = set()
    if checkpoints:
        newest = max(checkpoints, key=saved_order)  # the one just committed, even after a rollback
        keep[newest.name].append("newest")
    for c in checkpoints:
        if c.pinned:
            keep[c.name].append("pinned")
    for policy in policies:
        for name, reason in policy.votes(checkpoints).items():
            if reason:
                keep[name].append(reason)
            else:
                released.add(name)
    for c in checkpoints:
        if not keep[c.name] and c.name not in released:
            keep[c.name].append("no policy lets it go" if policies else "no retention policy")
    delete = sorted((n for n in released if not keep[n]), key=lambda n: n)
    return RetentionPlan({n: r for n, r in keep.items() if r}, delete)
