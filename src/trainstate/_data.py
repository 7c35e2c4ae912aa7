"""The data position: a resumable sampler for plain DataLoaders, per-sample seeding, and the RNG trap.

Starting a DataLoader iterator draws a base seed from torch's global RNG (a resumed StatefulDataLoader's
too). An uninterrupted run drew it at the start of the epoch; a resumed run draws it again mid-epoch,
right after the RNG was restored — so every dropout mask after the resume would differ. trainstate arms a
one-shot hook on each restored loader: once the first iterator after a restore exists, torch's RNG is put
back to the restored state. The natural loop — restore, then ``for batch in loader:`` — is then exact.

Plain DataLoader users get :class:`ResumableSampler`: a per-epoch permutation from ``(seed, epoch)``
that knows how many samples the loop has really consumed (not how many workers prefetched) and, on
resume, starts the iterator with the same base seed the interrupted epoch had.

Randomness inside ``Dataset.__getitem__`` (augmentation, token masking) is seeded per sample
(:mod:`trainstate._seeding`): right before ``dataset[index]`` Python's ``random``, NumPy's global generator
and torch's CPU generator are seeded from the sample's (seed, epoch, index), in worker processes and with
``num_workers=0`` alike. This replaces torch's per-worker streams, whose draws depended on which worker
served a sample and what it served before — which a resume cannot reproduce. A loader attached to a
ResumableSampler gets it from ``attach()``; any other map-style loader (torchdata's StatefulDataLoader) from
:func:`seed_per_sample`, called before its first epoch in every run.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections.abc import Callable, Iterator, Sized
from typing import Any, Protocol, TypeVar

from trainstate._optional import optional

with optional("torch", extra="torch", needed_for="trainstate._data (ResumableSampler)"):
    import torch
    from torch.utils.data import DataLoader, IterableDataset, Sampler

from trainstate import _seeding as seeding
from trainstate._sample_stream import Position, SampleStream
from trainstate.errors import CheckpointError, InvalidArgumentError

log = logging.getLogger("trainstate")
_HOOK = "_get_iterator"
_BASE_SEED = "_base_seed"  # the key torchdata's multi-process state keeps it under; trainstate adds it for 0 workers
L = TypeVar("L", bound=DataLoader[Any])


class ResumableSampler(Sampler[int]):
    """A shuffling (or sequential) sampler that resumes mid-epoch exactly.

    Args:
        data_source: the dataset, or its length.
        shuffle: a fresh permutation each epoch, drawn from ``seed + epoch`` (never the global RNG).
        seed: the shuffle seed.
        num_replicas: data-parallel ranks sharing the epoch. Without ``global_batch_size`` (as
            ``DistributedSampler``) each takes every ``num_replicas``-th index of the epoch's order from ``rank`` on,
            the order padded with its own first indices to a multiple of ``num_replicas``; with it, each takes its
            contiguous slice of every global batch. Default 1: the whole dataset. Pass both explicitly under DDP
            (e.g. ``dist.get_world_size()`` and ``dist.get_rank()``).
        rank: this rank's place among the ``num_replicas``.
        global_batch_size: one global sample stream for every world size (docs/distributed.md, "Changing
            the world size"): each epoch's order (from ``seed`` and the epoch) is cut into global batches of
            this many samples, and each of the ``num_replicas`` ranks takes its contiguous slice of each, cut
            into ``micro_batches``. The sampler is then a *batch* sampler
            (``DataLoader(ds, batch_sampler=sampler)``) and its position is global: it restores on any number
            of ranks. Default None: the per-rank stream above, restored at the same world size only.
        micro_batches: with ``global_batch_size``, micro-batches per global batch on each rank (gradient
            accumulation: the loop steps the optimizer after each ``micro_batches`` batches).
        drop_last: with ``global_batch_size``, end each epoch at its last whole global batch instead of
            padding the last one with the epoch's first samples.

    Attributes:
        epoch: the epoch being iterated (the next one, once an epoch's last batch was taken and a new
            iterator starts); restored with the sampler.
        seed: the shuffle seed.

    Under torch.distributed its position is saved per rank (each rank's loader drew its own base seed), so
    a resume at the same world size is exact; a different world size is refused by the restore. With
    ``global_batch_size`` the position is one for the whole job, and a resume at any world size continues
    the same global stream.

    Once attached, it yields indices that carry their sample's seed (``int`` subclasses), and the loader's
    dataset sees each sample with the global generators seeded from (``seed``, epoch, index).

    Example:
        >>> sampler = trainstate.ResumableSampler(dataset, seed=0)
        >>> loader = sampler.attach(DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2))
        >>> state = {"model": model, "optim": opt, "sampler": sampler, "rng": trainstate.RNGState()}
    """

    __trainstate_per_rank__ = True

    def __init__(
        self,
        data_source: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        global_batch_size: int | None = None,
        micro_batches: int = 1,
        drop_last: bool = False,
    ) -> None:
        for value, what, least in (
            (num_replicas, "num_replicas", 1),
            (rank, "rank", 0),
            (micro_batches, "micro_batches", 1),
        ):
            if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < least:
                raise InvalidArgumentError(
                    f"ResumableSampler: {what} must be an int of at least {least}, got {value!r:.40}"
                )
        num_replicas, rank = operator.index(num_replicas), operator.index(rank)
        micro_batches = operator.index(micro_batches)
        if num_replicas < 1 or rank >= num_replicas:
            raise InvalidArgumentError(
                f"ResumableSampler: rank must be in 0..num_replicas-1, got rank={rank} of num_replicas={num_replicas}"
            )
        self.total = len(data_source) if isinstance(data_source, Sized) else operator.index(data_source)
        self.num_replicas, self.rank = num_replicas, rank
        self.n = -(-self.total // num_replicas)  # this rank's samples per epoch
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._start = 0  # position the current epoch's iterator started from
        self._batches = 0  # batches the loop has received from it
        self._loader: DataLoader[Any] | None = None
        self._batch_size = 1
        self._loader_rng: torch.Tensor | None = None  # RNG the epoch's iterator drew its base seed from
        self._resume_rng: torch.Tensor | None = None
        # the global stream (global_batch_size): one position for the job, saved as plain values on every rank
        self.micro_batches = micro_batches
        self._stream: SampleStream | None = None
        self._position = Position()
        self._taken = 0  # micro-batches of the epoch taken when the current iterator started (its len)
        self._len_whole_epoch = False  # a framework counts the epoch from its start (Lightning): len is all of it
        self._hold_end = False  # the next iterator ends the epoch the position is at the end of (_load_stream)
        self._restored = False  # loaded from a checkpoint, its next iterator not started yet
        if global_batch_size is not None:
            self._stream = SampleStream(self.total, global_batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)
            self._stream.check(num_replicas, micro_batches)
        self.__trainstate_per_rank__ = self._stream is None  # a global position is the same on every rank

    def attach(self, loader: DataLoader[Any]) -> DataLoader[Any]:
        """Count what ``loader`` actually hands to the loop and seed its samples; returns the loader.

        Raises:
            InvalidArgumentError: ``loader`` was not built with this sampler (with ``global_batch_size``: as its
                ``batch_sampler``), or has no fixed batch size (a ValueError too).

        Example:
            >>> sampler = trainstate.ResumableSampler(dataset, seed=0)
            >>> loader = sampler.attach(DataLoader(dataset, batch_size=32, sampler=sampler))
        """
        if self._stream is not None:
            if loader.batch_sampler is not self:
                raise InvalidArgumentError(
                    "a ResumableSampler with global_batch_size is a batch sampler: build the loader with "
                    "DataLoader(dataset, batch_sampler=sampler) and pass that loader to attach()"
                )
            self._loader = loader
            _hooks(loader).counter = self
            return seed_per_sample(loader)
        if loader.sampler is not self and getattr(loader.batch_sampler, "sampler", None) is not self:
            raise InvalidArgumentError("attach() takes the DataLoader built with this sampler")
        size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        if not isinstance(size, int) or size < 1:
            raise InvalidArgumentError(
                "ResumableSampler needs a fixed batch size (batch_size=, or a BatchSampler) to count consumed samples"
            )
        self._batch_size = size
        self._loader = loader
        _hooks(loader).counter = self
        return seed_per_sample(loader)

    @property
    def consumed(self) -> int:
        """Samples of this epoch the loop has received (not what workers prefetched): where a resume starts.
        With ``global_batch_size``: the samples of the global batches done, over every rank (a global batch
        counts once its last micro-batch was received).

        Example:
            >>> next(iter(loader)); sampler.consumed    # after one batch of 32
            32
        """
        if self._stream is not None:
            return self._position.batches * self._stream.global_batch_size
        return min(self.n, self._start + self._batches * self._batch_size)

    def _order(self) -> list[int]:
        """This rank's indices of the epoch, in order."""
        if not self.shuffle:
            order = list(range(self.total))
        else:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.total, generator=g).tolist()
        if self.num_replicas == 1:
            return order
        padded = order + (order * self.num_replicas)[: self.n * self.num_replicas - self.total]
        return padded[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[Any]:
        if self._stream is not None:
            return self._global_batches()
        order = self._order()[self._start :]
        if self._loader is None:
            return iter(order)
        key = seeding.epoch_seed(self.seed, self.epoch)
        return (seeding.SeededIndex(i, seeding.sample_seed(key, i)) for i in order)

    def _global_batches(self) -> Iterator[list[int]]:
        """This rank's micro-batches of the rest of the epoch's global stream, from the position now."""
        stream, p, k = self._stream, self._position, self.micro_batches
        assert stream is not None
        key = seeding.epoch_seed(stream.seed, p.epoch)
        first = p.micro
        for b in range(p.batches, stream.batches):
            parts = stream.share(p.epoch, b, self.rank, self.num_replicas, k)
            for part in parts[first:]:
                if self._loader is None:
                    yield part.tolist()
                else:
                    yield [seeding.SeededIndex(i, seeding.sample_seed(key, i)) for i in part.tolist()]
            first = 0

    def __len__(self) -> int:
        if self._stream is not None:  # fixed while an iterator runs, as the per-rank stream's
            whole = self._stream.batches * self.micro_batches
            return whole if self._len_whole_epoch else whole - self._taken
        return self.n - self._start

    def state_dict(self) -> dict[str, Any]:
        """Seed, epoch and samples consumed (and, mid-epoch, the RNG its loader drew its base seed from). With
        ``global_batch_size``, the job's global position instead: ``seed``, ``epoch``, ``batches`` (global batches
        done), ``micro`` (micro-batches of the next one received), ``samples``, and what the stream was cut with
        (``global_batch_size``, ``total``, ``shuffle``, ``drop_last``, ``world_size``, ``micro_batches``).

        Raises:
            CheckpointError: the sampler was not attached to its loader (``attach``), so it cannot count.

        Example:
            >>> sampler.state_dict()
            {'seed': 0, 'epoch': 0, 'consumed': 32, 'loader_rng': array([...], dtype=uint8)}
        """
        if self._loader is None:
            raise CheckpointError(
                "ResumableSampler: call loader = sampler.attach(DataLoader(...)) before saving it, so it can count "
                "the batches the loop consumed"
            )
        if self._stream is not None:
            return self._position.state(self._stream, self.num_replicas, self.micro_batches)
        state: dict[str, Any] = {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed}
        if self._loader_rng is not None and 0 < self.consumed < self.n:  # mid-epoch: its iterator is resumed
            state["loader_rng"] = self._loader_rng
        return state

    def _state_at(self, epoch: int, batches: int, micro: int) -> dict[str, Any]:
        """The global position's state at ``epoch``, ``batches`` global batches and ``micro`` micro-batches in
        (what a framework counting its own trained batches saves: trainstate.integrations._lightning_stream)."""
        assert self._stream is not None
        at = Position()
        at.epoch, at.batches, at.micro = epoch, batches, micro
        return at.state(self._stream, self.num_replicas, self.micro_batches)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next iterator yields the rest of the saved epoch, in the same order.

        Example:
            >>> sampler.load_state_dict(saved)   # usually through trainstate.load / restore_latest
            >>> next(iter(loader))               # the batch the interrupted run would have seen next
        """
        self._restored = True
        if self._stream is not None:
            self._load_stream(state)
            return
        if "consumed" not in state:
            raise CheckpointError(
                "this ResumableSampler has no global_batch_size and the checkpoint holds a global position: build "
                f"it with global_batch_size={state.get('global_batch_size')!r} as the saved run did"
            )
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        self._start, self._batches = int(state["consumed"]), 0
        # an epoch whose last batch was taken is over: the next iterator draws its seed afresh, as it would have
        rng = state.get("loader_rng") if self._start < self.n else None
        self._resume_rng = None if rng is None else torch.as_tensor(rng, dtype=torch.uint8)
        if self._loader is not None:
            _hooks(self._loader).base_seed_rng = self._resume_rng

    def _load_stream(self, state: dict[str, Any], hold_end: bool = False) -> None:
        """:meth:`load_state_dict` of the global stream; ``hold_end``: a position at an epoch's end stays there,
        so the next iterator ends that epoch (yields nothing) instead of starting the next one (a framework that
        resumes in the middle of its own epoch, which the stream's end cut short)."""
        if "global_batch_size" not in state:
            raise CheckpointError(
                "ResumableSampler(global_batch_size=...) cannot continue from a per-rank position (saved by a "
                "sampler without global_batch_size): resume with the sampler as it was saved, or start the epoch"
            )
        assert self._stream is not None
        built = self._stream.seed
        if self._position.load(dict(state), self._stream, self.num_replicas, self.micro_batches, roll=not hold_end):
            log.warning(
                "ResumableSampler: the checkpoint was saved part-way through global batch %d of epoch %d, by %s "
                "ranks with %s micro-batches each; on %d x %d it starts that global batch again from its first "
                "sample (in a loop that steps the optimizer once per global batch, its gradients were never "
                "applied, so no sample counts twice)",
                self._position.batches,
                self._position.epoch,
                state.get("world_size"),
                state.get("micro_batches"),
                self.num_replicas,
                self.micro_batches,
            )
        if built != self._stream.seed:
            log.warning(
                "ResumableSampler: built with seed=%d, but the checkpoint's stream has seed %d: the saved stream "
                "goes on (seed %d); start a new run for another seed",
                built,
                self._stream.seed,
                self._stream.seed,
            )
        self._hold_end = hold_end and self._position.batches >= self._stream.batches
        self.seed, self.epoch = self._stream.seed, self._position.epoch
        self._taken = self._position.taken(self.micro_batches)

    # called by the loader hook
    def _iterator_starting(self) -> None:
        if self._stream is not None:
            held, self._hold_end = self._hold_end, False
            if self._position.batches >= self._stream.batches and not held:  # the last batch taken, no StopIteration
                self._epoch_finished()
            self._taken = self._position.taken(self.micro_batches)
            if self._loader is not None:  # the base seed from (seed, epoch, rank): the same in every run
                g = torch.Generator()
                g.manual_seed(seeding.sample_seed(seeding.epoch_seed(self.seed, self.epoch), self.rank) >> 1)
                _hooks(self._loader).base_seed_rng = g.get_state()
            return
        if self._batches:  # a new iterator after a partial one (a break): continue where the loop stopped
            self._start = self.consumed
        self._batches = 0
        if self._start >= self.n:  # the loop took the last batch but never saw StopIteration
            self._epoch_finished()

    def _fresh_epoch(self) -> bool:
        """Whether the next iterator starts an epoch afresh (not part-way through one)."""
        if self._stream is not None:
            return self._position.batches == 0 and self._position.micro == 0
        return not 0 < self._start < self.n

    def _iterator_started(self, loader_rng: torch.Tensor) -> None:
        self._loader_rng = loader_rng

    def _batch_received(self) -> None:
        if self._stream is not None:
            self._position.received(self.micro_batches)
        self._batches += 1

    def _epoch_finished(self) -> None:
        if self._stream is not None:
            self._position.next_epoch()
            self.epoch, self._taken = self._position.epoch, 0
            return
        self.epoch += 1
        self._start = self._batches = 0


class IteratorWatcher(Protocol):
    """Told when a loader's iterator starts, and given the new iterator to wrap (``trainstate._replay``)."""

    def iterator_starting(self, loader: DataLoader[Any]) -> None: ...

    def iterator_started(self, it: Any) -> Any: ...


class _Hooks:
    """Per-loader one-shot and counting behaviour, installed as an instance attribute ``_get_iterator``.

    It holds its loader weakly. A strong reference would put the loader in a reference cycle, and a
    StatefulDataLoader keeps its live iterator: freed by the cycle collector, that iterator's workers never get
    their stop message (the queues are finalized first), and torch waits 5 s for each before killing it.
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        self._loader = weakref.ref(loader)
        self.original = type(loader)._get_iterator
        self.counter: ResumableSampler | None = None
        self.base_seed_rng: torch.Tensor | None = None
        self.after_start: list[Callable[[], None]] = []
        self.seed_samples = False
        self.watcher: IteratorWatcher | None = None

    def __call__(self) -> Any:
        loader = self._loader()
        assert loader is not None  # it is calling us
        if self.watcher is not None:
            self.watcher.iterator_starting(loader)
        if self.counter is not None:
            self.counter._iterator_starting()
        source, user_init = loader.generator, loader.worker_init_fn
        loader_rng = source.get_state() if source is not None else torch.get_rng_state()
        restored = getattr(loader, "next_iter_state", None)  # a StatefulDataLoader's state to resume from
        if restored is not None and self.counter is not None and self.counter._restored:
            # the sampler was restored itself (it is in the state): its position wins over the loader's snapshot,
            # which a loader with workers takes ahead of training (prefetched batches) or at the epoch's start
            self.counter._restored = False
            loader.next_iter_state = restored = None
        if self.base_seed_rng is not None:  # resume: draw the base seed the interrupted epoch drew
            replay = torch.Generator()
            replay.set_state(self.base_seed_rng)
            loader.generator, self.base_seed_rng = replay, None
            loader_rng = replay.get_state()
        if self.seed_samples and loader.num_workers > 0:
            loader.worker_init_fn = seeding.SeedingWorkerInit(user_init)
        try:
            it = self.original(loader)
        finally:
            loader.generator, loader.worker_init_fn = source, user_init
        if self.seed_samples and loader.num_workers == 0:
            _seed_in_this_process(it, restored)
        callbacks, self.after_start = self.after_start, []
        for callback in callbacks:
            callback()
        if self.watcher is not None:
            it = self.watcher.iterator_started(it)
        if self.counter is None:
            return it
        self.counter._iterator_started(loader_rng)
        return _CountingIterator(it, self.counter)


class _CountingIterator:
    def __init__(self, it: Any, counter: ResumableSampler) -> None:
        self._it = it
        self._counter = counter

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            self._counter._epoch_finished()
            raise
        self._counter._batch_received()
        return batch

    def __len__(self) -> int:
        return len(self._it)

    def _reset(self, loader: DataLoader[Any], first_iter: bool = False) -> None:
        """A persistent-workers loader's next epoch (or its next iterator after a ``break``): no new iterator is
        made, so the sampler is told here that one starts."""
        self._counter._iterator_starting()
        self._it._reset(loader, first_iter)

    def __getattr__(self, name: str) -> Any:  # _reset, _finished, ... for persistent workers
        return getattr(self._it, name)


def _seed_in_this_process(it: Any, restored: Any) -> None:
    """Seed per sample in the training process; keep the base seed in a stateful iterator's state.

    torchdata keeps ``_base_seed`` in a multi-process loader's state only (it seeds the workers); without
    workers the resumed iterator would draw another one, and the rest of the epoch other sample seeds.
    """
    if isinstance(restored, dict) and isinstance(restored.get(_BASE_SEED), int):
        it._base_seed = restored[_BASE_SEED]
    it._dataset_fetcher = seeding.seeding_fetcher(it._dataset_fetcher, it._base_seed)
    if callable(getattr(it, "state_dict", None)):
        it.state_dict = _StateWithBaseSeed(it.state_dict, it._base_seed)


class _StateWithBaseSeed:
    def __init__(self, state_dict: Callable[[], dict[str, Any]], base_seed: int) -> None:
        self.state_dict, self.base_seed = state_dict, base_seed

    def __call__(self) -> dict[str, Any]:
        return {**self.state_dict(), _BASE_SEED: self.base_seed}


def seed_per_sample(loader: L) -> L:
    """Seed the randomness of each sample ``loader`` fetches from (epoch seed, index); returns the loader.

    Before each ``dataset[index]`` — in worker processes, or in this process with ``num_workers=0`` —
    Python's ``random``, NumPy's global generator and torch's CPU generator are seeded for that sample, so
    its augmentation no longer depends on which worker served it, and a resumed run draws the same numbers.
    The epoch seed is the iterator's base seed, which a StatefulDataLoader saves with its state.
    ``ResumableSampler.attach()`` calls this itself. Call it on a new loader, before its first epoch, in the
    uninterrupted run and in the resumed one alike.

    Raises:
        CheckpointError: an iterable dataset (no index to seed from), or persistent workers without a
            ResumableSampler (the base seed is drawn once for all epochs: every epoch would repeat).

    Example:
        >>> loader = trainstate.seed_per_sample(StatefulDataLoader(ds, batch_size=32, shuffle=True,
        ...                                                        num_workers=2))
    """
    if isinstance(loader.dataset, IterableDataset):
        raise CheckpointError(
            f"seed_per_sample needs a map-style dataset (samples fetched by index), found "
            f"the iterable dataset {type(loader.dataset).__name__}: seed its iterator yourself"
        )
    sampler = loader.batch_sampler  # a ResumableSampler(global_batch_size=) is the batch sampler itself
    if not isinstance(sampler, ResumableSampler):
        sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    if loader.persistent_workers and loader.num_workers > 0 and not isinstance(sampler, ResumableSampler):
        raise CheckpointError(
            "seed_per_sample cannot tell the epochs of persistent_workers=True apart (their base seed is drawn "
            "once, and no epoch count reaches the workers): use persistent_workers=False, or a DataLoader with "
            "trainstate.ResumableSampler, whose indices carry (seed, epoch) to persistent workers"
        )
    _hooks(loader).seed_samples = True
    return loader


def _hooks(loader: DataLoader[Any]) -> _Hooks:
    hooks = loader.__dict__.get(_HOOK)
    if not isinstance(hooks, _Hooks):
        hooks = _Hooks(loader)
        object.__setattr__(loader, _HOOK, hooks)
    return hooks


def watch(loader: DataLoader[Any], watcher: IteratorWatcher | None) -> None:
    """Make ``watcher`` see every iterator ``loader`` starts from now on (None: stop); one per loader."""
    hooks = _hooks(loader)
    if watcher is not None and hooks.watcher is not None and hooks.watcher is not watcher:
        raise InvalidArgumentError(
            "this DataLoader is already replayed by another ExactResume (or EpochReplay): give each its own loader"
        )
    hooks.watcher = watcher


def reapply_after_iterator_start(loader: DataLoader[Any], callback: Callable[[], None]) -> None:
    """Run ``callback`` once, right after ``loader``'s next iterator has started."""
    _hooks(loader).after_start.append(callback)


def arm_exact_resume(target: Any) -> None:
    """After a restore: put torch's RNG back once each restored loader's first iterator has started."""
    from trainstate._rng import RNGState

    rngs = [r for r in _walk(target) if isinstance(r, RNGState) and r.restored_torch_state is not None]
    if not rngs:
        return
    # a sampler restored at the end of its epoch starts the next one afresh: its loader draws from the RNG
    # as restored, as the interrupted run did after the save
    fresh = {id(s._loader) for s in _walk(target) if isinstance(s, ResumableSampler) and s._fresh_epoch()}
    for loader in loaders_in(target):
        if id(loader) in fresh:
            continue
        for rng in rngs:
            reapply_after_iterator_start(loader, rng.reapply_torch)


def _walk(value: Any, depth: int = 0) -> Iterator[Any]:
    yield value
    if depth < 50 and isinstance(value, dict):
        for v in value.values():
            yield from _walk(v, depth + 1)
    elif depth < 50 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk(v, depth + 1)


def loaders_in(value: Any, depth: int = 0) -> list[DataLoader[Any]]:
    """DataLoaders in a state tree, including those attached to a ResumableSampler."""
    if depth > 50:
        return []
    if isinstance(value, DataLoader):
        return [value]
    if isinstance(value, ResumableSampler):
        return [value._loader] if value._loader is not None else []
    if isinstance(value, dict):
        return [x for v in value.values() for x in loaders_in(v, depth + 1)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in loaders_in(v, depth + 1)]
    return []
