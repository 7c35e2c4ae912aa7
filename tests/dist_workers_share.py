"""What each rank runs in the tests of a collective load's shared reads (tests/distributed/test_shared_reads.py).

A counting storage forwards every call to the real one, maps nothing (so every byte read goes through
``read_into``) and counts the bytes of data files it returns: the read amplification of a load is the sum of
every rank's count over the checkpoint's tensor bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import dist_workers_consolidate as consolidate_workers
import trainstate
from storage.wrapping import Wrapping
from trainstate import Storage

TENSORS = 20


class Counting(Wrapping):
    """Forwards everything to ``inner`` (storage/wrapping.py), maps nothing, and counts the data-file bytes
    ``read_into`` returns."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.data_bytes = 0

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        got = self.inner.read_into(path, offset, out)
        if self.inner.name(path).startswith("data"):
            self.data_bytes += got
        return got

    def map(self, path: str) -> Any:
        return None  # every byte through read_into, where it is counted


storage_for = consolidate_workers.storage_for  # S3 at an endpoint (the tests' moto server), or the local disk


def replicas(fill: float | None = None) -> dict[str, torch.Tensor]:
    """A DDP model's parameters: the same on every rank (a seed), 20 tensors of 2.8 MB in all."""
    g = torch.Generator().manual_seed(0)
    out = {f"w{i:02d}": torch.randn(50 + 13 * i, 200, generator=g) for i in range(TENSORS)}
    if fill is not None:
        for t in out.values():
            t.fill_(fill)
    return out


def save_replicas(rank: int, world: int, path: str, endpoint: str | None) -> Any:
    """A collective save of the replicated state (each tensor written once, by one rank)."""
    trainstate.save(path, {"model": replicas(), "step": 3}, storage=storage_for(endpoint))
    return None


def load_replicas(rank: int, world: int, path: str, endpoint: str | None, collective: bool | None) -> Any:
    """Every rank restores the replicas into a state of its own (filled with -1) through a counting storage."""
    state = {"model": replicas(fill=-1.0), "step": 0}
    storage = Counting(storage_for(endpoint))
    kwargs = {} if collective is None else {"collective": collective}
    trainstate.load(path, state, storage=storage, **kwargs)
    return {
        "read": storage.data_bytes,
        "values": {k: v.numpy().copy() for k, v in state["model"].items()},
        "step": state["step"],
    }


def load_without_target(rank: int, world: int, path: str) -> Any:
    """``trainstate.load(path)`` on every rank: fresh arrays, shared the same way."""
    storage = Counting(trainstate.LocalStorage())
    tree = trainstate.load(path, storage=storage)
    return {"read": storage.data_bytes, "values": tree["model"], "step": tree["step"]}


def load_boxes(rank: int, world: int, path: str, collective: bool) -> Any:
    """FSDP-style: each of 4 ranks a different box of most tensors (rows), nothing shared; one replicated
    tensor that every rank holds (w00); and one HSDP-style tensor (w10) on a (2, 2) mesh, replicated over the
    first dim and sharded over the second, so ranks r and r + 2 hold the same box."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    assert world == 4
    mesh = init_device_mesh("cpu", (world,))
    full = replicas()
    want = {k: v.chunk(world)[rank] for k, v in full.items() if v.shape[0] % world == 0}
    state: dict[str, Any] = {
        k: DTensor.from_local(torch.full_like(want[k], -1.0), mesh, [Shard(0)], shape=v.shape, stride=v.stride())
        for k, v in full.items()
        if k in want
    }
    state["w00"] = DTensor.from_local(torch.full_like(full["w00"], -1.0), mesh, [Replicate()])
    want["w00"] = full["w00"]
    square = init_device_mesh("cpu", (2, 2))
    w10 = full["w10"]
    want["w10"] = w10.chunk(2)[rank % 2]
    state["w10"] = DTensor.from_local(
        torch.full_like(want["w10"], -1.0), square, [Replicate(), Shard(0)], shape=w10.shape, stride=w10.stride()
    )
    storage = Counting(trainstate.LocalStorage())
    trainstate.load(path, {"model": state, "step": 0}, storage=storage, strict=False, collective=collective)
    return {"read": storage.data_bytes, "ok": {k: bool(torch.equal(t.to_local(), want[k])) for k, t in state.items()}}


def load_damaged(rank: int, world: int, path: str, damaged: str) -> Any:
    """Restore into a state filled with 7; return the error kind and whether the damaged tensor still holds
    only 7s (no byte of the checkpoint's reached it)."""
    state = {"model": replicas(fill=7.0), "step": 0}
    try:
        trainstate.load(path, state, storage=Counting(trainstate.LocalStorage()), timeout=60)
    except trainstate.CheckpointError as e:
        kind, message = type(e).__name__, str(e)
    else:
        kind, message = None, ""
    return {"kind": kind, "message": message, "untouched": bool(torch.all(state["model"][damaged] == 7.0))}


def load_damaged_unverified_elsewhere(rank: int, world: int, path: str, damaged: str, unverified: int) -> Any:
    """``load_damaged`` where rank ``unverified`` loads with ``verify=False``: the ranks that verify must not
    take that rank's unchecked bytes (each reads, and checks, its own)."""
    state = {"model": replicas(fill=7.0), "step": 0}
    try:
        trainstate.load(path, state, verify=rank != unverified, timeout=60)
    except trainstate.CheckpointError as e:
        kind = type(e).__name__
    else:
        kind = None
    return {"kind": kind, "untouched": bool(torch.all(state["model"][damaged] == 7.0))}


def load_mismatched_on_rank_1(rank: int, world: int, path: str) -> Any:
    """Rank 1's state does not fit (one tensor of another shape): every rank raises, before any byte is read."""
    model = replicas(fill=-1.0)
    if rank == 1:
        model["w03"] = torch.zeros(3, 3)
    storage = Counting(trainstate.LocalStorage())
    try:
        trainstate.load(path, {"model": model, "step": 0}, storage=storage, timeout=60)
    except trainstate.CheckpointError as e:
        kind, message = type(e).__name__, str(e)
    else:
        kind, message = None, ""
    return {"kind": kind, "message": message, "read": storage.data_bytes}


def load_optimizer_mismatched_on_rank_1(rank: int, world: int, path: str) -> Any:
    """A fresh model and optimizer (rank 1's model of another size): rank 0 learns of rank 1's failure before
    it reads, and its fresh optimizer is left without state, as a failure of its own would leave it."""
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 4 if rank == 0 else 5)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        trainstate.load(path, {"model": model, "optim": optim, "step": 0}, timeout=60)
    except trainstate.CheckpointError as e:
        return {"kind": type(e).__name__, "optim_state": len(optim.state)}
    return {"kind": None, "optim_state": len(optim.state)}


