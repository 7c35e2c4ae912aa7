"""A manager under torch.distributed (or jax.distributed): what the ranks decide together, so that every rank does the same.

Every rank builds its own CheckpointManager on the same directory. Rank 0 alone takes the directory lock,
sweeps, numbers the commits and applies retention (after the whole group committed); every rank writes its
share of each checkpoint (``_distributed/save.py``). What could differ between ranks is decided once per
``save()`` call, in one all-reduce of a few integers on the manager's own gloo group:

- whether to save: rank 0's save policies (its clock for ``every_seconds``), or any rank's ``force`` or
  preemption signal (a signal that reached one rank first still makes every rank save, and stop);
- whether a background save failed on some rank: then every rank waits for its own and raises.

When they save, rank 0 says whether the step is pinned (every rank then refuses).

Two gloo groups per manager: one for these foreground decisions, one for the saves the background thread
runs, so the two never interleave. ``restore_latest`` tries the checkpoints rank 0 lists, newest first, and
moves every rank on to the older one when any rank could not restore its part.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from trainstate._distributed import Coordinator, coordinator
from trainstate._distributed.group import Failure
from trainstate.errors import DistributedError, InvalidArgumentError

_managers = itertools.count()  # managers are built in the same order on every rank: same channel names


@dataclass(frozen=True)
class Decision:
    """What every rank does at one ``save()`` call."""

    by_policy: bool  # rank 0's save policies ask for a checkpoint
    preempting: bool  # a preemption signal reached some rank
    forced: bool  # some rank passed force=True
    failed: bool  # a background save failed on some rank


class ManagerRanks:
    """The ranks of one manager's process group: its two coordinators and the decisions they make."""

    def __init__(self, control: Coordinator, saves: Coordinator) -> None:
        self.control = control
        self.saves = saves
        self.rank = control.rank
        self.world = control.world

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that locks, sweeps, commits and applies retention."""
        return self.rank == 0

    def decide(self, step: int, by_policy: bool, preempting: bool, forced: bool, failed: bool) -> Decision:
        """Every rank's flags combined, the same on every rank; refuses ``save()`` calls for different steps."""
        lead = self.leader
        got = self.control.max(
            [step, -step, int(lead and by_policy), int(preempting), int(forced), int(failed)],
            "CheckpointManager.save()",
        )
        if got[0] != -got[1]:
            raise InvalidArgumentError(
                f"CheckpointManager.save() was called with different steps on the ranks ({-got[1]} to {got[0]}): "
                "under a process group every rank calls save() with the same step"
            )
        return Decision(*(bool(v) for v in got[2:]))

    def setup(self, error: BaseException | None) -> None:
        """After rank 0 locked and swept (or failed to): raise on every rank if any rank failed."""
        self.control.agree(error, "CheckpointManager setup")

    def from_leader(self, value: Any, what: str) -> Any:
        return self.control.broadcast(value, what)

    def outcomes(self, mine: Failure | None, what: str) -> list[Failure]:
        """Every rank's failure at one step (an empty list when all went well)."""
        return [f for f in self.control.all_gather(mine, what) if f is not None]


def manager_ranks(collective: bool | None, timeout: float | None) -> ManagerRanks | None:
    """The ranks a manager coordinates with: None outside a process group of several ranks, or when
    ``collective=False`` (each rank then manages a directory of its own)."""
    if collective is False:
        return None
    n = next(_managers)
    control = coordinator(timeout=timeout, channel=f"manager{n}")
    if control is None:
        if collective:
            raise InvalidArgumentError(
                "collective=True needs several processes: an initialized torch.distributed process group of several "
                "ranks, or jax.distributed.initialize() in a job of several processes"
            )
        return None
    saves = coordinator(timeout=timeout, channel=f"manager{n}-saves")
    assert saves is not None
    return ManagerRanks(control, saves)


def failed_elsewhere(world: int, refused: int | None = None) -> DistributedError:
    """What a rank whose own part did not fail raises for a background save that failed; ``refused``: the
    step whose state this rank could not encode (it raised that error at once), if that was the cause."""
    if refused is not None:
        return DistributedError(
            f"the background save of step {refused} failed on every one of the {world} ranks: this rank's state "
            "could not be saved (its error was raised by that save() call); nothing was committed for it"
        )
    return DistributedError(
        f"a background save failed on another of the {world} ranks (its error is raised there); nothing was "
        "committed for that step"
    )
