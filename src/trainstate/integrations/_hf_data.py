"""The Trainer's data: where a run is in it (saved and checked on resume), and per-sample seeding.

Position. The Trainer resumes its data from the global step alone: it skips ``global_step % updates_per_epoch``
updates' worth of batches of epoch ``global_step // updates_per_epoch``, whose order its sampler draws from
``(seed, epoch)``. That is exact only when the run resumed cuts its data the same way, so the checkpoint
records what the position depends on (batches per epoch, batch size, accumulation, world size, seed, the
dataset's length) and a resume under other values is refused by name instead of silently training on other
samples.

Another number of processes. Under accelerate (the Trainer's loaders) the order is the same at any world size:
the ``RandomSampler`` becomes accelerate's ``SeedableRandomSampler`` (``use_seedable_sampler``, on by default),
whose permutation comes from ``(initial seed + epoch)`` alone; it is cut into per-device batches, and
``BatchSamplerShard`` gives process ``i`` of ``W`` batches ``i, i + W, i + 2W, ...``. Optimizer step ``s`` (``A``
accumulation steps) therefore takes samples ``[s * G, (s + 1) * G)`` of the permutation, ``G = per_device * A * W``
(the global batch), and a resume skips ``(step % updates_per_epoch) * A`` batches of every process: ``step * G``
samples at any ``W`` that keeps ``G``. So a resume at another world size is allowed when the global batch, the
updates per epoch, the dataset's length, the seed and the seeding are the saved ones, and the order is one of
those (a seedable or sequential sampler, no ``split_batches`` / ``dispatch_batches``); anything else is refused by
name, with the hint to keep the global batch (double ``per_device_train_batch_size`` or
``gradient_accumulation_steps`` when halving the processes). At the same world size the check is as before.
The epoch's tail is not world-size invariant: when the dataset is not a multiple of ``per_device * W``,
``BatchSamplerShard`` (``even_batches``) fills the last round of batches with the epoch's first samples on
several processes (seen twice), while one process takes a short last batch; with ``dataloader_drop_last`` the
processes drop what does not fill a round. Only the epoch's last update differs (a warning says so).

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


def _batch_samplers(loader: Any) -> Iterator[Any]:
    """The loader's batch sampler and the ones it wraps (accelerate's ``BatchSamplerShard`` wraps torch's)."""
    sampler = getattr(getattr(loader, "base_dataloader", loader), "batch_sampler", None)
    while sampler is not None:
        yield sampler
        sampler = getattr(sampler, "batch_sampler", None)


