"""Per-sample seeding: a sample's random draws depend on (seed, epoch, index), not on the worker that served it.

Augmentation in ``Dataset.__getitem__`` draws from the process's global generators (Python's ``random``,
NumPy's global one, torch's CPU one). In DataLoader workers those start from ``base_seed + worker_id`` and
advance with every sample the worker serves, so a sample's draws depend on which worker got it and what
that worker did before. A resumed run hands the rest of the epoch to fresh workers in a different order:
every draw after the resume differs, and so does training.

Here each fetch seeds the three generators from the sample's own seed right before ``dataset[index]``:

* a :class:`SeededIndex` carries its seed from the sampler, through the index queue, to the worker
  (ResumableSampler yields them: the seed is a function of the sampler's seed, the epoch and the index);
* a plain index is seeded from the iterator's base seed and the index (torchdata's StatefulDataLoader
  saves and restores that base seed with its state; trainstate adds it for ``num_workers=0``).

In workers the generators are left where the last sample's draws put them (so ``collate_fn`` randomness is
a function of the batch too); in the training process (``num_workers=0``) they are saved before a batch and
put back after it, so the loop's own random stream (dropout, ...) is not moved by data loading. A batch is
then the same whatever ``num_workers`` is. A dataset with ``__getitems__`` takes a whole batch in one call:
it is seeded once, from the batch's first sample. CUDA generators are not touched.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.fetch import _MapDatasetFetcher

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a cheap bijection on 64 bits whose outputs look independent."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    return _mix(_mix(seed & _MASK64) ^ (epoch & _MASK64))


def sample_seed(epoch_key: int, index: int) -> int:
    return _mix((epoch_key & _MASK64) ^ _mix(index & _MASK64))


class SeededIndex(int):
    """A sample index that carries its sample's seed through the DataLoader's index queue to the worker."""

    seed: int

    def __new__(cls, index: int, seed: int) -> SeededIndex:
        self = super().__new__(cls, index)
        self.seed = seed
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return SeededIndex, (int(self), self.seed)


def seed_globals(seed: int) -> None:
    """Seed Python's, NumPy's and torch's CPU global generators from one 64-bit seed (each from other bits:
    NumPy and torch both run MT19937 from a 32-bit seed, and equal streams would correlate augmentations)."""
    random.seed(seed)
    np.random.seed(seed >> 32)
    torch.default_generator.manual_seed(seed & 0xFFFFFFFF)


class SeedingFetcher(_MapDatasetFetcher):
    """torch's map-style fetcher, seeding the global generators before each ``dataset[index]``.

    A subclass so that what reads a fetcher's fields (torchdata's state, ``dataset``) still finds them.
    """

    def __init__(
        self,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Callable[[Any], Any],
        drop_last: bool,
        *,
        base_seed: int,
        keep_caller_rng: bool,
    ) -> None:
        super().__init__(dataset, auto_collation, collate_fn, drop_last)
        self.base_seed = base_seed
        self.keep_caller_rng = keep_caller_rng

    def _seed(self, index: Any) -> None:
        seed_globals(index.seed if isinstance(index, SeededIndex) else sample_seed(self.base_seed, index))

    def _get(self, index: Any) -> Any:
        self._seed(index)
        return self.dataset[int(index)]

    def fetch(self, possibly_batched_index: Any) -> Any:
        saved = (
            (random.getstate(), np.random.get_state(), torch.default_generator.get_state())
            if self.keep_caller_rng
            else None
        )
        try:
            if not self.auto_collation:
                data = self._get(possibly_batched_index)
            elif getattr(self.dataset, "__getitems__", None):
                indices = list(possibly_batched_index)
                if indices:
                    self._seed(indices[0])
                data = self.dataset.__getitems__([int(i) for i in indices])
            else:
                data = [self._get(i) for i in possibly_batched_index]
            return self.collate_fn(data)
        finally:
            if saved is not None:
                random.setstate(saved[0])
                np.random.set_state(saved[1])
                torch.default_generator.set_state(saved[2])


def seeding_fetcher(fetcher: Any, base_seed: int) -> Any:
    """``fetcher`` made to seed per sample in the training process; other fetchers are returned as they are."""
    if type(fetcher) is not _MapDatasetFetcher:
        return fetcher
    return SeedingFetcher(
        fetcher.dataset,
        fetcher.auto_collation,
        fetcher.collate_fn,
        fetcher.drop_last,
        base_seed=base_seed,
        keep_caller_rng=True,
    )


class SeedingWorkerInit:
    """Stands in for a loader's ``worker_init_fn`` while its iterator starts workers.

    In each worker it makes torch's fetcher factory (the one both torch's and torchdata's worker loops call,
    at start and on every persistent-worker epoch) return a :class:`SeedingFetcher`, then calls the user's
    own ``worker_init_fn``. torch offers no other hook between a worker and ``dataset[index]``; the change
    lives only in the worker process.
    """

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        from torch.utils.data.dataloader import _DatasetKind

        info = get_worker_info()
        assert info is not None, "SeedingWorkerInit runs in DataLoader workers only"
        base_seed = info.seed - info.id  # torch seeds worker i with base_seed + i
        create: Callable[..., Any] = _DatasetKind.create_fetcher

        def create_fetcher(
            kind: int, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any], drop_last: bool
        ) -> Any:
            if kind == _DatasetKind.Map:
                return SeedingFetcher(
                    dataset, auto_collation, collate_fn, drop_last, base_seed=base_seed, keep_caller_rng=False
                )
            return create(kind, dataset, auto_collation, collate_fn, drop_last)

        _DatasetKind.create_fetcher = staticmethod(create_fetcher)  # type: ignore[method-assign]
        if self.user_fn is not None:
            self.user_fn(worker_id)
