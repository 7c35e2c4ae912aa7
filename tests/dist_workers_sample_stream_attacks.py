"""Rank functions for tests/distributed/test_elastic_attacks.py: the global sample stream and re-derived
generators on real gloo ranks, the ways users break them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import trainstate


def _sampler(world: int, rank: int) -> tuple[trainstate.ResumableSampler, Any]:
    sampler = trainstate.ResumableSampler(40, seed=3, num_replicas=world, rank=rank, global_batch_size=8)
    loader = sampler.attach(torch.utils.data.DataLoader(list(range(40)), batch_sampler=sampler))
    return sampler, loader


def save_one_rank_ahead(rank: int, world: int, path: str) -> str:
    """Every rank takes two micro-batches, the last rank a third; then a collective save."""
    sampler, loader = _sampler(world, rank)
    it = iter(loader)
    for _ in range(3 if rank == world - 1 else 2):
        next(it)
    try:
        trainstate.save(path, {"sampler": sampler})
    except trainstate.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def _rng(rank: int) -> trainstate.RNGState:
    return trainstate.RNGState(
        numpy_generators={"aug": np.random.default_rng(100 + rank)},
        torch_generators={"drop": torch.Generator().manual_seed(200 + rank)},
        seed=11,
    )


def save_rng(rank: int, world: int, run: str) -> None:
    rng = _rng(rank)
    with trainstate.CheckpointManager(run, every_steps=1) as mgr:
        mgr.save(5, {"rng": rng}, force=True)


def restore_rng(rank: int, world: int, run: str) -> list[float]:
    """Draws right after the restore: Python's, NumPy's, torch's, and the two named generators'."""
    rng = _rng(rank)
    with trainstate.CheckpointManager(run, every_steps=1) as mgr:
        mgr.restore_latest({"rng": rng})
    import random

    return [
        random.random(),
        float(np.random.rand()),
        float(torch.rand(())),
        float(rng.numpy_generators["aug"].random()),
        float(torch.rand((), generator=rng.torch_generators["drop"])),
    ]


def save_position(rank: int, world: int, path: str) -> None:
    sampler, loader = _sampler(world, rank)
    it = iter(loader)
    next(it)
    trainstate.save(path, {"sampler": sampler})


def load_with_another_global_batch(rank: int, world: int, path: str) -> str:
    sampler = trainstate.ResumableSampler(40, seed=3, num_replicas=world, rank=rank, global_batch_size=4)
    sampler.attach(torch.utils.data.DataLoader(list(range(40)), batch_sampler=sampler))
    try:
        trainstate.load(path, {"sampler": sampler})
    except trainstate.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _either(world: int, rank: int, global_stream: bool) -> tuple[trainstate.ResumableSampler, Any]:
    if global_stream:
        return _sampler(world, rank)
    sampler = trainstate.ResumableSampler(40, seed=3, num_replicas=world, rank=rank)
    return sampler, sampler.attach(torch.utils.data.DataLoader(list(range(40)), batch_size=4, sampler=sampler))


def save_either(rank: int, world: int, path: str, global_stream: bool) -> None:
    sampler, loader = _either(world, rank, global_stream)
    it = iter(loader)
    next(it)
    trainstate.save(path, {"sampler": sampler})


def load_either(rank: int, world: int, path: str, global_stream: bool) -> str:
    sampler, _ = _either(world, rank, global_stream)
    try:
        trainstate.load(path, {"sampler": sampler})
    except trainstate.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"
