"""Functions each rank runs in the compressed collective save tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import trainstate
from trainstate import _transforms

CHUNK = 16 << 10  # raw bytes per compressed chunk here (4 MiB by default): every shard is cut into several


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def whole() -> dict[str, np.ndarray]:
    """The tensors every test saves, as whole arrays: compressible ones, and one of random bytes (its chunks
    stored raw, as compressing them does not pay)."""
    rng = np.random.default_rng(5)
    return {
        "rows": (np.arange(200 * 96, dtype=np.float32) % 17).reshape(200, 96),  # sharded along dim 0
        "columns": np.repeat(np.arange(64, dtype=np.float32)[:, None], 130, axis=1),  # sharded along dim 1
        "table": np.tile(np.arange(100, dtype=np.float32), (120, 1)),  # replicated: written once
        "noise": rng.integers(0, 256, (70, 90), dtype=np.uint8),  # replicated, incompressible
        "small": np.arange(5, dtype=np.int64),  # one chunk, under the size where compressing pays
    }


def state_for(world: int, fill: float | None = None) -> dict[str, Any]:
    """The state on this rank: DTensor shards of ``rows`` and ``columns``, the rest replicated; ``fill``:
    every value replaced by it (a fresh state to restore into)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    arrays = whole()
    if fill is not None:
        arrays = {k: np.full_like(v, fill) for k, v in arrays.items()}
    mesh = _mesh(world)
    return {
        "rows": distribute_tensor(torch.from_numpy(arrays["rows"]), mesh, [Shard(0)]),
        "columns": distribute_tensor(torch.from_numpy(arrays["columns"]), mesh, [Shard(1)]),
        "table": torch.from_numpy(arrays["table"]),
        "noise": torch.from_numpy(arrays["noise"]),
        "small": arrays["small"],
        "step": 3 if fill is None else 0,
    }


def _full(t: Any) -> np.ndarray:
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().numpy().copy() if isinstance(t, torch.Tensor) else np.asarray(t).copy()


def save(rank: int, world: int, path: str, compression: str | None, key: str | None = None) -> Any:
    """Save the state compressed and / or encrypted; every rank seeds Python's, NumPy's and torch's
    generators alike first (as a job seeded for reproducibility does), so nothing but the kernel's
    generator can tell the ranks' nonces apart."""
    import random

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    before, _transforms.TRANSFORM_CHUNK_BYTES = _transforms.TRANSFORM_CHUNK_BYTES, CHUNK
    try:
        result = trainstate.save(path, state_for(world), compression=compression, key=key)
    finally:
        _transforms.TRANSFORM_CHUNK_BYTES = before
    return result.nbytes


def load(rank: int, world: int, path: str, key: str | None = None) -> Any:
    """This rank's state restored into fresh DTensors at this world size, as whole arrays."""
    state = state_for(world, fill=7.0)
    out = trainstate.load(path, state, key=key)
    got = {k: _full(state[k]) for k in whole()}
    got["small"] = np.asarray(out["small"])
    got["step"] = out["step"]
    return got


def load_error(rank: int, world: int, path: str, key: str | None = None) -> Any:
    """The error this rank's load raised (type name and message), or None."""
    try:
        load(rank, world, path, key)
    except trainstate.CheckpointError as e:
        return (type(e).__name__, str(e))
    return None


def manager(
    rank: int, world: int, directory: str, async_save: bool, compression: str | None = "zstd", key: str | None = None
) -> Any:
    """Steps 0..5 saved (compressed, and encrypted under ``key``) every 2 (keeping 2), then restore_latest
    into a fresh state."""
    before, _transforms.TRANSFORM_CHUNK_BYTES = _transforms.TRANSFORM_CHUNK_BYTES, CHUNK
    try:
        with trainstate.CheckpointManager(
            directory, every_steps=2, keep_last=2, compression=compression, key=key, async_save=async_save
        ) as mgr:
            for step in range(6):
                state = state_for(world)
                state["table"] = state["table"] + step
                state["step"] = step
                mgr.save(step, state)
            mgr.wait()
            listed = [c.step for c in mgr.list()]
    finally:
        _transforms.TRANSFORM_CHUNK_BYTES = before
    back = state_for(world, fill=7.0)
    with trainstate.CheckpointManager(directory, compression=compression, key=key) as again:
        start = again.restore_latest(back)
    return {"listed": listed, "start": start, **{k: _full(back[k]) for k in ("rows", "columns", "table", "noise")}}


def save_few(rank: int, world: int, path: str) -> Any:
    """Fewer boxes than ranks, compressed: some ranks write nothing."""
    trainstate.save(path, {"a": torch.zeros(4096), "b": torch.arange(3.0)}, compression="zstd")
    back = {"a": torch.ones(4096), "b": torch.ones(3)}
    trainstate.load(path, back)
    return {k: v.numpy().copy() for k, v in back.items()}


def save_scaled(rank: int, world: int, path: str, scale: float) -> Any:
    """``save`` compressed with every float tensor times ``scale`` (checkpoints to average)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    state = state_for(world)
    mesh = _mesh(world)
    for k, placement in (("rows", Shard(0)), ("columns", Shard(1))):
        state[k] = distribute_tensor(torch.from_numpy(whole()[k] * scale), mesh, [placement])
    state["table"] = state["table"] * scale
    state["mine"] = trainstate.PerRank({"rank": rank, "moment": torch.full((4,), scale * (rank + 1))})
    before, _transforms.TRANSFORM_CHUNK_BYTES = _transforms.TRANSFORM_CHUNK_BYTES, CHUNK
    try:
        trainstate.save(path, state, compression="zstd")
    finally:
        _transforms.TRANSFORM_CHUNK_BYTES = before
    return None


def manager_resume_error(rank: int, world: int, directory: str, key: str) -> Any:
    """The error a manager over ``directory`` with ``key`` raises at its start or its restore_latest."""
    try:
        with trainstate.CheckpointManager(directory, key=key) as mgr:
            mgr.restore_latest(state_for(world, fill=7.0))
    except trainstate.CheckpointError as e:
        return (type(e).__name__, str(e))
    return None


def save_broken_nonces(rank: int, world: int, path: str) -> Any:
    """An encrypted save on a host whose generator repeats itself: every rank draws the same nonces. The
    error this rank's save raised (type name and message), or None."""
    import types

    from trainstate._transforms import aes_gcm

    real, aes_gcm.os = aes_gcm.os, types.SimpleNamespace(urandom=lambda n: bytes(n))  # type: ignore[assignment]
    try:
        trainstate.save(path, state_for(world), key="3c" * 32)
    except trainstate.CheckpointError as e:
        return (type(e).__name__, str(e))
    finally:
        aes_gcm.os = real
    return None
