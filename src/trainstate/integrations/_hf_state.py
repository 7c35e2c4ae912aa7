"""What a Trainer checkpoint holds besides the model, optimizer and scheduler: three small statefuls.

* :class:`TrainerStateView` saves the Trainer's ``TrainerState`` as plain values (what the Trainer itself
  writes to ``trainer_state.json``, with the states of its ``ExportableState`` callbacks brought up to date
  first, as ``Trainer._save_checkpoint`` does). Restoring it only keeps the saved values: the Trainer takes its
  state from the ``trainer_state.json`` the resume stand-in holds (``_hf_resume.py``), and the callback checks
  that the two agree.
* :class:`DeferredRNG` saves the process's generators (an :class:`~trainstate.RNGState`), but restoring it
  holds them until :meth:`DeferredRNG.apply`: the Trainer's loop draws from torch's generator when a data
  loader iterator starts, so the callback puts the generators back at the point of the loop the save was
  taken at, not when the checkpoint is read. Under a process group it is a per-rank value, as an
  ``RNGState`` is: each rank saves and gets back its own generators. Restored by another number of processes
  than saved it, no saved rank's generators are this process's own: :meth:`DeferredRNG.rederive` holds what
  ``RNGState(seed=args.seed).rederive(rank, step)`` would set instead (docs/distributed.md, "Changing the world
  size"), applied at the same point of the loop.
* :class:`Record` is a dict of plain values that comes back as it was saved (the data position).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from trainstate._rng import RNGState


def plain(value: Any) -> Any:
    """``value`` with NumPy scalars, 0-d arrays and one-element tensors turned into Python numbers, tuples into
    lists and dict keys into strings: what ``json.dumps`` takes, as the Trainer's ``trainer_state.json`` needs.

    A ``compute_metrics`` that returns ``np.float32`` values puts them in ``log_history``; saved as they are
    they would come back as arrays, which the resumed Trainer could not write to JSON.
    """
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return plain(item())
        except (TypeError, ValueError, RuntimeError):  # an array of several values: a list of them
            tolist = getattr(value, "tolist", None)
            if callable(tolist):
                return plain(tolist())
    return str(value)


def numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric entries of a Trainer's logs or metrics (what a manager can keep the best by)."""
    out = {}
    for key, value in plain(values).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


class TrainerStateView:
    """The live ``TrainerState`` as a stateful: ``state_dict()`` snapshots it; ``load_state_dict`` keeps ``saved``.

    ``callbacks`` returns the Trainer's callbacks whose state the Trainer exports (``ExportableState``) and its
    ``TrainerControl``; their ``state()`` goes into ``stateful_callbacks`` as ``Trainer._save_checkpoint`` puts it.
    ``flos`` returns the floating-point operations the Trainer counted since it last added them to ``total_flos``
    (it does at each log and in its own save): they belong to the saved total.

    Under a process group the ranks' snapshots differ (each logs its own run times, counts its own flos), and
    a collective save takes one value for everyone: the callback sets :attr:`shared` to rank 0's snapshot
    (with every rank's flos) for the save, as the Trainer writes rank 0's ``trainer_state.json``.
    """

    def __init__(self, state: Callable[[], Any], callbacks: Callable[[], list[Any]], flos: Callable[[], float]) -> None:
        self._state = state
        self._callbacks = callbacks
        self._flos = flos
        self.saved: dict[str, Any] | None = None
        self.leave_out_last_log = False  # the Trainer's end-of-training summary, logged before the last save
        self.shared: dict[str, Any] | None = None  # what every rank saves, set around a collective save

    def state_dict(self) -> dict[str, Any]:
        if self.shared is not None:
            return self.shared
        return self.snapshot(float(self._flos()))

    def snapshot(self, flos: float) -> dict[str, Any]:
        """This process's ``TrainerState`` as the Trainer would save it, with ``flos`` not yet counted added."""
        snapshot: dict[str, Any] = plain(dataclasses.asdict(self._state()))
        if self.leave_out_last_log and snapshot["log_history"]:
            snapshot["log_history"] = snapshot["log_history"][:-1]
        snapshot["total_flos"] = snapshot["total_flos"] + flos
        exported: dict[str, Any] = dict(snapshot.get("stateful_callbacks") or {})
        fresh: dict[str, Any] = {}
        for cb in self._callbacks():
            name = type(cb).__name__
            if name in fresh:  # several of one class: a list, in order (as TrainerState builds it)
                fresh[name] = (fresh[name] if isinstance(fresh[name], list) else [fresh[name]]) + [plain(cb.state())]
            else:
                fresh[name] = plain(cb.state())
        exported.update(fresh)
        snapshot["stateful_callbacks"] = exported
        return snapshot

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.saved = plain(state)


class DeferredRNG:
    """An :class:`~trainstate.RNGState` whose restore waits for :meth:`apply`; per rank under a process group."""

    __trainstate_per_rank__ = True

    def __init__(self) -> None:
        self.pending: dict[str, Any] | None = None
        self.seed = 0  # the Trainer's args.seed, set when training begins: what rederive seeds from
        self.rederived: tuple[int, int] | None = None  # (rank, step) of the last rederive

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = RNGState().state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.pending = dict(state)

    def rederive(self, rank: int, step: int) -> None:
        """Hold, as the state to apply, the generators ``RNGState(seed=self.seed).rederive(rank, step)`` sets: what
        a restore by another number of processes than saved the checkpoint calls. This process's generators are
        left as they were until :meth:`apply`.

        Args:
            rank: this process's rank in the resumed run.
            step: the step of the checkpoint restored.
        """
        here = RNGState().state_dict()
        try:
            RNGState(seed=self.seed).rederive(rank, step)
            self.pending = RNGState().state_dict()
        finally:
            RNGState().load_state_dict(here)
        self.rederived = (rank, step)

    def apply(self) -> None:
        """Put the restored generators in place (once); nothing when nothing was restored."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            RNGState().load_state_dict(pending)


class Record:
    """A dict of plain values, saved by calling ``current`` and kept as ``saved`` when restored."""

    def __init__(self, current: Callable[[], dict[str, Any]]) -> None:
        self._current = current
        self.saved: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self._current()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.saved = plain(state)
