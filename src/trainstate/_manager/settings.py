"""A manager's settings: every constructor argument checked once, then fixed, and read back.

``settings()`` takes the keywords ``CheckpointManager`` was given and runs every check on them (the
schedule and retention policies, async saving and its staging buffers, the preemption signals, the
metadata, and the write options through ``save_options()``), before the manager acquires anything: a
wrong argument raises with no lock taken, no signal handler installed and no thread started. What it
returns, ``Settings``, is frozen; ``Configured`` gives the manager one read-only property per setting and
refuses to change one afterwards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from trainstate import _arguments as arguments
from trainstate import _keys
from trainstate._distributed import rank_and_world
from trainstate._format.manifest import MANIFEST_NAME
from trainstate._manager.policies import (
    AtSteps,
    EverySeconds,
    EverySteps,
    KeepBest,
    KeepEveryMinutes,
    KeepEverySteps,
    KeepLast,
    RetentionPolicy,
    SavePolicy,
)
from trainstate._save import SaveOptions, save_options
from trainstate._storage import Storage, resolve
from trainstate.errors import InvalidArgumentError


@dataclass(frozen=True)
class Settings:
    """A manager's configuration, fixed at construction."""

    directory: str
    storage: Storage
    save_policies: tuple[SavePolicy, ...]
    retention: tuple[RetentionPolicy, ...]
    async_save: bool
    max_in_flight: int
    staging_budget_bytes: int | None
    capture_rng: bool
    metadata: dict[str, Any]
    options: SaveOptions  # how every save writes (fsync, threads, compression, key, incremental...), checked


# what `manager.X = ...` is told is fixed at construction: the settings, and the save options it takes
FIXED = (frozenset(Settings.__dataclass_fields__) | frozenset(SaveOptions.__dataclass_fields__)) - {
    "options",
    "overwrite",
    "workers",
}


def settings(
    directory: str | os.PathLike[str],
    *,
    every_steps: int | None,
    every_seconds: float | None,
    at_steps: list[int] | tuple[int, ...] | None,
    keep_last: int | None,
    keep_every_steps: int | None,
    keep_every_minutes: float | None,
    keep_best: tuple[str, str, int] | None,
    async_save: bool,
    max_in_flight: int,
    staging_budget_bytes: int | None,
    capture_rng: bool,
    save_on_preemption: bool,
    preemption_signals: tuple[str, ...],
    fsync: bool,
    threads: int,
    metadata: dict[str, Any] | None,
    save_policies: list[SavePolicy] | None,
    retention_policies: list[RetentionPolicy] | None,
    storage: Storage | None,
    read_only: bool,
    collective: bool | None,
    incremental: bool,
    compression: str | None,
    key: _keys.KeyLike | None,
    key_env: str | None,
) -> Settings:
    """``CheckpointManager``'s keywords (all but ``timeout``, which its ranks check), checked: the
    manager's settings, or the ``InvalidArgumentError`` of the first wrong one. Acquires nothing."""
    for given, what in ((save_policies, "save_policies"), (retention_policies, "retention_policies")):
        if given is not None and not isinstance(given, (list, tuple)):
            raise InvalidArgumentError(f"{what} takes a list of policies, got {given!r:.60}")
    save_list: list[SavePolicy] = list(save_policies or [])
    if every_steps is not None:
        save_list.append(EverySteps(arguments.positive_int(every_steps, "every_steps")))
    if every_seconds is not None:
        save_list.append(EverySeconds(arguments.positive_number(every_seconds, "every_seconds")))
    if at_steps:
        save_list.append(AtSteps(frozenset(arguments.step(s, "at_steps[]") for s in at_steps)))
    if not save_list and at_steps is None:  # no schedule given: each save() saves (a notebook's manager
        save_list.append(EverySteps(1))  # that saved nothing, silently, lost work)
    keep: list[RetentionPolicy] = list(retention_policies or [])
    if keep_last is not None:
        keep.append(KeepLast(arguments.positive_int(keep_last, "keep_last")))
    if keep_every_steps is not None:
        keep.append(KeepEverySteps(arguments.positive_int(keep_every_steps, "keep_every_steps")))
    if keep_every_minutes is not None:
        keep.append(KeepEveryMinutes(arguments.positive_number(keep_every_minutes, "keep_every_minutes")))
    if keep_best is not None:
        keep.append(KeepBest(*arguments.keep_best(keep_best)))
    max_in_flight = arguments.positive_int(max_in_flight, "max_in_flight")
    if staging_budget_bytes is not None and (
        isinstance(staging_budget_bytes, bool) or not isinstance(staging_budget_bytes, int) or staging_budget_bytes < 0
    ):
        raise InvalidArgumentError(f"staging_budget_bytes must be a non-negative int, got {staging_budget_bytes!r}")
    for name in preemption_signals:
        if not isinstance(name, str) or not name.startswith("SIG"):
            raise InvalidArgumentError(f"preemption_signals takes names like 'SIGTERM', got {name!r}")
    for name, value in (
        ("async_save", async_save),
        ("capture_rng", capture_rng),
        ("save_on_preemption", save_on_preemption),
    ):
        arguments.flag(value, name)
    options = save_options(
        overwrite=True,  # a step saved again (after a resume) replaces its checkpoint
        fsync=fsync,
        threads=threads,
        compression=compression,
        key=key,
        key_env=key_env,
        collective=collective,
        group_size=rank_and_world()[1],
        incremental=incremental,
        read_only=read_only,
    )
    storage_, root = resolve(arguments.location(directory), storage)
    if storage_.stat_followed(storage_.join(root, MANIFEST_NAME)) is not None:
        raise InvalidArgumentError(
            f"{directory} is a checkpoint, not a run directory: a CheckpointManager keeps its checkpoints "
            "inside a directory of its own (pass the run directory, e.g. its parent); to load this one, "
            "use trainstate.load"
        )
    for policy in save_list:
        if not callable(getattr(policy, "reason_to_save", None)):
            raise InvalidArgumentError(f"save_policies takes save policies (e.g. EverySteps(500)), got {policy!r:.60}")
    for kept in keep:
        if not callable(getattr(kept, "votes", None)):
            raise InvalidArgumentError(
                f"retention_policies takes retention policies (e.g. KeepLast(3)), got {kept!r:.60}"
            )
    return Settings(
        directory=root,
        storage=storage_,
        save_policies=tuple(save_list),
        retention=tuple(keep),
        async_save=bool(async_save),
        max_in_flight=max_in_flight,
        staging_budget_bytes=staging_budget_bytes,
        capture_rng=bool(capture_rng),
        metadata=dict(metadata or {}),
        options=options,
    )


