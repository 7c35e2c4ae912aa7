"""The Trainer's data: where a run is in it (saved and checked on resume), and per-sample seeding.

Position. The Trainer resumes its data from the global step alone: it skips ``global_step % updates_per_epoch``
updates' worth of batches of epoch ``global_step // updates_per_epoch``, whose order its sampler draws from
``(seed, epoch)``. That is exact only when the run resumed cuts its data the same way, so the checkpoint
records what the position depends on (batches per epoch, batch size, accumulation, world size, seed, the
dataset's length) and a resume under other values is refused by name instead of silently training on other
samples.

Seeding. Randomness while fetching a batch (an augmentation in ``__getitem__``, a collator that masks tokens)
draws from the process's global generators. A resumed run fetches its first batches from other generator
states than the interrupted run did, and the Trainer puts its saved RNG back only after fetching them: every
draw after a resume then differs (transformers #39215). With seeding on, the callback makes those draws a
function of the sample instead, as trainstate's own loaders do (``trainstate._seeding``):

* the loader's index sampler is wrapped to yield :class:`~trainstate._seeding.SeededIndex` values, each
  carrying its sample's seed, drawn from ``(seed, epoch, index)``;
* the loader's dataset gets an instance ``__getitems__`` (torch's batched-fetch hook) that seeds Python's,
  NumPy's and torch's global generators from each sample's seed before fetching it (once per batch, from its
  first sample, for a dataset with a ``__getitems__`` of its own), having kept the loop's generator states;
* the loader's collate function is wrapped to put the loop's generator states back after collating, so the
  collator's draws follow the batch's last sample and data loading never moves the loop's random stream.

All three travel into the loader that ``accelerate.skip_first_batches`` builds for a resumed epoch (it reuses
the dataset, the batch sampler and the collate function), and into worker processes (a ``SeededIndex``
pickles with its seed). :func:`uninstall` takes them out at the end of training.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from trainstate import _seeding as seeding

log = logging.getLogger("trainstate")

# -- position ---------------------------------------------------------------------------------------

CHECKED = ("batches_per_epoch", "gradient_accumulation_steps", "train_batch_size", "world_size", "seed", "samples")


def updates_per_epoch(batches_per_epoch: int | None, accumulation: int, max_steps: int) -> int:
    """The Trainer's ``num_update_steps_per_epoch`` (``Trainer.set_initial_training_values``)."""
    if batches_per_epoch is None:
        return max(max_steps, 1)
    return max(batches_per_epoch // accumulation + int(batches_per_epoch % accumulation > 0), 1)


def length(obj: Any) -> int | None:
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


def position(args: Any, state: Any, loader: Any, seeded: bool) -> dict[str, Any]:
    """Where the run is in its data after ``state.global_step`` updates, and what that depends on."""
    batches = length(loader)
    accumulation = int(args.gradient_accumulation_steps)
    per_epoch = updates_per_epoch(batches, accumulation, int(state.max_steps))
    step = int(state.global_step)
    samples = length(getattr(loader, "dataset", None))
    return {
        "epoch": step // per_epoch,
        "batches_into_epoch": (step % per_epoch) * accumulation,
        "batches_per_epoch": -1 if batches is None else batches,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": int(state.train_batch_size or args.per_device_train_batch_size),
        "world_size": int(args.world_size),
        "seed": int(args.data_seed if args.data_seed is not None else args.seed),
        "samples": -1 if samples is None else samples,
        "seeded_per_sample": bool(seeded),
    }


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(key, now, saved)`` for each value the data position depends on that differs."""
    keys = CHECKED + ("seeded_per_sample",)
    return [(f"data.{k}", repr(now.get(k)), repr(saved.get(k))) for k in keys if saved.get(k) != now.get(k)]


# -- per-sample seeding -----------------------------------------------------------------------------


class Epoch:
    """The epoch the Trainer's loop is in (the callback sets it at each epoch's start) and the run's seed."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.epoch = 0


