"""Functions each rank runs in the attacks on collective incremental / encrypted saves (importable by spawned
processes): states that change in small ways between saves (the last bytes, the dtype, the sharding)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import trainstate
from trainstate import _transforms

CHUNK = 4 << 10  # raw bytes per compressed chunk here: every shard is cut into several slabs


def whole(variant: str) -> dict[str, np.ndarray]:
    """The arrays of ``variant``: ``w`` sharded, ``r`` replicated; each variant differs from ``base`` in one
    way a dedupe could miss."""
    w = (np.arange(64 * 48, dtype=np.float32) % 1000).reshape(64, 48)
    r = np.arange(3000, dtype=np.float32)
    if variant == "tail":  # only the very last bytes of the last box
        w[-1, -1] += 1
        r[-1] += 1
    elif variant == "dtype":  # the same bytes under another dtype
        w, r = w.view(np.int32), r.view(np.int32)
    elif variant == "shape":  # the same bytes under another shape
        w = w.reshape(48, 64)
    elif variant == "head":  # only the very first bytes
        w[0, 0] += 1
    return {"w": w, "r": r}


def state_for(world: int, variant: str, fill: int | None = None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    arrays = whole(variant)
    if fill is not None:
        arrays = {k: np.full_like(v, fill) for k, v in arrays.items()}
    mesh = init_device_mesh("cpu", (world,))
    dim = 1 if variant == "shard1" else 0
    return {
        "w": distribute_tensor(torch.from_numpy(arrays["w"].copy()), mesh, [Shard(dim)]),
        "r": torch.from_numpy(arrays["r"].copy()),
    }


def saves(rank: int, world: int, run: str, plan: list[tuple[int, str]], options: dict[str, Any]) -> Any:
    """Save each ``(step, variant)`` of ``plan`` with an incremental manager (sync, every checkpoint kept
    unless ``options`` says otherwise); the bytes each save wrote."""
    options = dict(options)
    options.setdefault("keep_last", 100)
    before, _transforms.TRANSFORM_CHUNK_BYTES = _transforms.TRANSFORM_CHUNK_BYTES, CHUNK
    try:
        with trainstate.CheckpointManager(run, incremental=True, every_steps=1, **options) as mgr:
            for step, variant in plan:
                mgr.save(step, state_for(world, variant))
            mgr.wait()
            return {r.step: r.nbytes for r in mgr.history()}
    finally:
        _transforms.TRANSFORM_CHUNK_BYTES = before


def load(rank: int, world: int, path: str, variant: str, key: str | None) -> Any:
    """The checkpoint at ``path`` restored at this world size into ``variant``'s layout, as whole arrays."""
    state = state_for(world, variant, fill=7)
    trainstate.load(path, state, key=key)
    out = {}
    for k, t in state.items():
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[k] = t.detach().numpy().copy()
    return out


def single_saves(run: str, plan: list[tuple[int, str]], options: dict[str, Any]) -> None:
    """As :func:`saves`, in one process without a group: whole torch tensors."""
    options = dict(options)
    options.setdefault("keep_last", 100)
    with trainstate.CheckpointManager(run, incremental=True, every_steps=1, **options) as mgr:
        for step, variant in plan:
            mgr.save(step, {k: torch.from_numpy(v.copy()) for k, v in whole(variant).items()})


def killed_writing(rank: int, world: int, run: str, plan: list[tuple[int, str]], options: dict[str, Any]) -> Any:
    """As :func:`saves`, but rank 1 is SIGKILLed at its last save, right after it wrote its pool files."""
    import os
    import signal

    from trainstate._incremental.save import IncrementalSaver

    if rank == 1:
        real = IncrementalSaver._write_pool
        count = [0]

        def write_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = real(self, *args, **kwargs)
            count[0] += 1
            if count[0] == len(plan):
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        IncrementalSaver._write_pool = write_then_die  # type: ignore[method-assign]
    return saves(rank, world, run, plan, {**options, "timeout": 15})


