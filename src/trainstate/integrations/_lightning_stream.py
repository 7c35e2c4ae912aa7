"""ExactResume over the global sample stream: a Lightning training loader whose batch sampler is a
``ResumableSampler(global_batch_size=...)`` resumes at any number of processes.

Such a loader needs no replay. Its order is drawn from (seed, epoch), each rank takes its slice of every global
batch, and every sample's randomness is seeded from (seed, epoch, index), so fetching never moves the loop's
generators. What a checkpoint needs is where the epoch stands, as Lightning counts it: the sampler itself counts
what the loader handed out, which runs a batch ahead of training (Lightning prefetches), so the position saved is
Lightning's epoch and the micro-batches it trained (``batch_progress``), the same numbers on every rank.

Lightning resumes its own counters from the checkpoint and ends the epoch when they reach ``len(loader)``,
computed once as fitting starts: the sampler reports the whole epoch's length here (not what is left of it, as
in a plain loop), and the number of micro-batches per global batch (``accumulate_grad_batches``) must stay as
saved, or Lightning's restored count would name another place in the stream than the sampler's.

At the number of processes that saved, each rank gets its own generators back. At another, every rank's are
re-derived from (the stream's seed, the step saved, its rank) by RNGState's documented rule.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from trainstate._data import ResumableSampler
from trainstate._rng import RNGState
from trainstate.errors import InvalidArgumentError, StateMismatchError

log = logging.getLogger("trainstate")


def global_sampler(loader: Any) -> ResumableSampler | None:
    """The loader's batch sampler when it is a ResumableSampler over the global stream; else None."""
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, ResumableSampler) and sampler._stream is not None:
        return sampler
    return None


def take(sampler: ResumableSampler, loader: Any) -> None:
    """Attach ``sampler`` to ``loader`` (if the user did not) and have it report the whole epoch's length."""
    if sampler._loader is not loader:
        sampler.attach(loader)
    sampler._len_whole_epoch = True


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


def position(sampler: ResumableSampler, trainer: Any) -> dict[str, Any]:
    """The stream's position after the batches Lightning trained on in this epoch (not those it prefetched)."""
    assert sampler._stream is not None
    trained = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
    k = sampler.micro_batches
    return sampler._state_at(int(trainer.current_epoch), trained // k, trained % k)


def resume(sampler: ResumableSampler, saved: Mapping[str, Any]) -> None:
    """Continue the stream from the position ``saved`` (at any world size, the same micro-batches)."""
    state = dict(saved)
    k = int(state.get("micro_batches", sampler.micro_batches))
    if k != sampler.micro_batches and (int(state.get("batches", 0)) or int(state.get("micro", 0))):
        raise StateMismatchError(
            [],
            [],
            [("micro_batches", f"micro_batches={sampler.micro_batches}", f"micro_batches={k}")],
            hint="Lightning resumes its count of the epoch's batches from the checkpoint, in the micro-batches it "
            "saved with: keep accumulate_grad_batches and the sampler's micro_batches as saved, and change the "
            "per-rank batch size instead (global_batch_size stays)",
        )
    sampler.load_state_dict(state)


def generators(state: Mapping[str, Any], rank: int, world: int) -> Mapping[str, Any] | None:
    """This rank's generators: its own at the number of ranks that saved, else re-derived (None: re-derived
    and set here, there being nobody's to restore)."""
    ranks = state.get("ranks")
    saved = len(ranks) if ranks else 1
    if saved == world:
        own: Mapping[str, Any] = ranks[rank]["rng"] if ranks else state["rng"]
        return own
    seed, step = int(state["stream"]["seed"]), int(state.get("step", 0))
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