class SeededSampler:
    """Yields the wrapped sampler's indices as ``SeededIndex`` values; everything else goes to the sampler."""

    def __init__(self, inner: Any, epoch: Epoch) -> None:
        self.inner = inner
        self.epoch_of = epoch

    def __iter__(self) -> Iterator[int]:
        key = seeding.epoch_seed(self.epoch_of.seed, self.epoch_of.epoch)
        for i in self.inner:
            yield seeding.SeededIndex(int(i), seeding.sample_seed(key, int(i)))

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:  # accelerate's DataLoaderShard.set_epoch looks for it here
        if callable(getattr(self.inner, "set_epoch", None)):
            self.inner.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


_caller: list[tuple[Any, Any, Any]] = []  # the loop's generator states while a batch is fetched in this process


def _keep_caller_rng() -> None:
    if not _caller:
        _caller.append((random.getstate(), np.random.get_state(), torch.default_generator.get_state()))


def _restore_caller_rng() -> None:
    if _caller:
        py, np_state, torch_state = _caller.pop()
        random.setstate(py)
        np.random.set_state(np_state)
        torch.default_generator.set_state(torch_state)


class SeedingGetitems:
    """A dataset's ``__getitems__`` that seeds the global generators per sample (see the module docstring)."""

    def __init__(self, dataset: Any, own: Callable[[list[int]], list[Any]] | None) -> None:
        self.dataset = dataset
        self.own = own  # the dataset class's own __getitems__, bound, or None

    def __call__(self, indices: list[Any]) -> list[Any]:
        if not indices or not isinstance(indices[0], seeding.SeededIndex):  # not the training loader's
            return self.own(indices) if self.own is not None else [self.dataset[i] for i in indices]
        _keep_caller_rng()  # put back by RestoringCollate once the batch is collated
        try:
            if self.own is not None:
                seeding.seed_globals(indices[0].seed)
                return self.own([int(i) for i in indices])
            out = []
            for i in indices:
                seeding.seed_globals(i.seed)
                out.append(self.dataset[int(i)])
            return out
        except BaseException:
            _restore_caller_rng()  # no collate follows a failed fetch
            raise


class RestoringCollate:
    """The loader's collate function, followed by putting the loop's generator states back."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, batch: Any) -> Any:
        try:
            return self.collate(batch)
        finally:
            _restore_caller_rng()


class Installed:
    """What :func:`install` changed, for :func:`uninstall`."""

    def __init__(self, batch_sampler: Any, sampler: Any, dataset: Any, loader: Any, collate: Any) -> None:
        self.batch_sampler, self.sampler = batch_sampler, sampler
        self.dataset, self.loader, self.collate = dataset, loader, collate


def install(loader: Any, epoch: Epoch) -> Installed | None:
    """Seed the samples of the Trainer's training loader per sample; None (and a warning) where it cannot."""
    base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard wraps a torch DataLoader
    dataset = getattr(base, "dataset", None)
    batch_sampler = getattr(base, "batch_sampler", None)
    while batch_sampler is not None and hasattr(batch_sampler, "batch_sampler"):  # BatchSamplerShard, ...
        batch_sampler = batch_sampler.batch_sampler
    why = None
    if isinstance(dataset, IterableDataset) or dataset is None:
        why = "an iterable dataset has no sample index to seed from"
    elif batch_sampler is None or not hasattr(batch_sampler, "sampler"):
        why = f"its batch sampler ({type(batch_sampler).__name__}) has no index sampler to wrap"
    elif not hasattr(dataset, "__dict__"):
        why = f"its dataset ({type(dataset).__name__}) takes no instance attributes"
    if why is not None:
        log.warning(
            "TrainstateCallback: the training data is not seeded per sample (%s); randomness in fetching batches "
            "(augmentation, a masking collator) is not reproduced by a resume",
            why,
        )
        return None
    assert batch_sampler is not None
    own = getattr(type(dataset), "__getitems__", None)
    installed = Installed(batch_sampler, batch_sampler.sampler, dataset, base, base.collate_fn)
    batch_sampler.sampler = SeededSampler(batch_sampler.sampler, epoch)
    dataset.__dict__["__getitems__"] = SeedingGetitems(dataset, own.__get__(dataset) if own is not None else None)
    base.collate_fn = RestoringCollate(base.collate_fn)
    return installed


def uninstall(installed: Installed | None) -> None:
    if installed is None:
        return
    installed.batch_sampler.sampler = installed.sampler
    installed.dataset.__dict__.pop("__getitems__", None)
    installed.loader.collate_fn = installed.collate
    _caller.clear()