def load_on_rank_0_only(rank: int, world: int, path: str, again: bool) -> Any:
    """``if rank == 0: trainstate.load(...)``: the other ranks never come (``again``: after a load they all
    made, so the coordination group exists and the exchange itself times out)."""
    if again:
        trainstate.load(path, {"model": replicas(fill=-1.0), "step": 0}, timeout=5)
    if rank != 0:
        return "skipped"
    trainstate.load(path, {"model": replicas(fill=-1.0), "step": 0}, timeout=5)
    return "loaded"


def load_own(rank: int, world: int, root: str) -> Any:
    """Each rank loads a checkpoint of its own (same names, other values), collectively."""
    state = {"model": {"w": np.zeros((64, 8), np.float32)}, "step": 0}
    trainstate.load(f"{root}/c{rank}", state)
    return float(state["model"]["w"].mean())


def manager_save_and_restore(rank: int, world: int, root: str) -> Any:
    """A manager under the process group saves the replicas, then restores them through a counting storage."""
    with trainstate.CheckpointManager(root, capture_rng=False) as mgr:
        mgr.save(4, {"model": replicas(), "step": 4}, force=True)
    storage = Counting(trainstate.LocalStorage())
    state = {"model": replicas(fill=-1.0), "step": 0}
    with trainstate.CheckpointManager(root, storage=storage, capture_rng=False) as mgr:
        start = mgr.restore_latest(state)
    same = all(torch.equal(state["model"][k], v) for k, v in replicas().items())
    return {"read": storage.data_bytes, "start": start, "same": same}


def tensor_bytes() -> int:
    return sum(v.numel() * v.element_size() for v in replicas().values())


def as_arrays(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in state.items()}


def as_accelerator_targets() -> None:
    """Make this process treat CPU tensors as accelerator ones: restores go through the ring (with small
    slots) and a collective load shares them the way it shares GPU tensors (through host buffers, in
    small pieces), so the accelerator path runs where no accelerator is."""
    from trainstate._frameworks import torch as torch_adapter
    from trainstate._restore import ring, shared

    torch_adapter.on_accelerator = lambda value: isinstance(value, torch.Tensor)  # type: ignore[assignment]
    ring.MIN_SLOT_BYTES = 1 << 20
    ring.LANE_BYTES = 1 << 16
    shared.PIECE = 40_000  # several pieces per tensor, one not a multiple of another


def load_replicas_on_devices(rank: int, world: int, path: str, collective: bool | None, tied: bool = False) -> Any:
    """``load_replicas`` with the targets standing for accelerator tensors; with ``tied`` (a checkpoint that
    stored w03 once for two places), w03's second place is memory of its own here, and must get its bytes."""
    as_accelerator_targets()
    state: dict[str, Any] = {"model": replicas(fill=-1.0), "step": 0}
    if tied:
        state["copy_of_w03"] = torch.full_like(state["model"]["w03"], -1.0)
    storage = Counting(trainstate.LocalStorage())
    kwargs = {} if collective is None else {"collective": collective}
    trainstate.load(path, state, storage=storage, **kwargs)
    values = {k: v.numpy().copy() for k, v in state["model"].items()}
    if tied:
        values["copy_of_w03"] = state["copy_of_w03"].numpy().copy()
    return {"read": storage.data_bytes, "values": values, "step": state["step"]}


def load_damaged_on_devices(rank: int, world: int, path: str, damaged: str) -> Any:
    as_accelerator_targets()
    return load_damaged(rank, world, path, damaged)


def load_with_rank_dying_after_it_came(rank: int, world: int, path: str) -> Any:
    """A collective load in which the last rank dies right after it came to make the load's coordination group
    (before the group is made): torch's group creation would wait for it for as long as the store allows."""
    import os
    import time

    from trainstate._distributed import group

    group._groups.clear()  # these ranks may have made a load group in an earlier test: every rank makes a new one
    if rank == world - 1:
        arrive = group._arrive

        def arrive_then_die(*args: Any, **kwargs: Any) -> None:
            arrive(*args, **kwargs)
            time.sleep(0.5)  # the others are in new_group by now
            os._exit(3)

        group._arrive = arrive_then_die  # type: ignore[assignment]
    started = time.monotonic()
    try:
        trainstate.load(path, {"model": replicas(fill=-1.0), "step": 0})
    except trainstate.DistributedError as e:
        return {"seconds": time.monotonic() - started, "message": str(e)}
    return {"seconds": time.monotonic() - started, "message": "loaded"}
