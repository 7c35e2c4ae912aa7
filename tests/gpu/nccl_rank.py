"""One rank of an NCCL job (tests/gpu/test_cuda.py): FSDP2 on a CUDA mesh, async manager saves."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainstate


def _fsdp(mesh: Any, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16)).cuda()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main(root: str) -> None:
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model, opt = _fsdp(mesh, seed=0)
    state = {"model": model, "optim": opt, "step": 0}
    with trainstate.CheckpointManager(root, every_steps=2, async_save=True, keep_last=2) as mgr:
        for step in range(1, 7):
            loss = model(torch.randn(8, 64, device="cuda")).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            dist.all_reduce(torch.ones(1, device="cuda"))  # the loop's own NCCL collectives go on meanwhile
            state["step"] = step
            mgr.save(step, state)
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    torch.save(full, f"{root}/../expected.pt")

    fresh, fresh_opt = _fsdp(mesh, seed=1)  # the newest checkpoint back into CUDA shards
    with trainstate.CheckpointManager(root) as mgr:
        assert mgr.restore_latest({"model": fresh, "optim": fresh_opt, "step": 0}) == 7
    for k, v in fresh.state_dict().items():
        assert v.device.type == "cuda" and torch.equal(v.full_tensor().cpu(), full[k]), k
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
