"""Replay a DataLoader's interrupted epoch, for loaders a training framework iterates (Lightning's).

A framework that resumes mid-epoch starts the loader's iterator again, and a plain ``DataLoader`` then
begins a new epoch: a new shuffle (the sampler draws its seed from torch's RNG when it starts), new worker
seeds (the iterator draws a base seed), and every random number after it (dropout) shifted. trainstate's
own loop recipe avoids this with :class:`~trainstate.ResumableSampler`; here the loader is the user's, so
the epoch is replayed instead.

An uninterrupted epoch: the iterator starts from RNG state ``E`` (its base seed and the sampler's seed come
from it), and the loop pulls batches 0..p-1 while it trains on 0..k-1 (a framework pulls ahead: Lightning
keeps one batch prefetched). A save after step k-1 records ``E``, ``k``, ``p``, the RNG right before each pull
it has not trained on yet (k..p-1), and the RNG at the save. The resumed run, when its iterator starts:
torch's, NumPy's and Python's RNG (and the loader's and sampler's generators) are set to ``E``; batches 0..k-1
are pulled and dropped (loaded again, so worker processes' own random streams advance exactly as they did);
batches k..p-1 are pulled, each from the RNG it was pulled from, and kept for the loop; then the RNG of the
save is put back. From there on the resumed run is the uninterrupted one. The cost is loading k batches
again (not training on them).

A ``DistributedSampler`` (Lightning's under DDP) draws its shuffle from ``(seed, epoch)``, its epoch set by the
framework through ``set_epoch``. A framework may start the resumed epoch's iterator before it sets that epoch
(Lightning does), so the epoch the interrupted iterator started under is recorded too and set again before the
replay.

Persistent workers (``persistent_workers=True``) keep their random streams across epochs, which no replay of
one epoch reproduces: they are refused.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

from trainstate._data import ResumableSampler, _hooks, watch
from trainstate._optional import optional
from trainstate._rng import RNGState
from trainstate.errors import CheckpointError, InvalidArgumentError

with optional("torch", extra="torch", needed_for="trainstate._replay"):
    import torch
    from torch.utils.data import DataLoader

log = logging.getLogger("trainstate")

_KEEP = 8  # RNG states kept for the last pulls: a loop more than this many batches ahead cannot be replayed


class EpochReplay:
    """Watches one DataLoader's iterators; records where an epoch stands and replays it after a restore.

    Example:
        >>> replay = EpochReplay(loader)
        >>> position = replay.position(trained=batches_done)     # at a save, with RNGState().state_dict()
        >>> replay.resume(position, rng_at_save)                  # in the resumed run, before its first epoch
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        if not isinstance(loader, DataLoader):
            raise InvalidArgumentError(
                f"exact resume replays a torch DataLoader's epoch; found {type(loader).__qualname__}: "
                "return a torch.utils.data.DataLoader from train_dataloader()"
            )
        if loader.persistent_workers and loader.num_workers > 0:
            raise InvalidArgumentError(
                "exact resume cannot replay a DataLoader with persistent_workers=True: its workers keep their "
                "random streams from epoch to epoch, which a resumed run cannot rebuild; use "
                "persistent_workers=False"
            )
        if _hooks(loader).counter is not None or isinstance(loader.sampler, ResumableSampler):
            raise InvalidArgumentError(
                "this DataLoader has a trainstate.ResumableSampler, which resumes its position itself; "
                "exact resume replays plain DataLoaders: use one or the other"
            )
        self._epoch_start: dict[str, Any] | None = None  # RNG the current epoch's iterator started from
        self._sampler_epoch: int | None = None  # the set_epoch value it started under (a DistributedSampler)
        self._pulled = 0  # batches pulled from the current iterator
        self._before: deque[tuple[int, dict[str, Any]]] = deque(maxlen=_KEEP)  # (pull, RNG right before it)
        self._plan: dict[str, Any] | None = None
        self._start_from: Mapping[str, Any] | None = None  # RNG each iterator starts from until one yields
        watch(loader, self)

    def close(self, loader: DataLoader[Any]) -> None:
        """Stop watching ``loader``."""
        watch(loader, None)

    def position(self, trained: int) -> dict[str, Any] | None:
        """Where the current epoch stands once the loop has trained on ``trained`` of its batches (None
        before any iterator started): what :meth:`resume` takes."""
        if self._epoch_start is None:
            return None
        if trained > self._pulled:
            raise CheckpointError(
                f"exact resume: the loop reports {trained} batches trained in this epoch, but only "
                f"{self._pulled} were pulled from this DataLoader's iterator (is another loader feeding it?)"
            )
        kept = dict(self._before)
        in_flight = [kept.get(j) for j in range(trained, self._pulled)]
        if any(s is None for s in in_flight):
            log.warning(
                "exact resume: the loop is %d batches ahead of training, more than the %d whose RNG is kept; "
                "those batches will be loaded from other random numbers after a resume",
                self._pulled - trained,
                _KEEP,
            )
        position: dict[str, Any] = {
            "epoch_start": self._epoch_start,
            "trained": trained,
            "pulled": self._pulled,
            "in_flight": [s if s is not None else {} for s in in_flight],
        }
        if self._sampler_epoch is not None:
            position["sampler_epoch"] = self._sampler_epoch
        return position

    def resume(self, position: Mapping[str, Any] | None, rng_at_save: Mapping[str, Any]) -> None:
        """Replay the epoch ``position`` describes when the loader's next iterator starts, then set the RNG
        to ``rng_at_save`` (a :meth:`rng` state).

        Without a position (the save came at an epoch's end) the next epoch starts from ``rng_at_save``:
        every iterator started before one yields a batch starts from it (a framework may start one for
        the epoch that had ended, and drop it, which the interrupted run never did).
        """
        if position is None:
            self._plan, self._start_from = None, rng_at_save
            return
        trained, pulled = int(position["trained"]), int(position["pulled"])
        in_flight = list(position["in_flight"])
        if not 0 <= trained <= pulled or len(in_flight) != pulled - trained:
            raise CheckpointError(
                f"exact resume: a damaged loader position (trained {trained}, pulled {pulled}, "
                f"{len(in_flight)} in flight)"
            )
        self._plan = {
            "epoch_start": position["epoch_start"],
            "trained": trained,
            "in_flight": in_flight,
            "at_save": rng_at_save,
            "sampler_epoch": position.get("sampler_epoch"),  # absent from checkpoints saved before it was kept
        }
        self._start_from = None

    @staticmethod
    def rng(loader: DataLoader[Any]) -> dict[str, Any]:
        """The generators a resumed epoch needs back: torch's, NumPy's, Python's, and the loader's and its
        sampler's own."""
        return RNGState(torch_generators=_generators(loader)).state_dict()

    # -- the loader's hook (trainstate._data) ------------------------------------------------------

    def iterator_starting(self, loader: DataLoader[Any]) -> None:
        rng = RNGState(torch_generators=_generators(loader))
        if self._start_from is not None:
            rng.load_state_dict(self._start_from)
        sampler = _epoch_sampler(loader)
        if self._plan is not None:
            rng.load_state_dict(self._plan["epoch_start"])
            if getattr(loader, "next_iter_state", None) is not None:  # torchdata's own resume: we replay instead
                loader.next_iter_state = None
            if sampler is not None and self._plan["sampler_epoch"] is not None:
                sampler.set_epoch(int(self._plan["sampler_epoch"]))  # its shuffle is drawn when the replay pulls
        self._epoch_start = rng.state_dict()
        self._sampler_epoch = int(sampler.epoch) if sampler is not None else None
        self._pulled = 0
        self._before.clear()

    def iterator_started(self, it: Any) -> Any:
        replaying = _ReplayingIterator(it, self)
        plan, self._plan = self._plan, None
        if plan is not None:
            replaying.replay(plan)
        return replaying

    def _pull(self, it: Any) -> Any:
        self._before.append((self._pulled, RNGState().state_dict()))
        batch = next(it)
        self._pulled += 1
        self._start_from = None  # the resumed epoch is under way
        return batch


