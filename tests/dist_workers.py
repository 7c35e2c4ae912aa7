"""Functions each rank runs in the distributed tests (importable by spawned processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

import trainstate


def replicated_save(rank: int, world: int, path: str) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)  # equal on every rank, as under DDP
    state = {"model": model, "step": 7, "rng": trainstate.RNGState(), "mine": trainstate.PerRank({"rank": rank})}
    torch.manual_seed(100 + rank)  # each rank's own random stream
    result = trainstate.save(path, state)
    return {"nbytes": result.nbytes, "weight": model.weight.detach().numpy().copy(), "draw_next": torch.rand(3).numpy()}


def replicated_load(rank: int, world: int, path: str) -> Any:
    model = torch.nn.Linear(64, 32)
    state = {"model": model, "step": 0, "rng": trainstate.RNGState(), "mine": trainstate.PerRank({"rank": -1})}
    out = trainstate.load(path, state)
    return {
        "weight": model.weight.detach().numpy().copy(),
        "step": out["step"],
        "mine": state["mine"].value,
        "draw_next": torch.rand(3).numpy(),
    }


def _fsdp_model(
    world: int, seed: int = 0, sizes: tuple[int, int, int] = (16, 24, 5)
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear-ReLU-Linear of ``sizes`` sharded over the ranks with FSDP2 (``fully_shard``), and AdamW over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.ReLU(), torch.nn.Linear(*sizes[1:]))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _full(t: Any) -> np.ndarray:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


def fsdp_save(rank: int, world: int, path: str) -> Any:
    model, optim = _fsdp_model(world)
    torch.manual_seed(1)
    for _ in range(2):
        model(torch.randn(8, 16)).sum().backward()
        optim.step()
        optim.zero_grad()
    trainstate.save(path, {"model": model, "optim": optim, "step": 2})
    out = {k: _full(v) for k, v in model.state_dict().items()}
    out["optim"] = {f"{i}.{k}": _full(v) for i, s in optim.state_dict()["state"].items() for k, v in s.items()}
    return out


def fsdp_save_alone(rank: int, world: int, path: str) -> Any:
    """Each rank saves its FSDP2 model on its own (collective=False): it holds only a shard of each weight."""
    model, optim = _fsdp_model(world)
    try:
        trainstate.save(f"{path}-{rank}", {"model": model}, collective=False)
    except trainstate.CheckpointError as e:
        return {"refused": f"{type(e).__name__}: {e}"}
    return {"refused": None}


def fsdp_load(rank: int, world: int, path: str) -> Any:
    model, optim = _fsdp_model(world, seed=123)  # different values, a fresh optimizer: the load replaces them
    trainstate.load(path, {"model": model, "optim": optim, "step": 0})
    out = {k: _full(v) for k, v in model.state_dict().items()}
    out["optim"] = {f"{i}.{k}": _full(v) for i, s in optim.state_dict()["state"].items() for k, v in s.items()}
    return out


def plain_paths(rank: int, world: int, path: str) -> Any:
    return sorted(p.name for p in Path(path).iterdir())


class _Broken:
    def state_dict(self) -> Any:
        raise RuntimeError("this rank's state cannot be read")

    def load_state_dict(self, state: Any) -> None:
        pass


def one_rank_fails_to_encode(rank: int, world: int, path: str) -> Any:
    state = {"w": torch.ones(4), "odd": _Broken() if rank == 1 else {}}
    trainstate.save(path, state, timeout=60)


def one_rank_dies_while_writing(rank: int, world: int, path: str) -> Any:
    import os

    from trainstate._save import write

    if rank == 1:
        original = write.write_data

        def die(*args: Any, **kwargs: Any) -> Any:
            os._exit(17)  # SIGKILL-like: no exception, no goodbye

        write.write_data = die
        import trainstate._distributed.save as collective

        collective.write_data = die
        del original
    trainstate.save(path, {"w": torch.arange(1000.0) + rank, "mine": trainstate.PerRank(rank)}, timeout=20)


def structure_differs(rank: int, world: int, path: str) -> Any:
    trainstate.save(path, {"w": torch.ones(4), "lr": 0.1 * (rank + 1)}, timeout=60)


def replicated_load_rng(rank: int, world: int, path: str) -> Any:
    trainstate.load(path, {"model": torch.nn.Linear(64, 32), "step": 0, "rng": trainstate.RNGState()}, strict=False)


def plain_to_fsdp_load(rank: int, world: int, path: str) -> Any:
    return fsdp_load(rank, world, path)


def save_on_rank_0_only(rank: int, world: int, path: str) -> Any:
    """``if rank == 0: trainstate.save(...)`` -- the mistake: the other ranks never come."""
    import os

    if rank != 0:
        return "skipped"
    os.environ["TRAINSTATE_DIST_TIMEOUT"] = "3"
    try:
        trainstate.save(path, {"w": np.ones(3)})
    finally:
        del os.environ["TRAINSTATE_DIST_TIMEOUT"]
    return "saved"
