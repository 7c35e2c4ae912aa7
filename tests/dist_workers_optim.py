"""Functions each rank runs in tests/distributed/test_optimizer.py (importable by spawned processes).

Every rank feeds the same batch, so FSDP2's averaged gradients equal one process's bit for bit (the sum of
equal values divided by a power of two): a run on 2 ranks, one on 1 and one resumed at another world size
can be compared exactly. Layer sizes keep every shard a multiple of 16 elements, so the elementwise
optimizer kernels take the same vectorized path on a shard as on the whole tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import trainstate


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def fsdp(module: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def adamw(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)


def step(module: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    """Training step ``i``: its batch is the same on every rank and in every run."""
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 + i))
    module(batch).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def _full(t: Any) -> np.ndarray:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


def snapshot(module: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Whole values by parameter name (the model's and the optimizer's), and the optimizer's tensor types."""
    out: dict[str, Any] = {}
    kinds: set[str] = set()
    for name, p in module.named_parameters():
        out[name] = _full(p)
        for k, v in optim.state[p].items():
            out[f"{name}:{k}"] = _full(v)
            if v.dim():
                kinds.add(type(v).__name__)
    out["kinds"] = sorted(kinds)
    out["lr"] = optim.param_groups[0]["lr"]
    return out


def fsdp_train_save_and_go_on(rank: int, world: int, path: str) -> Any:
    """Two steps, save, then the uninterrupted run's third step."""
    m = fsdp(model(), world)
    optim = adamw(m)
    for i in range(2):
        step(m, optim, i)
    trainstate.save(path, {"model": m, "optim": optim, "step": 2})
    step(m, optim, 2)
    return snapshot(m, optim)


def fsdp_restore_and_step(rank: int, world: int, path: str) -> Any:
    """A fresh model (other weights) and a fresh optimizer: restore, then step three."""
    m = fsdp(model(seed=123), world)
    optim = adamw(m)
    trainstate.load(path, {"model": m, "optim": optim, "step": 0})
    restored = snapshot(m, optim)
    step(m, optim, 2)
    return {"restored": restored, "stepped": snapshot(m, optim)}


def fsdp_restore(rank: int, world: int, path: str) -> Any:
    """A fresh FSDP2 model and optimizer (the 16-24-5 model of tests/dist_workers.py), restored."""
    torch.manual_seed(123)
    m = fsdp(torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 5)), world)
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
    trainstate.load(path, {"model": m, "optim": optim, "step": 0})
    out = snapshot(m, optim)
    step_ok = True
    try:
        batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
        m(batch).sum().backward()
        optim.step()
    except Exception:  # noqa: BLE001 - reported to the test
        step_ok = False
    out["step_ok"] = step_ok
    return out


# -- a 2-D mesh: FSDP over tensor parallelism ----------------------------------------------------------


def tp_model(seed: int = 0) -> torch.nn.Module:
    """Even and uneven sizes: 10 rows over tp=2 then dp=2 are shards of 3 and 2; 7 over dp=2, of 4 and 3."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 24),
        torch.nn.ReLU(),
        torch.nn.Linear(24, 10),
        torch.nn.ReLU(),
        torch.nn.Linear(10, 7),
    )


def fsdp_tp(module: torch.nn.Module) -> torch.nn.Module:
    """Mesh (dp=2, tp=2): column-wise then row-wise tensor parallelism, then FSDP2 over dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(module, mesh["tp"], plan)
    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    return module


def tp_train_save(rank: int, world: int, path: str) -> Any:
    m = fsdp_tp(tp_model())
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for i in range(2):
        batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 + i))
        m(batch).sum().backward()
        optim.step()
        optim.zero_grad()
    placements = {name: str(p.placements) for name, p in m.named_parameters()}
    trainstate.save(path, {"model": m, "optim": optim, "step": 2})
    return {"values": snapshot(m, optim), "placements": placements}


def fsdp_restore_tp_model(rank: int, world: int, path: str) -> Any:
    """The 2-D checkpoint on a 1-D mesh (FSDP2 only), into a fresh model and optimizer."""
    m = fsdp(tp_model(seed=123), world)
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
    trainstate.load(path, {"model": m, "optim": optim, "step": 0})
    return snapshot(m, optim)


def strided_rows(rank: int, world: int, path: str, what: str) -> Any:
    """A DTensor whose shard on each rank is two runs of rows (not one box): saving it or loading into it
    must fail with a clear error, never write or read the wrong rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(16.0).reshape(8, 2)
    placements = (Shard(0), _StridedShard(0, split_factor=2))
    # Rank (i, j) holds rows 4i + j and 4i + j + 2 (torch's own example in compute_local_shape_and_global_offset).
    i, j = divmod(rank, 2)
    local = full[[4 * i + j, 4 * i + j + 2]].clone()
    t = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())
    if what == "save":
        trainstate.save(path, {"w": t}, timeout=60)
    else:
        trainstate.load(path, {"w": t})
    return t.to_local().tolist()