class Configured:
    """The manager's settings as read-only properties (``CheckpointManager`` derives from it), and the
    refusal to change one once the manager is built."""

    _config: Settings

    def __setattr__(self, name: str, value: Any) -> None:
        if "_finalizer" in self.__dict__ and not name.startswith("_") and name not in self.__dict__:
            if name in FIXED:
                shown = "..." if name == "key" else f"{value!r:.40}"  # never echo a key
                raise InvalidArgumentError(
                    f"CheckpointManager.{name} is fixed when the manager is built; create a new manager "
                    f"with {name}={shown} (close() this one first)"
                )
            raise InvalidArgumentError(
                f"CheckpointManager has no setting {name!r} to change: settings are arguments of the "
                "constructor and fixed once it is built"
            )
        super().__setattr__(name, value)

    @property
    def directory(self) -> str:
        """Where the checkpoints go: the directory (or URL) the manager was built with.

        Example:
            >>> trainstate.CheckpointManager("runs/exp1").directory
            'runs/exp1'
        """
        return self._config.directory

    @property
    def storage(self) -> Storage:
        """The storage backend the checkpoints are read from and written to.

        Example:
            >>> mgr.storage.capabilities.locking  # True on a local disk: one writer at a time
        """
        return self._config.storage

    @property
    def async_save(self) -> bool:
        """Whether saves are written on a background thread (``async_save=``).

        Example:
            >>> trainstate.CheckpointManager("runs/exp1", async_save=True).async_save
            True
        """
        return self._config.async_save

    @property
    def max_in_flight(self) -> int:
        """How many async saves may be in flight at once, each with its own staging buffer (``max_in_flight=``).

        Example:
            >>> mgr.max_in_flight
            1
        """
        return self._config.max_in_flight

    @property
    def staging_budget_bytes(self) -> int | None:
        """The cap on one staging buffer; a larger state is saved synchronously (None: no cap).

        Example:
            >>> trainstate.CheckpointManager("runs/exp1", async_save=True, staging_budget_bytes=2**30).staging_budget_bytes
            1073741824
        """
        return self._config.staging_budget_bytes

    @property
    def capture_rng(self) -> bool:
        """Whether the RNG is saved under ``_rng`` when the state has no :class:`RNGState` (``capture_rng=``).

        Example:
            >>> mgr.capture_rng
            True
        """
        return self._config.capture_rng

    @property
    def fsync(self) -> bool:
        """Whether each save is flushed to stable storage before its commit (``fsync=``).

        Example:
            >>> trainstate.CheckpointManager("runs/exp1", fsync=False).fsync
            False
        """
        return self._config.options.fsync

    @property
    def threads(self) -> int:
        """Writer threads per save (``threads=``).

        Example:
            >>> trainstate.CheckpointManager("runs/exp1", threads=4).threads
            4
        """
        return self._config.options.threads

    @property
    def metadata(self) -> dict[str, Any]:
        """A copy of the metadata every save records (``metadata=``).

        Example:
            >>> trainstate.CheckpointManager("runs/exp1", metadata={"run": "exp1"}).metadata
            {'run': 'exp1'}
        """
        return dict(self._config.metadata)

    @property
    def save_policies(self) -> tuple[SavePolicy, ...]:
        """The save policies, from the keywords (``every_steps=`` ...) and ``save_policies=``.

        Example:
            >>> trainstate.CheckpointManager("runs/exp1", every_steps=500).save_policies
            (EverySteps(n=500),)
        """
        return self._config.save_policies

    @property
    def retention(self) -> tuple[RetentionPolicy, ...]:
        """The retention policies, from the keywords (``keep_last=`` ...) and ``retention_policies=``.

        Example:
            >>> trainstate.CheckpointManager("runs/exp1", keep_last=3).retention
            (KeepLast(n=3),)
        """
        return self._config.retention

    @property
    def read_only(self) -> bool:
        """Whether this manager only lists, restores and pins (``read_only=``).

        Example:
            >>> trainstate.CheckpointManager("runs/exp1", read_only=True).read_only
            True
        """
        return self._config.options.read_only

    @property
    def incremental(self) -> bool:
        """Whether unchanged tensors are shared with earlier checkpoints (``incremental=``).

        Example:
            >>> trainstate.CheckpointManager("runs/exp1", incremental=True).incremental
            True
        """
        return self._config.options.incremental
