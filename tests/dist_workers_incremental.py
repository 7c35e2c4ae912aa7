"""Functions each rank runs in the tests of incremental runs under a process group (importable by spawned
processes): a frozen sharded base, a sharded tensor that changes at every save, replicated tensors."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import torch

import trainstate
from trainstate import _transforms

CHUNK = 16 << 10  # raw bytes per compressed chunk here (4 MiB by default): every shard is cut into several
NAMES = ("base", "moving", "table", "bias")


def whole(step: int) -> dict[str, np.ndarray]:
    """The state at ``step`` as whole arrays: ``base`` and ``table`` never change (frozen), ``moving`` and
    ``bias`` change at every step."""
    return {
        "base": (np.arange(240 * 64, dtype=np.float32) % 29).reshape(240, 64),  # sharded along dim 0, frozen
        "moving": np.full((120, 32), float(step), dtype=np.float32) + np.arange(32, dtype=np.float32),  # sharded
        "table": np.tile(np.arange(100, dtype=np.float32), (60, 1)),  # replicated, frozen: written once
        "bias": np.full(8, float(step), dtype=np.float64),  # replicated, changes
    }


def state_for(world: int, step: int, fill: float | None = None) -> dict[str, Any]:
    """This rank's state: DTensor shards of ``base`` and ``moving``, the rest replicated; ``fill``: every
    value replaced by it (a fresh state to restore into)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    arrays = whole(step)
    if fill is not None:
        arrays = {k: np.full_like(v, fill) for k, v in arrays.items()}
    mesh = init_device_mesh("cpu", (world,))
    return {
        "base": distribute_tensor(torch.from_numpy(arrays["base"]), mesh, [Shard(0)]),
        "moving": distribute_tensor(torch.from_numpy(arrays["moving"]), mesh, [Shard(0)]),
        "table": torch.from_numpy(arrays["table"]),
        "bias": torch.from_numpy(arrays["bias"]),
        "step": step if fill is None else -1,
    }


def full(state: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for k in NAMES:
        t = state[k]
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[k] = t.detach().numpy().copy()
    return out


def _manager(directory: str, options: dict[str, Any], **more: Any) -> trainstate.CheckpointManager:
    return trainstate.CheckpointManager(directory, incremental=True, **options, **more)


def run(rank: int, world: int, directory: str, options: dict[str, Any], steps: list[int]) -> Any:
    """Resume the run (restore_latest), then save ``steps`` async every step keeping the last 2; what was
    resumed and each save's bytes."""
    before, _transforms.TRANSFORM_CHUNK_BYTES = _transforms.TRANSFORM_CHUNK_BYTES, CHUNK
    try:
        with _manager(directory, options, every_steps=1, keep_last=2, async_save=True) as mgr:
            back = state_for(world, 0, fill=7.0)
            resumed = mgr.restore_latest(back)
            got = full(back) if resumed is not None else None
            for step in steps:
                mgr.save(step, state_for(world, step))
            mgr.wait()
            written = {r.step: r.nbytes for r in mgr.history()}
    finally:
        _transforms.TRANSFORM_CHUNK_BYTES = before
    return {"resumed": resumed, "restored": got, "written": written}


def load(rank: int, world: int, path: str, key: str | None) -> Any:
    """The checkpoint at ``path`` restored into fresh DTensors at this world size, as whole arrays."""
    state = state_for(world, 0, fill=7.0)
    out = trainstate.load(path, state, key=key)
    return {**full(state), "step": out["step"]}


def resume_only(rank: int, world: int, directory: str, options: dict[str, Any]) -> Any:
    """What restore_latest restores, and the step it resumes at, with nothing saved."""
    with _manager(directory, options) as mgr:
        back = state_for(world, 0, fill=7.0)
        resumed = mgr.restore_latest(back)
        return {"resumed": resumed, "restored": full(back) if resumed is not None else None}


def killed_in_collection(rank: int, world: int, directory: str, options: dict[str, Any], steps: list[int]) -> Any:
    """Save ``steps`` every step keeping the last 2 (sync); rank 0 is SIGKILLed by its own pool collection,
    right after it deleted the first pool file of the run (the other ranks then fail, or die with it)."""
    from trainstate._incremental import gc

    if rank == 0:
        real = gc.PoolCollector.collect

        def collect(self: Any, **kwargs: Any) -> Any:
            storage = self.storage
            delete = storage.delete

            def delete_then_die(path: str) -> Any:
                delete(path)
                os.kill(os.getpid(), signal.SIGKILL)

            storage.delete = delete_then_die
            try:
                return real(self, **kwargs)
            finally:
                storage.delete = delete

        gc.PoolCollector.collect = collect  # type: ignore[method-assign]
    with _manager(directory, options, every_steps=1, keep_last=2, timeout=20) as mgr:
        for step in steps:
            mgr.save(step, state_for(world, step))
    return "not killed"
