"""The global sample stream: one order per epoch, cut into global batches, each rank taking its slice.

This is what makes a data position independent of the number of ranks (docs/distributed.md, "Changing the
world size"). Framework-free (NumPy only): ``ResumableSampler(global_batch_size=...)`` serves it to a torch
DataLoader, :class:`GlobalBatches` to any loop (JAX).

The rules, for a dataset of ``total`` samples and a global batch of ``G``:

- **The epoch's order** is a permutation of ``range(total)`` drawn from (seed, epoch) (NumPy's PCG64; the
  identity without shuffling), made a whole number of global batches: cut short to a multiple of ``G``
  with ``drop_last=True`` (the tail is never seen that epoch), else padded with its own first indices, as
  ``DistributedSampler`` pads (those few samples are seen twice that epoch, at every world size alike).
- **Global batch b** is ``order[b*G : (b+1)*G]``. **Rank r of R** takes a contiguous slice of it: the
  first ``G % R`` ranks one sample more than the others (3 ranks, ``G`` = 32: 11, 11 and 10 samples, in
  that order). Each rank's slice is cut the same way into ``micro_batches`` micro-batches (gradient
  accumulation), so ``G`` must be at least ``R * micro_batches``.
- **The position** is (epoch, global batches done): the same numbers at every world size. A resume on any
  number of ranks continues the same global stream at the next global batch; the per-sample seeds come
  from (seed, epoch, index), so each sample's augmentation is the same too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np

from trainstate.errors import CorruptCheckpointError, InvalidArgumentError, StateMismatchError


def _count(value: Any, what: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise InvalidArgumentError(f"{what} must be an int of at least {least}, got {value!r:.40}")
    return int(value)


_MOST_SEED = 2**63 - 1  # PCG64 takes the seed and the epoch as non-negative words
_MOST_EPOCHS = 2**62


def _saved(state: dict[str, Any], name: str, least: int = 0, most: int = _MOST_SEED, default: int | None = None) -> int:
    """An int of a saved position, checked: a damaged or edited one is refused before it names samples."""
    value = state.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not least <= value <= most:
        raise CorruptCheckpointError(
            f"the saved data position's {name} is {value!r:.40}, not an int from {least} to {most}: the checkpoint "
            "is damaged or was edited; resume from another one"
        )
    return int(value)


def cut(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``parts`` contiguous parts of ``range(n)``: the first ``n % parts`` one longer."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


class SampleStream:
    """An epoch's global order and its global batches (see the module's rules).

    Args:
        total: samples in the dataset.
        global_batch_size: samples per global batch (per optimizer step, over every rank).
        seed: the shuffle seed.
        shuffle: a fresh permutation each epoch; False: the dataset's order.
        drop_last: cut the epoch short to whole global batches instead of padding it.
    """

    def __init__(
        self, total: int, global_batch_size: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = False
    ) -> None:
        self.total = _count(total, "the dataset's length")
        self.global_batch_size = _count(global_batch_size, "global_batch_size")
        if drop_last and self.global_batch_size > self.total:
            raise InvalidArgumentError(
                f"global_batch_size={self.global_batch_size} with drop_last=True is more than the dataset's "
                f"{self.total} samples: every epoch would be empty"
            )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= _MOST_SEED:
            raise InvalidArgumentError(f"seed must be an int from 0 to 2**63 - 1, got {seed!r:.40}")
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self._cached: tuple[tuple[int, int], np.ndarray] | None = None  # (seed, epoch): a restore sets the seed

    @property
    def batches(self) -> int:
        """Global batches per epoch."""
        whole, tail = divmod(self.total, self.global_batch_size)
        return whole if self.drop_last or not tail else whole + 1

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's global stream: ``batches * global_batch_size`` indices."""
        if self._cached is not None and self._cached[0] == (self.seed, epoch):
            return self._cached[1]
        if self.shuffle:
            order = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.total)
        else:
            order = np.arange(self.total)
        n = self.batches * self.global_batch_size
        if n > self.total:
            order = np.concatenate([order, np.resize(order, n - self.total)])
        self._cached = ((self.seed, epoch), order[:n])
        return self._cached[1]

    def check(self, world: int, micro_batches: int) -> None:
        """Refuse a split that would leave a rank's micro-batch empty."""
        if self.global_batch_size < world * micro_batches:
            raise InvalidArgumentError(
                f"a global batch of {self.global_batch_size} samples cannot be split into {micro_batches} "
                f"micro-batch(es) on each of {world} ranks: at least {world * micro_batches} samples are needed"
            )

    def share(self, epoch: int, batch: int, rank: int, world: int, micro_batches: int = 1) -> list[np.ndarray]:
        """Rank ``rank``'s micro-batches of global batch ``batch`` of ``epoch`` (indices into the dataset)."""
        g = self.global_batch_size
        begin, end = cut(g, world, rank)
        mine = self.order(epoch)[batch * g + begin : batch * g + end]
        return [mine[slice(*cut(len(mine), micro_batches, j))] for j in range(micro_batches)]


