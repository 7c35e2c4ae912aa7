"""A small FSDP2 training job saved by CheckpointManagers with feature sets, for tests/distributed/test_ranks_killed.py.

Launched as a real job (fresh processes: what a SIGKILL test needs):
    python -m torch.distributed.run --standalone --nproc-per-node N tests/ranks_train.py JOB
        --runs '[["DIR", {"compression": "zstd", "key": "..."}], ...]' --steps S --every K
        [--pace SECONDS] [--separately]
each rank first writes its pid to JOB/pids/rank{r} (torchrun starts every rank in a session of its own: the
test kills each rank's process group as well as the launcher's), and at the end JOB/final-r{r}.pkl: a list
of what ``train`` returned. Without ``--separately`` the job trains once, from scratch, saving through one
manager per run (each its own directory and feature set); with it, it trains once per run, each resuming
from that run's newest checkpoint (``train_each``). ``train`` and ``train_each`` also run on the ranks of
tests/ranks.py, and ``restore`` reads a checkpoint of the job into a fresh model at any world size.

The job: an MLP with dropout, every layer ``fully_shard``-ed on a CPU DeviceMesh (each rank holds other
rows), AdamW, a cosine schedule, a loader over ``ResumableSampler`` whose dataset augments with Python's,
NumPy's and torch's generators, and ``RNGState``. Steps ``start``..``S-1``, ``mgr.save(step)`` after each
(async, every K, keeping 2): with ``(S - 1) % K == 0`` the newest checkpoint holds the final state. A
feature set is CheckpointManager arguments (compression, key; incremental once groups take it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import random
import time
from typing import Any

import numpy as np
import torch

import trainstate
from trainstate import _transforms

CHUNK = 4 << 10  # raw bytes per compressed / encrypted chunk (4 MiB by default): each shard is cut into several
DROPPED_AT_ANOTHER_WORLD_SIZE = ["rng", "sampler"]  # per-rank values: refused at another world size


def build(world: int, rank: int, seed: int = 0) -> dict[str, Any]:
    """The job's state on this rank: FSDP2 model, AdamW, schedule, sampler and RNG; the loader under
    ``"loader"`` (not part of the checkpoint: the sampler is)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader

    import resume_recipe

    data = np.random.default_rng(42)
    x = torch.from_numpy(data.standard_normal((203, 12)).astype(np.float32))
    y = torch.from_numpy(data.integers(0, 4, 203))
    dataset = resume_recipe.Augmented(x, y)
    torch.manual_seed(seed)  # the same initial weights on every rank; fully_shard keeps each rank's rows
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 96),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(96, 96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 4),
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(100 + rank)  # each rank its own dropout and augmentation streams
    np.random.seed(100 + rank)
    random.seed(100 + rank)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=50)
    sampler = trainstate.ResumableSampler(dataset, seed=7, num_replicas=world, rank=rank)
    loader = sampler.attach(DataLoader(dataset, batch_size=8, sampler=sampler))
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "sampler": sampler,
        "rng": trainstate.RNGState(),
        "loader": loader,
    }


def _full(t: Any) -> np.ndarray:
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()  # collective: every rank calls it, in the same order
    return t.detach().numpy().copy()


def values(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """The model's and the optimizer's tensors as whole arrays (the same on every rank), under the names
    the checkpoint gives them (``model.0.weight``, ``optim.state.model.0.weight.exp_avg``)."""
    model = state["model"]
    out = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    names = [name for name, _ in model.named_parameters()]  # the optimizer's parameter order
    for i, moments in sorted(state["optim"].state_dict()["state"].items()):
        out.update({f"optim.state.model.{names[i]}.{k}": _full(v) for k, v in sorted(moments.items())})
    return out


def train(
    rank: int,
    world: int,
    runs: list[tuple[str, dict[str, Any]]],
    steps: int,
    every: int,
    pace: float = 0.0,
) -> dict[str, Any]:
    """Train to step ``steps - 1``, saving asynchronously every ``every`` steps (keeping 2) with one manager
    per run: ``(directory, features)``, features being CheckpointManager arguments. With one run it resumes
    from that directory's newest checkpoint, if any; several runs save one training (each its own way) and
    start fresh. Returns where it started, the final values and the next draws of this rank's torch
    generator."""
    state = build(world, rank)
    loader = state.pop("loader")
    model, optim, sched = state["model"], state["optim"], state["sched"]
    before, _transforms.TRANSFORM_CHUNK_BYTES = _transforms.TRANSFORM_CHUNK_BYTES, CHUNK
    try:
        with contextlib.ExitStack() as stack:
            managers = [
                stack.enter_context(
                    trainstate.CheckpointManager(d, every_steps=every, keep_last=2, async_save=True, **features)
                )
                for d, features in runs
            ]
            starts = [mgr.restore_latest(state) for mgr in managers]
            if len(runs) > 1 and any(s is not None for s in starts):
                raise ValueError(f"several runs resumed at once (from steps {starts}): give one")
            start = step = starts[0] or 0
            model.train()
            while step < steps:
                for xb, yb in loader:
                    loss = torch.nn.functional.cross_entropy(model(xb), yb)
                    loss.backward()
                    optim.step()
                    sched.step()
                    optim.zero_grad()
                    for mgr in managers:
                        mgr.save(step, state)
                    step += 1
                    time.sleep(pace)  # the killed job's: time for the test to see checkpoints and kill
                    if step >= steps:
                        break
    finally:
        _transforms.TRANSFORM_CHUNK_BYTES = before
    return {"start": start, "values": values(state), "rng_next": torch.rand(4).numpy()}


def train_each(
    rank: int, world: int, runs: list[tuple[str, dict[str, Any]]], steps: int, every: int
) -> list[dict[str, Any]]:
    """``train`` for each run in turn, each resuming from its own newest checkpoint: what ``train`` returns,
    per run."""
    return [train(rank, world, [run], steps, every) for run in runs]


def restore(rank: int, world: int, path: str, key: str | None = None) -> dict[str, np.ndarray]:
    """The checkpoint at ``path`` read into a fresh model and optimizer at this world size, as whole arrays
    (its per-rank values, the RNG's and the sampler's, left out: they belong to the saving world size)."""
    state = build(world, rank, seed=123)  # other initial weights, fresh moments: the load must replace them
    del state["loader"]
    trainstate.load(path, state, key=key, exclude=DROPPED_AT_ANOTHER_WORLD_SIZE)
    return values(state)


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("job", help="where the ranks write their pids and results")
    ap.add_argument("--runs", required=True, help='JSON: [[directory, {"compression": "zstd", ...}], ...]')
    ap.add_argument("--separately", action="store_true", help="one training per run, each resuming its own")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--pace", type=float, default=0.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(os.path.join(args.job, "pids"), exist_ok=True)
    with open(os.path.join(args.job, "pids", f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    runs = [tuple(run) for run in json.loads(args.runs)]
    if args.separately:
        out = train_each(rank, world, runs, args.steps, args.every)
    else:
        out = [train(rank, world, runs, args.steps, args.every, args.pace)]
    with open(os.path.join(args.job, f"final-r{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    print(f"rank {rank} started at {[o['start'] for o in out]}", flush=True)
    dist.destroy_process_group()  # after the managers closed: an async save in flight needs the group


if __name__ == "__main__":
    main()
