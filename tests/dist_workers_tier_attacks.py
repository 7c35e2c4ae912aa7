"""Rank workers of test_local_tier_ranks_attacks.py: the local tier under a process group, attacked."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple
from typing import Any

import numpy as np

import trainstate


def _state(step: int) -> dict[str, Any]:
    return {"w": np.full(10_000, step, np.float32), "step": step}


def mismatched_config(rank: int, world: int, root: str, field: str, values: tuple[Any, Any]) -> Any:
    """Each rank given its own LocalTier ``field``; saves 1..12, closes, then resumes."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    kw: dict[str, Any] = {"every_steps": 1, "replicas": 1, field: values[rank]}
    try:
        tier = trainstate.LocalTier(f"{root}/node{rank}", **kw)
        with trainstate.CheckpointManager(f"{root}/durable", every_steps=100, local=tier, timeout=15) as mgr:
            for step in range(1, 13):
                state = _state(step)
                mgr.save(step, state)
        with trainstate.CheckpointManager(f"{root}/durable", every_steps=100, local=tier, timeout=15) as mgr:
            state = _state(-1)
            start = mgr.restore_latest(state)
        return "resumed", start, state["step"]
    except Exception as e:  # noqa: BLE001
        return "raised", type(e).__name__, str(e)[:300]


def keep_one(rank: int, world: int, root: str, phase: str) -> Any:
    """replicas=0, keep=1. ``train``: saves 1..5, rank 1's folder then set aside as it was after step 4;
    ``lose``: rank 1's folder put back as it was after step 4 (its save of 5 was in flight at a kill);
    ``resume``: the step resumed at."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    tier = trainstate.LocalTier(f"{root}/node{rank}", every_steps=1, replicas=0, keep=1)
    mine = f"{root}/node{rank}/w{world}/rank{rank:05d}"
    if phase == "train":
        with trainstate.CheckpointManager(f"{root}/durable", every_steps=100, local=tier, timeout=30) as mgr:
            for step in range(1, 6):
                mgr.save(step, _state(step))
                mgr.wait()
                if step == 4 and rank == 1:
                    shutil.copytree(mine, f"{root}/aside")
        return ("trained",)
    if phase == "lose":
        if rank == 1:  # as if killed with the save of step 5 in flight: its step 4 committed, 5 not
            shutil.rmtree(mine)
            shutil.copytree(f"{root}/aside", mine)
        return ("lost",)
    with trainstate.CheckpointManager(f"{root}/durable", every_steps=100, local=tier, timeout=30) as mgr:
        state = _state(-1)
        return mgr.restore_latest(state), state["step"]


def shared_node_room(rank: int, world: int, root: str) -> Any:
    """Both ranks on one node (LOCAL_WORLD_SIZE=2), one local path; the filesystem has room for one rank's
    local checkpoints (keep=1: two of them) and a half, not for both ranks'."""
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    from trainstate._manager import local_tier
    from trainstate._save.encode import encode_state

    one = encode_state(_state(0), local_view=(rank, world)).nbytes
    usage = namedtuple("usage", "total used free")

    class _Shutil:
        def __getattr__(self, name: str) -> Any:
            return getattr(shutil, name)

        @staticmethod
        def disk_usage(path: Any) -> Any:
            return usage(10**9, 0, 3 * one)  # room for 3 checkpoints of one rank on the node's filesystem

    local_tier.shutil = _Shutil()  # type: ignore[assignment]
    try:
        tier = trainstate.LocalTier(f"{root}/node0", every_steps=1, keep=1)
        with trainstate.CheckpointManager(f"{root}/durable", every_steps=100, local=tier, timeout=30) as mgr:
            try:
                mgr.save(1, _state(1))
            except trainstate.StorageError as e:
                return "refused", str(e)[:200]
        return "saved", 4 * one
    finally:
        local_tier.shutil = shutil  # type: ignore[assignment]


