"""What each rank runs in the consolidate and remote-storage tests (importable by spawned processes).

Sharded checkpoints are made the way a user's job makes them: FSDP2 (``fully_shard``) on a CPU device
mesh, DTensors sharded along other dimensions and unevenly, replicated tensors, and per-rank values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import trainstate


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def fsdp_model(world: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10)
    )  # 10 rows: uneven on 4
    mesh = _mesh(world)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def plain_model(seed: int = 123) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full(t: Any) -> np.ndarray:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


def sharded_state(rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trained FSDP2 state with every kind of part, and what it holds as whole NumPy arrays."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model, optim = fsdp_model(world)
    torch.manual_seed(1)
    for _ in range(2):
        model(torch.randn(8, 16)).sum().backward()
        optim.step()
        optim.zero_grad()
    torch.manual_seed(7)  # equal on every rank: distribute_tensor scatters rank 0's
    columns = distribute_tensor(torch.randn(6, 9), _mesh(world), [Shard(1)])  # sharded along dim 1
    state = {
        "model": model,
        "optim": optim,
        "step": 2,
        "columns": columns,
        "table": torch.arange(12.0).reshape(3, 4),  # replicated: equal on every rank, written once
        "rng": trainstate.RNGState(),
        "seen": trainstate.PerRank({"samples": 100 * (rank + 1), "buf": torch.full((3,), float(rank))}),
    }
    whole = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    whole.update({f"optim.{i}.{k}": full(v) for i, s in optim.state_dict()["state"].items() for k, v in s.items()})
    whole["columns"] = full(columns)
    return state, whole


def save_sharded(rank: int, world: int, path: str) -> Any:
    state, whole = sharded_state(rank, world)
    torch.manual_seed(1000 + rank)  # each rank's own stream from here: saved per rank
    trainstate.save(path, state)
    return {"whole": whole, "draw_next": torch.rand(4).numpy(), "seen": state["seen"].value["samples"]}


MB8 = 8 << 20


def save_big_shards(rank: int, world: int, path: str) -> Any:
    """Eight 8 MB float32 tensors, each sharded along its rows over the ranks; their sums as a check."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    state = {}
    for i in range(8):
        torch.manual_seed(i)
        state[f"t{i}"] = distribute_tensor(torch.randn(MB8 // 4 // 1024, 1024), mesh, [Shard(0)])
    trainstate.save(path, state)
    return {k: float(full(v).astype(np.float64).sum()) for k, v in state.items()}


def storage_for(endpoint: str | None) -> Any:
    """S3 at ``endpoint`` (the tests' moto server, through s3fs as a user reaches AWS), or the local disk."""
    if endpoint is None:
        return trainstate.LocalStorage()
    import s3fs

    from trainstate._storage.fsspec import FsspecStorage

    fs = s3fs.S3FileSystem(
        key="testing", secret="testing", endpoint_url=endpoint, client_kwargs={"region_name": "us-east-1"}
    )
    return FsspecStorage(fs)


def save_sharded_to(rank: int, world: int, url: str, endpoint: str | None) -> Any:
    """The sharded state saved collectively (on S3: each rank uploads its own files)."""
    state, whole = sharded_state(rank, world)
    torch.manual_seed(1000 + rank)
    trainstate.save(url, state, storage=storage_for(endpoint))
    return {"whole": whole, "draw_next": torch.rand(4).numpy(), "seen": state["seen"].value["samples"]}


def load_sharded_from(rank: int, world: int, url: str, endpoint: str | None) -> Any:
    """Every rank restores its own shards (fresh model, fresh optimizer) and its per-rank values."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model, optim = fsdp_model(world, seed=123)
    columns = distribute_tensor(torch.zeros(6, 9), _mesh(world), [Shard(1)])
    state = {
        "model": model,
        "optim": optim,
        "step": 0,
        "columns": columns,
        "table": torch.zeros(3, 4),
        "rng": trainstate.RNGState(),
        "seen": trainstate.PerRank({"samples": -1, "buf": torch.zeros(3)}),
    }
    trainstate.load(url, state, storage=storage_for(endpoint))
    whole = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    whole.update({f"optim.{i}.{k}": full(v) for i, s in optim.state_dict()["state"].items() for k, v in s.items()})
    whole["columns"] = full(columns)
    return {
        "whole": whole,
        "draw_next": torch.rand(4).numpy(),
        "seen": state["seen"].value["samples"],
        "step": state["step"],
        "table": state["table"].numpy().copy(),
    }


def save_filled(rank: int, world: int, url: str, endpoint: str | None, value: float, overwrite: bool) -> Any:
    """A small sharded tensor of ``value`` and a per-rank number, saved collectively."""
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.full((8, 4), value), _mesh(world), [Shard(0)])
    trainstate.save(
        url, {"w": w, "mine": trainstate.PerRank(value + rank)}, storage=storage_for(endpoint), overwrite=overwrite
    )


def die_while_uploading(rank: int, world: int, url: str, endpoint: str | None) -> Any:
    """Rank 1 dies (os._exit: no exception, no goodbye) part-way through writing its data file; on S3 after
    the first part of a multipart upload went up."""
    import os

    storage = storage_for(endpoint)
    if endpoint is not None:
        storage.part_size = 5 << 20  # S3's smallest multipart part: the file goes up in several parts
    if rank == 1:
        original = storage.write

        def write(path: str, views: Any, *, fsync: bool) -> int:
            def dying() -> Any:
                sent = 0
                for view in views:
                    yield view
                    sent += view.nbytes
                    if sent > 6 << 20:  # more than one part is out, the file is not finished
                        os._exit(17)

            return int(original(path, dying(), fsync=fsync))

        storage.write = write
    torch.manual_seed(rank)
    state = {"mine": trainstate.PerRank(torch.randn(4 << 20))}  # 16 MB that each rank writes itself
    trainstate.save(url, state, storage=storage, timeout=30)


def fail_while_uploading(rank: int, world: int, url: str, endpoint: str | None) -> Any:
    """Rank 1's storage refuses its data file: every rank raises, nothing is committed."""
    storage = storage_for(endpoint)
    if rank == 1:
        original = storage.write

        def write(path: str, views: Any, *, fsync: bool) -> int:
            if path.endswith(".safetensors"):
                raise trainstate.StorageError(13, f"write {path} failed: AccessDenied (refused by the test)")
            return int(original(path, views, fsync=fsync))

        storage.write = write
    torch.manual_seed(rank)
    trainstate.save(url, {"mine": trainstate.PerRank(torch.randn(1000))}, storage=storage, timeout=60)
