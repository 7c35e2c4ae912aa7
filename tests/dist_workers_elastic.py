"""A DDP training loop over the global sample stream, run by each rank of the elastic-resume tests: it logs
every sample it consumes (with its augmentation draws) and can be SIGKILLed mid-epoch."""

from __future__ import annotations

import json
import os
import random
import signal
from typing import Any

import numpy as np
import torch

import trainstate
from dist_workers import _fsdp_model

TOTAL = 104  # samples: 13 global batches of 8 per epoch
GLOBAL_BATCH = 8
EPOCHS = 2
STEPS = EPOCHS * TOTAL // GLOBAL_BATCH  # optimizer steps, one per global batch
SEED = 7


class Augmented(torch.utils.data.Dataset):
    """Each sample: its index and three draws of its augmentation (Python's, NumPy's and torch's generator)."""

    def __len__(self) -> int:
        return TOTAL

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "index": i,
            "x": torch.full((4,), float(i)),
            "aug": torch.tensor([random.random(), float(np.random.rand()), float(torch.rand(()))], dtype=torch.float64),
        }


def train(
    rank: int, world: int, run: str, log: str, micro: int, kill_at: int | None, workers: int, fsdp: bool = False
) -> Any:
    """Resume ``run`` (restore_latest), train to the end, or SIGKILL this rank right after optimizer step
    ``kill_at`` (every rank does, so the whole job dies). Each consumed micro-batch is one JSON line in
    ``log`` (this rank's own file): step, epoch, rank, indices and augmentation draws. ``fsdp``: the model is
    sharded with FSDP2 (restored on another number of ranks, its shards are cut again), else DDP."""
    torch.manual_seed(0)
    if fsdp:
        model, opt = _fsdp_model(world, sizes=(4, 6, 1))
    else:
        model = torch.nn.Linear(4, 1)
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = trainstate.ResumableSampler(
        TOTAL, seed=SEED, num_replicas=world, rank=rank, global_batch_size=GLOBAL_BATCH, micro_batches=micro
    )
    loader = sampler.attach(torch.utils.data.DataLoader(Augmented(), batch_sampler=sampler, num_workers=workers))
    state = {"model": model, "opt": opt, "sampler": sampler, "rng": trainstate.RNGState(seed=SEED)}
    with open(f"{log}.r{rank}", "a") as out, trainstate.CheckpointManager(run, every_steps=3, keep_last=2) as mgr:
        step = mgr.restore_latest(state) or 0
        received = 0
        while step < STEPS:
            for batch in loader:
                record = {
                    "step": step,
                    "epoch": sampler.epoch,
                    "world": world,
                    "rank": rank,
                    "indices": batch["index"].tolist(),
                    "aug": batch["aug"].tolist(),
                    "dropout": float(torch.rand(())),  # the training process's own stream (per rank)
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
                loss = model(batch["x"]).pow(2).mean()
                loss.backward()
                received += 1
                if received % micro:
                    continue
                opt.step()
                opt.zero_grad()
                mgr.save(step, state)
                if step == kill_at:  # every rank at once: the whole job dies mid-epoch
                    if world > 1:
                        torch.distributed.barrier()
                    os.kill(os.getpid(), signal.SIGKILL)
                step += 1
                if step >= STEPS:
                    break
    return step