def per_device_batch(loader: Any) -> int | None:
    """The samples in one of the loader's batches (what the Trainer built it with), None when it does not say."""
    for sampler in _batch_samplers(loader):
        size = getattr(sampler, "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


def position(args: Any, state: Any, loader: Any, seeded: bool) -> dict[str, Any]:
    """Where the run is in its data after ``state.global_step`` updates, and what that depends on."""
    batches = length(loader)
    accumulation = int(args.gradient_accumulation_steps)
    per_epoch = updates_per_epoch(batches, accumulation, int(state.max_steps))
    step = int(state.global_step)
    samples = length(getattr(loader, "dataset", None))
    # the loader's own batch size: a resumed TrainerState holds the saved run's train_batch_size
    batch = per_device_batch(loader) or int(state.train_batch_size or args.per_device_train_batch_size)
    return {
        "epoch": step // per_epoch,
        "batches_into_epoch": (step % per_epoch) * accumulation,
        "batches_per_epoch": -1 if batches is None else batches,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": batch,
        "world_size": int(args.world_size),
        "seed": int(args.data_seed if args.data_seed is not None else args.seed),
        "samples": -1 if samples is None else samples,
        "seeded_per_sample": bool(seeded),
    }


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(key, now, saved)`` for each value the data position depends on that differs."""
    keys = CHECKED + ("seeded_per_sample",)
    return [(f"data.{k}", repr(now.get(k)), repr(saved.get(k))) for k in keys if saved.get(k) != now.get(k)]


def global_batch(position: dict[str, Any]) -> int:
    """Samples per optimizer step over every process: per-device batch x accumulation x world size."""
    return (
        int(position["train_batch_size"]) * int(position["gradient_accumulation_steps"]) * int(position["world_size"])
    )


def _updates(position: dict[str, Any]) -> int | None:
    batches = int(position["batches_per_epoch"])
    return None if batches < 0 else updates_per_epoch(batches, int(position["gradient_accumulation_steps"]), 0)


def order_changes(loader: Any) -> str | None:
    """Why the loader's order would differ at another world size (see the module docstring), or None."""
    if type(loader).__name__ == "DataLoaderDispatcher":
        return "accelerate dispatches the batches from process 0 (dispatch_batches)"
    if any(getattr(s, "split_batches", False) for s in _batch_samplers(loader)):
        return "accelerate splits each batch between the processes (split_batches)"
    samplers = list(_batch_samplers(loader))
    index = getattr(samplers[-1], "sampler", None) if samplers else None
    index = getattr(index, "inner", index)  # SeededSampler
    kind = type(index).__name__
    if kind not in ("SeedableRandomSampler", "SequentialSampler"):
        return f"its index sampler ({kind}) does not draw one order for every world size (use_seedable_sampler)"
    return None


def elastic_differences(saved: dict[str, Any], now: dict[str, Any], loader: Any) -> list[tuple[str, str, str]]:
    """:func:`differences`, but for a resume at another number of processes: what must stay is the global batch,
    the updates per epoch, the dataset, the seed and the seeding (the module docstring)."""
    damaged = _damaged(saved)
    if damaged:
        return damaged
    if saved.get("world_size") == now.get("world_size") or any(k not in saved for k in CHECKED):
        same = differences(saved, now)
        whole = all(k in p for p in (saved, now) for k in ("train_batch_size", "gradient_accumulation_steps"))
        if same and whole and global_batch(saved) != global_batch(now):  # the one value the user thinks in
            same.insert(0, ("data.global_batch_size", _global(now), _global(saved)))
        return same
    wrong = [
        (f"data.{k}", repr(now.get(k)), repr(saved.get(k)))
        for k in ("seed", "samples", "seeded_per_sample")
        if saved.get(k) != now.get(k)
    ]
    if global_batch(saved) != global_batch(now):
        wrong.append(("data.global_batch_size", _global(now), _global(saved)))
    per_epoch = _updates(now), _updates(saved)
    if per_epoch[0] is None or per_epoch[0] != per_epoch[1]:
        wrong.append(("data.updates_per_epoch", repr(per_epoch[0]), repr(per_epoch[1])))
    why = order_changes(loader)
    if why is not None:
        wrong.append(("data.order", f"one that depends on the world size: {why}", "the same at any world size"))
    if wrong:
        wrong.append(("data.world_size", repr(now.get("world_size")), repr(saved.get("world_size"))))
    return wrong


_COUNTS = {"gradient_accumulation_steps": 1, "train_batch_size": 1, "world_size": 1, "batches_per_epoch": -1}


def _damaged(saved: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The saved counts that are not ints in range (a damaged or edited checkpoint): each named, so the resume is
    refused before anything divides by them."""
    return [
        (f"data.{k}", f"an int of at least {least}", repr(saved[k]))
        for k, least in _COUNTS.items()
        if k in saved and (isinstance(saved[k], bool) or not isinstance(saved[k], int) or saved[k] < least)
    ]


def _global(position: dict[str, Any]) -> str:
    return (
        f"{global_batch(position)} ({position['train_batch_size']} per device x "
        f"{position['gradient_accumulation_steps']} accumulation x {position['world_size']} processes)"
    )


def uneven_tail(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the epoch's last update takes other samples at the two world sizes (``even_batches`` padding)."""
    samples = int(now.get("samples", -1))
    rounds = [int(p["train_batch_size"]) * int(p["world_size"]) for p in (saved, now)]
    return samples > 0 and any(samples % r for r in rounds)


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