def plain_run(rank: int, world: int, root: str, steps: int) -> Any:
    """Two nodes of one rank, replicas=1, keep=2: saves 1..``steps``; what each node's path then holds."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    tier = trainstate.LocalTier(f"{root}/node{rank}", every_steps=1, replicas=1, keep=2)
    with trainstate.CheckpointManager(f"{root}/durable", every_steps=100, local=tier, timeout=30) as mgr:
        start = mgr.restore_latest(_state(-1)) or 1
        for step in range(start, steps + 1):
            mgr.save(step, _state(step))
    node = f"{root}/node{rank}/w{world}"
    return {d: sorted(os.listdir(f"{node}/{d}")) for d in sorted(os.listdir(node))}


def fetch_without_room(rank: int, world: int, root: str) -> Any:
    """Node 1's path was emptied (the node replaced) and its new tmpfs has no room: writing the copy rank 1 is
    sent on restore fails with ENOSPC there. What each rank's restore_latest does."""
    import errno
    import time

    from trainstate._manager import tier_peers

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    real = tier_peers.unpack

    def no_room(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 1:
        tier_peers.unpack = no_room  # type: ignore[assignment]
    began = time.monotonic()
    try:
        tier = trainstate.LocalTier(f"{root}/node{rank}", every_steps=1, replicas=1, keep=2)
        with trainstate.CheckpointManager(f"{root}/durable", every_steps=100, local=tier, timeout=15) as mgr:
            state = _state(-1)
            return "resumed", mgr.restore_latest(state), round(time.monotonic() - began)
    except Exception as e:  # noqa: BLE001
        return "raised", type(e).__name__, str(e)[:200], round(time.monotonic() - began)
    finally:
        tier_peers.unpack = real  # type: ignore[assignment]


def resume_only(rank: int, world: int, root: str) -> Any:
    """Two nodes of one rank, replicas=1: the step restore_latest resumes at, and the state's step."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    tier = trainstate.LocalTier(f"{root}/node{rank}", every_steps=1, replicas=1, keep=2)
    try:
        with trainstate.CheckpointManager(f"{root}/durable", every_steps=100, local=tier, timeout=30) as mgr:
            state = _state(-1)
            return "resumed", mgr.restore_latest(state), state["step"]
    except Exception as e:  # noqa: BLE001
        return "raised", type(e).__name__, str(e)[:300]


def layout(rank: int, world: int, root: str, sharded: bool, steps: int) -> Any:
    """A model trained (durable every 10 steps, local every step) with FSDP2 (``sharded``) or replicated plain
    tensors at the same world size; resumes first. The step resumed at (or the error)."""
    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim}
    tier = trainstate.LocalTier(f"{root}/node{rank}", every_steps=1, replicas=1, keep=2)
    try:
        with trainstate.CheckpointManager(f"{root}/durable", every_steps=10, local=tier, timeout=30) as mgr:
            start = mgr.restore_latest(state) or 0
            for step in range(start, steps):
                model(torch.ones(2, 8)).sum().backward()
                optim.step()
                optim.zero_grad()
                mgr.save(step, state)
        return "resumed", start
    except Exception as e:  # noqa: BLE001
        return "raised", type(e).__name__, str(e)[:300]


def local_write_fails(rank: int, world: int, root: str) -> Any:
    """Rank 1's local save of step 3 fails in the background (its node's tmpfs full: ENOSPC); every rank trains
    on to step 8. What each rank sees, and how long it took."""
    import errno
    import time

    from trainstate._manager import committer

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    real = committer.Committer._write

    def full(self: Any, step: int, *args: Any) -> Any:
        if step == 3 and f"node{rank}" in str(self.catalog.path("x")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, step, *args)

    if rank == 1:
        committer.Committer._write = full  # type: ignore[method-assign]
    began = time.monotonic()
    try:
        tier = trainstate.LocalTier(f"{root}/node{rank}", every_steps=1, replicas=1, keep=2)
        with trainstate.CheckpointManager(f"{root}/durable", every_steps=100, local=tier, timeout=15) as mgr:
            for step in range(1, 9):
                mgr.save(step, _state(step))
        return "trained", round(time.monotonic() - began)
    except Exception as e:  # noqa: BLE001
        return "raised", type(e).__name__, str(e)[:200], round(time.monotonic() - began)
    finally:
        committer.Committer._write = real  # type: ignore[method-assign]


def durable_every_5(rank: int, world: int, root: str, steps: int) -> Any:
    """Two nodes of one rank, replicas=1, keep=3, a durable checkpoint every 5 steps: resumes, trains to
    ``steps``; the step resumed at and the restored state's step."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    tier = trainstate.LocalTier(f"{root}/node{rank}", every_steps=1, replicas=1, keep=3)
    with trainstate.CheckpointManager(f"{root}/durable", every_steps=5, local=tier, timeout=30) as mgr:
        state = _state(-1)
        start = mgr.restore_latest(state)
        restored = state["step"]
        for step in range(start or 1, steps + 1):
            mgr.save(step, _state(step))
    return start, restored
