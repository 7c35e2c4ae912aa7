"""One rank of an NCCL job (tests/gpu/test_cuda.py): FSDP2 on a CUDA mesh, async manager saves."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainstate


def main(root: str) -> None:
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16)).cuda()
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
