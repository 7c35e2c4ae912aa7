"""Resuming: the newest checkpoint that restores, restored on every rank, and one restored by its path.

``CheckpointManager.restore_latest`` and ``restore`` delegate here. The choice of the newest checkpoint that
restores (and of which errors are fatal) is newest.py's, shared with the HF callback; this module makes one
attempt at a checkpoint (under a process group: on every rank, their outcomes exchanged) and restores through
the same load function as ``trainstate.load``, with the captured RNG beside the state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainstate import _arguments as arguments
from trainstate._distributed.group import Failure
from trainstate._frameworks import replaced_on_restore
from trainstate._manager.catalog import Catalog
from trainstate._manager.newest import FATAL, Found, first_line, newest_restorable
from trainstate._manager.policies import CheckpointInfo
from trainstate._manager.ranks import ManagerRanks, SingleProcess
from trainstate._manager.rng_capture import RNGCapture
from trainstate._manager.settings import Settings
from trainstate._restore import load_from
from trainstate.errors import CheckpointError, CorruptCheckpointError, DistributedError, InvalidArgumentError


class Restorer:
    """Restores a manager's checkpoints: it holds the manager's catalog, ranks, RNG capture and settings,
    never the manager."""

    def __init__(
        self, catalog: Catalog, ranks: ManagerRanks | SingleProcess, rng: RNGCapture, config: Settings
    ) -> None:
        self.catalog = catalog
        self._ranks = ranks
        self._rng = rng
        self._config = config

    def newest(
        self,
        state: Any,
        listing: Callable[[], list[CheckpointInfo]],
        load_kwargs: dict[str, Any],
    ) -> Found[None] | None:
        """Restore the newest checkpoint that restores into ``state`` (``restore_latest``); None when the run
        has none at all."""
        if replaced_on_restore(state):
            raise InvalidArgumentError(
                f"restore_latest restores the state in place and returns the step to continue from, but the state "
                f"given is a {type(state).__name__}, which cannot change in place (JAX arrays and pytrees are "
                "immutable): put it in a dict, state = {'train': train_state}, restore that and take it back out "
                "(state['train']), or use mgr.restore(step, train_state), which returns the restored value"
            )
        return newest_restorable(
            listing,
            self.catalog,
            lambda name: self._attempt(name, state, load_kwargs),
            ranks=self._ranks,
            advice=_advice,
        )

    def _attempt(self, name: str, state: Any, load_kwargs: dict[str, Any]) -> None:
        """Restore checkpoint ``name`` into ``state`` (on every rank), or raise why not (newest_restorable
        decides what that means).

        Under a process group, a rank that could not read its part makes every rank move on; a user error
        (a state that does not fit) on any rank raises on every rank.
        """
        mine: CheckpointError | None = None
        try:
            if self.into(self.catalog.path(name), state, **load_kwargs) is not state:
                # what the check before listing cannot tell: a tuple at the top holding an immutable part
                raise InvalidArgumentError(
                    f"restore_latest restores in place and returns a step, but a {type(state).__name__} cannot "
                    "change in place (JAX arrays and pytrees such as a Flax TrainState are immutable): keep the "
                    "state in a dict, state = {'state': ...}, and read state['state'] after restoring; or restore "
                    "with mgr.restore(step, state), which returns the restored state"
                )
        except CheckpointError as e:
            mine = e
        fatal = isinstance(mine, FATAL)
        shared = None if mine is None else Failure(self._ranks.rank, str(mine) if fatal else first_line(mine), fatal)
        failures = self._ranks.outcomes(shared, f"restore_latest ({name})")
        if mine is not None:
            raise mine
        for f in failures:
            if f.fatal:
                raise DistributedError(f"restore_latest: rank {f.rank} could not restore {name}: {f.message}")
        if failures:
            raise CorruptCheckpointError(f"rank {failures[0].rank}: {failures[0].message}")

    def into(self, path: str, state: Any, **load_kwargs: Any) -> Any:
        """Through the same load function as :func:`trainstate.load`, with the captured RNG beside the state
        (optional: a checkpoint saved with ``capture_rng=False`` has none); returns what that returned.

        Under a process group the load is collective (every rank reads its share of what the ranks hold in
        common); ``collective=False`` among ``load_kwargs`` makes each rank read all it holds itself.
        """
        collective = load_kwargs.pop("collective", None)
        if collective is not None:
            collective = arguments.flag(collective, "collective")
        target, added = self._rng.wrap(state)
        restored = load_from(
            path,
            target,
            storage=self._config.storage,
            optional=added,
            key=self._config.options.key,
            coord=self._ranks.loads() if collective is not False else None,
            **load_kwargs,
        )
        self._rng.unwrap(target, state)
        return restored if target is state else state  # a new object where the root is immutable (a TrainState)


def _advice(failures: list[tuple[str, str]]) -> str:
    if any("shared pool" in why and "does not exist" in why for _, why in failures):
        return (
            "\nThe run's shared pool (_shared/) is gone, and with it the bytes of every checkpoint of this "
            "incremental run: put it back (from a copy of the whole run directory), or start over in a fresh one."
        )
    shared = (
        " In an incremental run the checkpoints share the pool's files, so one damaged pool file damages every "
        "checkpoint that names it: restore_latest(state, exclude=[the tensors named above]) restores the rest "
        "(keep the live values of those), and the next save writes them again."
        if any("pool-" in why for _, why in failures)
        else ""
    )
    return (
        "\nThe state may be partly overwritten by the attempts; do not train from it. Restore a copy, "
        f"or move the damaged checkpoints away to start over.{shared}"
    )
