"""ExactResume over the global sample stream: a Lightning training loader whose batch sampler is a
``ResumableSampler(global_batch_size=...)`` resumes at any number of processes.

Such a loader needs no replay. Its order is drawn from (seed, epoch), each rank takes its slice of every global
batch, and every sample's randomness is seeded from (seed, epoch, index), so fetching never moves the loop's
generators. What a checkpoint needs is where the stream stands after the batches trained on: the sampler itself
counts what the loader handed out, which runs a batch ahead of training (Lightning prefetches), so the position
saved is where the loader's current iterator started plus the batches Lightning trained since (:class:`Stream`),
the same numbers on every rank.

Lightning resumes its own counters from the checkpoint and ends the epoch when they reach ``len(loader)``,
computed once as fitting starts: the sampler reports the whole epoch's length here (not what is left of it, as
in a plain loop), and the number of micro-batches per global batch (``accumulate_grad_batches``) must stay as
saved, or Lightning's restored count would name another place in the stream than the sampler's.

At the number of processes that saved, each rank gets its own generators back. At another, every rank's are
re-derived from (the stream's seed, the step saved, its rank) by RNGState's documented rule.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

from trainstate._data import ResumableSampler, watch
from trainstate._rng import RNGState
from trainstate.errors import CorruptCheckpointError, InvalidArgumentError, StateMismatchError

log = logging.getLogger("trainstate")


def global_sampler(loader: Any) -> ResumableSampler | None:
    """The loader's batch sampler when it is a ResumableSampler over the global stream; else None."""
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, ResumableSampler) and sampler._stream is not None:
        return sampler
    return None


class Stream:
    """The training loader's global-stream sampler under ExactResume, and how many of the current iterator's
    batches Lightning trained on (it watches the loader's iterators, ``trainstate._data.watch``).

    The position saved is where the iterator started plus what was trained since: Lightning's own counters
    (its epoch, its batches) name the same place only while a Lightning epoch is a stream epoch, which
    ``limit_train_batches``, ``max_steps`` stopping mid-epoch and a reloaded loader break."""

    def __init__(self, sampler: ResumableSampler, loader: Any) -> None:
        if sampler._loader is not loader:
            sampler.attach(loader)
        sampler._len_whole_epoch = True  # Lightning counts a resumed epoch from its start
        self.sampler = sampler
        self.start: tuple[int, int] | None = None  # (epoch, micro-batches taken) where the iterator started
        self.trained = 0  # batches of the current iterator Lightning trained on
        watch(loader, self)

    def iterator_starting(self, loader: Any) -> None:
        pass

    def iterator_started(self, it: Any) -> Any:
        self.start, self.trained = (self.sampler._position.epoch, self.sampler._taken), 0
        return it

    def batch_trained(self) -> None:
        self.trained += 1

    def position(self, accumulating: int) -> dict[str, Any]:
        """The stream's position after the batches Lightning trained on (not those it prefetched)."""
        if self.start is None:  # no iterator yet: where the sampler stands
            return self.sampler.state_dict()
        epoch, taken = self.start
        k = self.sampler.micro_batches
        taken += self.trained
        if taken % k:
            warnings.warn(
                f"ExactResume: this checkpoint is taken after micro-batch {taken % k} of a global batch of {k}, in the "
                f"middle of accumulating gradients over {accumulating} batches; the gradients are not in a "
                "checkpoint, so a run resumed from it is not exact: save every multiple of accumulate_grad_batches "
                "(val_check_interval too, when ModelCheckpoint saves after validation)",
                stacklevel=3,
            )
        return self.sampler._state_at(epoch, taken // k, taken % k)

    def close(self, loader: Any) -> None:
        watch(loader, None)
        self.sampler._len_whole_epoch = False


def check(sampler: ResumableSampler, trainer: Any) -> None:
    """Refuse a sampler cut for another job than the trainer's (ranks, micro-batches)."""
    world, rank = int(trainer.world_size), int(trainer.global_rank)
    if (sampler.num_replicas, sampler.rank) != (world, rank):
        raise InvalidArgumentError(
            f"ExactResume: the ResumableSampler is rank {sampler.rank} of num_replicas={sampler.num_replicas}, but "
            f"this process is rank {rank} of {world}: build it in train_dataloader() with "
            "num_replicas=self.trainer.world_size, rank=self.trainer.global_rank"
        )
    if sampler.micro_batches != int(trainer.accumulate_grad_batches):
        raise InvalidArgumentError(
            f"ExactResume: the ResumableSampler cuts each global batch into micro_batches={sampler.micro_batches} "
            f"per rank, but the Trainer accumulates gradients over {trainer.accumulate_grad_batches} batches: "
            "make them equal, so each optimizer step takes one global batch"
        )


def _count(value: Any, what: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise CorruptCheckpointError(
            f"ExactResume: the checkpoint's {what} is {value!r:.40}, not an int of at least {least}: the checkpoint "
            "is damaged or was edited; resume from another one"
        )
    return value


def resume(sampler: ResumableSampler, saved: Mapping[str, Any], mid_epoch: bool = False) -> None:
    """Continue the stream from the position ``saved`` (at any world size, the same micro-batches).
    ``mid_epoch``: Lightning resumes in the middle of its epoch; a position at the stream epoch's end then ends
    that Lightning epoch (as the interrupted run's iterator did), rather than feeding it the next stream epoch."""
    state = dict(saved)
    k = _count(state.get("micro_batches", sampler.micro_batches), "stream's micro_batches", 1)
    if k != sampler.micro_batches and (_count(state.get("batches", 0), "stream's batches") or state.get("micro")):
        raise StateMismatchError(
            [],
            [],
            [("micro_batches", f"micro_batches={sampler.micro_batches}", f"micro_batches={k}")],
            hint="Lightning resumes its count of the epoch's batches from the checkpoint, in the micro-batches it "
            "saved with: keep accumulate_grad_batches and the sampler's micro_batches as saved, and change the "
            "per-rank batch size instead (global_batch_size stays)",
        )
    sampler._load_stream(state, hold_end=mid_epoch)


def generators(state: Mapping[str, Any], rank: int, world: int) -> Mapping[str, Any] | None:
    """This rank's generators: its own at the number of ranks that saved, else re-derived (None: re-derived
    and set here, there being nobody's to restore)."""
    ranks = state.get("ranks")
    every: list[Any] = ranks if isinstance(ranks, list) and ranks else [state]
    saved = len(every)
    if saved == world:
        own: Mapping[str, Any] = every[rank]["rng"]
        return own
    stream = state.get("stream")
    seed = _count(stream.get("seed") if isinstance(stream, Mapping) else None, "stream's seed")
    step = _count(state.get("step", 0), "step")
    log.info(
        "ExactResume: %d process(es) saved this checkpoint and %d resume it: rank %d's generators are re-derived "
        "from (seed %d, step %d, rank)",
        saved,
        world,
        rank,
        seed,
        step,
    )
    RNGState(seed=seed).rederive(rank, step)
    return None
