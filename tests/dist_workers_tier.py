"""A training job with a local tier, run by each rank of test_local_tier_ranks.py: FSDP2 (``fully_shard``) with
AdamW and dropout, a durable checkpoint every 10 steps and a local one every step, each node's local checkpoints
copied to the next node. "Nodes" are simulated on one machine: ``LOCAL_WORLD_SIZE`` ranks each, and each node's
local path is ``ROOT/node{n}``."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import torch

import trainstate

STEPS = 26


def _model(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(
    rank: int, world: int, root: str, per_node: int, kill_at: int | None, quiet: bool = False, replicas: int = 1
) -> Any:
    """Resume ``root`` (restore_latest) and train to STEPS, or SIGKILL every rank right after saving ``kill_at``
    (``quiet``: once that local save and its copies to the peers are done; else with them in flight); returns
    (the step resumed at, the full weights, the next draw of torch's generator)."""
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    torch.set_num_threads(1)
    model, optim = _model(world)
    torch.manual_seed(100 + rank)  # each rank's dropout differs: a resume must give each its own generator back
    state = {"model": model, "optim": optim, "rng": trainstate.RNGState()}
    tier = trainstate.LocalTier(f"{root}/node{rank // per_node}", every_steps=1, replicas=replicas, keep=2)
    mgr = trainstate.CheckpointManager(f"{root}/durable", every_steps=10, keep_last=2, local=tier, timeout=60)
    start = mgr.restore_latest(state) or 0
    with open(f"{root}/starts.r{rank}", "a") as f:  # where each launch resumed, for the test
        f.write(f"{start}\n")
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(6, 8, generator=g)
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        mgr.save(step, state)
        if step == kill_at:
            if quiet:
                mgr.wait()  # the local save committed, and its copies to the peers made
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    full = {k: v.full_tensor().detach().numpy().copy() for k, v in model.state_dict().items()}
    return start, full, float(torch.rand(()))


def weights_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def no_room_on_one_node(rank: int, world: int, root: str) -> tuple[str, str]:
    """Rank 1's node has no room for the state (a budget too small there): every rank raises, none hangs."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    budget = 1000 if rank == 1 else None
    tier = trainstate.LocalTier(f"{root}/node{rank}", every_steps=1, budget_bytes=budget)
    state = {"w": np.zeros(10_000, dtype=np.float32)}
    with trainstate.CheckpointManager(f"{root}/durable", every_steps=10, local=tier, timeout=60) as mgr:
        try:
            mgr.save(1, state)
        except trainstate.CheckpointError as e:
            return type(e).__name__, str(e)
    return "saved", ""


def one_path_for_two_nodes(rank: int, world: int, root: str) -> tuple[str, str]:
    """Two "nodes" (LOCAL_WORLD_SIZE=1) given one local path: refused on every rank."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        trainstate.CheckpointManager(f"{root}/durable", local=trainstate.LocalTier(f"{root}/shared"), timeout=60)
    except trainstate.CheckpointError as e:
        return type(e).__name__, str(e)
    return "built", ""