def save_keys(rank: int, world: int, path: str, keys: list[str | None], compression: str | None = None) -> Any:
    """``trainstate.save`` with ``keys[rank]`` on each rank (a job whose nodes hold different keys)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {k: torch.from_numpy(v.copy()) for k, v in whole("base").items()}
    state["w"] = distribute_tensor(state["w"], mesh, [Shard(0)])
    return trainstate.save(path, state, key=keys[rank], compression=compression).nbytes


def manager_keys(rank: int, world: int, run: str, keys: list[str | None], async_save: bool = False) -> Any:
    """An incremental manager whose key is ``keys[rank]`` on each rank, saving twice."""
    with trainstate.CheckpointManager(
        run, incremental=True, every_steps=1, key=keys[rank], async_save=async_save
    ) as mgr:
        for step in (1, 2):
            mgr.save(step, state_for(world, "base" if step == 1 else "tail"))
    return "saved"


def edges(world: int, step: int) -> dict[str, Any]:
    """Boxes a dedupe or a merge may trip over: a tensor with fewer rows than ranks (an empty shard), an
    empty tensor sharded and replicated, a 0-d tensor; ``step`` changes the tiny one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {
        "tiny": distribute_tensor(torch.arange(10, dtype=torch.float32).reshape(2, 5) + step, mesh, [Shard(0)]),
        "frozen": distribute_tensor(torch.arange(10, dtype=torch.float64).reshape(2, 5), mesh, [Shard(0)]),
        "none": distribute_tensor(torch.zeros(0, 8), mesh, [Shard(0)]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }


def edge_saves(rank: int, world: int, run: str, steps: list[int], options: dict[str, Any]) -> Any:
    with trainstate.CheckpointManager(run, incremental=True, every_steps=1, keep_last=2, **options) as mgr:
        back = {k: (v * 0 - 1 if v.numel() else v) for k, v in edges(world, 0).items()}
        resumed = mgr.restore_latest(back)
        for step in steps:
            mgr.save(step, edges(world, step))
        got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).numpy().copy() for k, v in back.items()}
        return {"resumed": resumed, "restored": got}


def save_keys_unchecked(rank: int, world: int, path: str, keys: list[str | None]) -> Any:
    """:func:`save_keys` with rank 0's key comparison switched off: the checkpoint a writer without it
    committed (rank 1's chunks plaintext in an encrypted checkpoint)."""
    from trainstate._distributed import save

    save._key_identity = lambda options: None  # type: ignore[attr-defined]
    return save_keys(rank, world, path, keys)


def deleted_between_saves(rank: int, world: int, run: str, options: dict[str, Any]) -> Any:
    """Save, then rank 0 deletes by hand every pool file rank 1 wrote, then save the same state again: the
    second checkpoint must not name the deleted files."""
    import os

    import torch.distributed as dist

    before, _transforms.TRANSFORM_CHUNK_BYTES = _transforms.TRANSFORM_CHUNK_BYTES, CHUNK
    try:
        with trainstate.CheckpointManager(run, incremental=True, every_steps=1, keep_last=5, **options) as mgr:
            mgr.save(1, state_for(world, "base"))
            gone = []
            if rank == 0:
                pool = os.path.join(run, "_shared")
                gone = [n for n in os.listdir(pool) if "-r00001-" in n]
                for name in gone:
                    os.remove(os.path.join(pool, name))
            dist.barrier()
            mgr.save(2, state_for(world, "base"))
            mgr.save(3, state_for(world, "tail"))
        return gone
    finally:
        _transforms.TRANSFORM_CHUNK_BYTES = before


def save_key_env(rank: int, world: int, path: str, names: list[str]) -> Any:
    """``trainstate.save`` with ``key_env=names[rank]`` (a node where the variable is not set)."""
    import os

    os.environ["TRAINSTATE_ATTACK_KEY"] = "5a" * 32
    state = {k: torch.from_numpy(v.copy()) for k, v in whole("base").items()}
    return trainstate.save(path, state, key_env=names[rank]).nbytes
