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
moves every rank on to the older one when any rank could not restore its part; its loads (and ``restore``'s)
are collective, on a third gloo group made at the first: the tensors several ranks hold are read once.

A manager outside a process group (or with ``collective=False``, or read-only) has a :class:`SingleProcess`
instead: the same methods, doing the one-process thing (rank 0 of 1, its own values are everyone's), so the
manager asks no "is there a group?" question after it has built one or the other.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol

from trainstate._distributed import Coordinator, coordinator
from trainstate._distributed.group import Failure, GlooCoordinator, release
from trainstate.errors import DistributedError, InvalidArgumentError


class AsyncWriter(Protocol):
    """What the ranks ask of the manager's background writer (``async_writer.py``, which imports this module)."""

    def wait(self) -> None: ...

    def ready(self, background: bool) -> None: ...

    def raise_pending(self) -> None: ...


class Committer(Protocol):
    """What the ranks ask of the manager's committer (``committer.py``, which imports this module)."""

    def refuse(self, step: int, error: Exception) -> None: ...


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

    relists = False  # restore_latest works from rank 0's one listing: a rank never lists again on its own

    def __init__(self, control: Coordinator, saves: Coordinator, channel: str = "manager") -> None:
        self.control = control
        self.saves = saves
        self._channel = channel
        self._loads: Coordinator | None = None
        self.rank = control.rank
        self.world = control.world
        self.shard: int | None = self.rank  # what save() encodes: this rank's part of the state
        self.refused: int | None = None  # an async save this rank could not encode, not yet reported by all

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that locks, sweeps, commits and applies retention."""
        return self.rank == 0

    @property
    def channel(self) -> str:
        """This manager's channel name: what its own coordinators' names start with."""
        return self._channel

    def release(self) -> None:
        """Give back the gloo groups of this manager's channels (its own, its loads', its local tier's): the
        manager is closed, nothing is exchanged on them again."""
        if isinstance(self.control, GlooCoordinator):
            release(self._channel)

    def loads(self) -> Coordinator | None:
        """The coordinator of this manager's collective loads (a gloo group of its own, made at the first
        restore, which every rank makes); None where it could move no tensor bytes (``jax.distributed``)."""
        if self._loads is None and self.control.sends_bytes:
            self._loads = coordinator(timeout=self.control.timeout, channel=f"{self._channel}-load")
        return self._loads

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

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed (``error``: this rank's failure, or None)."""
        self.control.agree(error, what)

    def from_leader(self, value: Any, what: str) -> Any:
        return self.control.broadcast(value, what)

    def outcomes(self, mine: Failure | None, what: str) -> list[Failure]:
        """Every rank's failure at one step (an empty list when all went well)."""
        return [f for f in self.control.all_gather(mine, what) if f is not None]

    def raise_failed(self, writer: AsyncWriter) -> None:
        """Every rank agreed that a background save failed: each waits for its own saves and raises."""
        writer.wait()  # raises this rank's error; every rank's part of that save failed
        refused, self.refused = self.refused, None
        raise failed_elsewhere(self.world, refused)

    def refuse(self, step: int, error: Exception, background: bool, writer: AsyncWriter, committer: Committer) -> None:
        """This rank could not encode its state for ``step``: the other ranks wait for its share, so it takes
        part in the save with its failure (they raise too), then raises ``error``."""
        writer.ready(background=False)
        self.refused = step if background else None  # the others learn of it at a later save()
        committer.refuse(step, error)


class SingleProcess:
    """A manager's stand-in for :class:`ManagerRanks` in one process: rank 0 of 1, and what it decides is what
    every rank decides."""

    rank = 0
    world = 1
    leader = True
    shard: int | None = None  # save() encodes the whole state, not a rank's part
    relists = True  # restore_latest lists again when retention deleted what it was reading

    def loads(self) -> Coordinator | None:
        return None  # one process: nothing to share

    def release(self) -> None:
        return None  # no coordination groups

    def decide(self, step: int, by_policy: bool, preempting: bool, forced: bool, failed: bool) -> Decision:
        return Decision(by_policy, preempting, forced, failed)

    def setup(self, error: BaseException | None) -> None:
        if error is not None:
            raise error

    def agree(self, error: BaseException | None, what: str) -> None:
        if error is not None:
            raise error

    def from_leader(self, value: Any, what: str) -> Any:
        return value

    def outcomes(self, mine: Failure | None, what: str) -> list[Failure]:
        return [] if mine is None else [mine]

    def raise_failed(self, writer: AsyncWriter) -> None:
        """A background save failed: its error, at once (saves still in flight go on)."""
        writer.raise_pending()

    def refuse(self, step: int, error: Exception, background: bool, writer: AsyncWriter, committer: Committer) -> None:
        """The state could not be encoded: nobody else waits for it."""
        raise error


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
    return ManagerRanks(control, saves, f"manager{n}")


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