class _ReplayingIterator:
    def __init__(self, it: Any, owner: EpochReplay) -> None:
        self._it = it
        self._owner = owner
        self._ready: deque[Any] = deque()  # batches replayed for the loop, handed out first

    def __iter__(self) -> _ReplayingIterator:
        return self

    def __next__(self) -> Any:
        if self._ready:
            return self._ready.popleft()
        return self._owner._pull(self._it)

    def replay(self, plan: Mapping[str, Any]) -> None:
        trained = plan["trained"]
        try:
            for _ in range(trained):
                next(self._it)
                self._owner._pulled += 1
            for rng in plan["in_flight"]:
                if rng:
                    RNGState().load_state_dict(rng)
                self._ready.append(self._owner._pull(self._it))
        except StopIteration:
            raise CheckpointError(
                f"exact resume: the interrupted epoch had trained on {trained} batches, but this DataLoader's "
                f"epoch ended after {self._owner._pulled}: the dataset, batch size or sampler changed since the save"
            ) from None
        RNGState().load_state_dict(plan["at_save"])

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


def _epoch_sampler(loader: DataLoader[Any]) -> Any:
    """The loader's sampler when it shuffles by an epoch number set from outside (``DistributedSampler``,
    Lightning's ``DistributedSamplerWrapper``): an int ``epoch`` and a ``set_epoch``; else None."""
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    epoch = getattr(sampler, "epoch", None)
    if isinstance(epoch, int) and not isinstance(epoch, bool) and callable(getattr(sampler, "set_epoch", None)):
        return sampler
    return None


def _generators(loader: DataLoader[Any]) -> dict[str, Any]:
    """The loader's and its sampler's own torch generators, which a shuffling epoch draws from."""
    found = {}
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    for name, g in (("loader", loader.generator), ("sampler", getattr(sampler, "generator", None))):
        if isinstance(g, torch.Generator):
            found[name] = g
    return found