class Position:
    """Where a global stream stands: the epoch, the global batches of it done, and the micro-batches of the
    next one received (the same numbers on every rank of a job that steps together)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.batches = 0
        self.micro = 0

    def state(self, stream: SampleStream, world: int, micro_batches: int) -> dict[str, Any]:
        return {
            "seed": stream.seed,
            "epoch": self.epoch,
            "batches": self.batches,
            "micro": self.micro,
            "samples": self.batches * stream.global_batch_size,
            "global_batch_size": stream.global_batch_size,
            "total": stream.total,
            "shuffle": stream.shuffle,
            "drop_last": stream.drop_last,
            "world_size": world,
            "micro_batches": micro_batches,
        }

    def load(
        self, state: dict[str, Any], stream: SampleStream, world: int, micro_batches: int, roll: bool = True
    ) -> bool:
        """Continue from ``state``; True when a global batch begun on other ranks (or with another number of
        micro-batches) is started again from its first sample. A position at the end of an epoch moves to the
        next one's start (``roll=False``: it stays at the end, for a loop that ends that epoch itself).

        Raises:
            StateMismatchError: the saved stream is another one (global batch size, dataset length, drop_last,
                shuffle): the same position would name other samples.
        """
        differ = [
            (name, f"{name}={getattr(stream, name)!r}", f"{name}={state.get(name)!r}")
            for name in ("global_batch_size", "total", "shuffle", "drop_last")
            if state.get(name) != getattr(stream, name)
        ]
        if differ:
            raise StateMismatchError(
                [],
                [],
                differ,
                hint="the sampler's global stream differs from the saved one, so the saved position would name other "
                "samples: keep global_batch_size (change the micro-batches per rank instead), the dataset and "
                "drop_last / shuffle as saved",
            )
        saved_world = _saved(state, "world_size", 1, default=world)
        saved_micro_batches = _saved(state, "micro_batches", 1, default=micro_batches)
        stream.seed = _saved(state, "seed")
        self.epoch, self.batches = _saved(state, "epoch", most=_MOST_EPOCHS), _saved(state, "batches")
        same = saved_world == world and saved_micro_batches == micro_batches
        micro = _saved(state, "micro", most=saved_micro_batches - 1, default=0)
        self.micro = micro if same else 0
        if roll and self.batches >= stream.batches:  # the epoch's last global batch was taken
            self.epoch, self.batches, self.micro = self.epoch + 1, 0, 0
        return micro > 0 and not same

    def taken(self, micro_batches: int) -> int:
        """Micro-batches of the epoch taken so far (on each rank)."""
        return self.batches * micro_batches + self.micro

    def received(self, micro_batches: int) -> None:
        self.micro += 1
        if self.micro >= micro_batches:
            self.batches, self.micro = self.batches + 1, 0

    def next_epoch(self) -> None:
        self.epoch, self.batches, self.micro = self.epoch + 1, 0, 0


class GlobalBatches:
    """A resumable iterator over this rank's micro-batches of the global sample stream, for any loop (JAX,
    NumPy): each item is an array of dataset indices. What it yielded counts as consumed.

    Args:
        data_source: the dataset, or its length.
        global_batch_size: samples per global batch (per optimizer step, over every process).
        seed: the shuffle seed.
        shuffle: a fresh permutation each epoch; False: the dataset's order.
        drop_last: end each epoch at its last whole global batch instead of padding the last one.
        rank: this process's place among the data-parallel processes.
        world_size: the number of data-parallel processes.
        micro_batches: micro-batches per global batch on each rank (gradient accumulation).

    Example:
        >>> batches = trainstate.GlobalBatches(len(ds), global_batch_size=64, rank=jax.process_index(),
        ...                                    world_size=jax.process_count())
        >>> state = {"params": params, "data": batches}
        >>> for indices in batches: ...    # one epoch; the next ``for`` runs the next one
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        micro_batches: int = 1,
    ) -> None:
        total = int(data_source) if isinstance(data_source, (int, np.integer)) else len(data_source)
        self.stream = SampleStream(total, global_batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)
        self.world_size = _count(world_size, "world_size")
        self.rank = _count(rank, "rank", 0)
        if self.rank >= self.world_size:
            raise InvalidArgumentError(f"rank must be in 0..world_size-1, got rank={rank} of world_size={world_size}")
        self.micro_batches = _count(micro_batches, "micro_batches")
        self.stream.check(self.world_size, self.micro_batches)
        self.position = Position()
        self._taken = 0  # micro-batches of the epoch taken when the current iteration began (its len)

    @property
    def epoch(self) -> int:
        """The epoch being iterated (the next one, once an epoch's iterator ran to its end).

        Example:
            >>> batches = trainstate.GlobalBatches(60, global_batch_size=12)
            >>> _ = list(batches); batches.epoch
            1
        """
        return self.position.epoch

    def __iter__(self) -> Iterator[np.ndarray]:
        """The rest of the current epoch's micro-batches for this rank; the epoch ends with the iterator."""
        p = self.position
        if p.batches >= self.stream.batches:  # a loop took the last micro-batch and stopped (zip, islice)
            p.next_epoch()
        self._taken = p.taken(self.micro_batches)
        return self._rest()

    def _rest(self) -> Iterator[np.ndarray]:
        p, k = self.position, self.micro_batches
        while p.batches < self.stream.batches:
            parts = self.stream.share(p.epoch, p.batches, self.rank, self.world_size, k)
            part = parts[p.micro]
            p.received(k)
            yield part
        p.next_epoch()
        self._taken = 0

    def __len__(self) -> int:
        """The micro-batches of the epoch this iteration yields (fixed while it runs)."""
        return self.stream.batches * self.micro_batches - self._taken

    def state_dict(self) -> dict[str, Any]:
        """The global position (the same on every rank): restores at any world size.

        Example:
            >>> batches = trainstate.GlobalBatches(60, global_batch_size=12)
            >>> _ = next(iter(batches)); batches.state_dict()["batches"]
            1
        """
        return self.position.state(self.stream, self.world_size, self.micro_batches)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved stream at its next global batch (see :meth:`Position.load`).

        Raises:
            StateMismatchError: the saved stream is another one (global batch size, dataset length, drop_last,
                shuffle).

        Example:
            >>> three = trainstate.GlobalBatches(60, global_batch_size=12, rank=0, world_size=3)
            >>> three.load_state_dict(saved_by_four_ranks)   # usually through trainstate.load / restore_latest
        """
        p = self.position
        p.load(dict(state), self.stream, self.world_size, self.micro_batches)
        self._taken = p.taken(self.micro_batches)
