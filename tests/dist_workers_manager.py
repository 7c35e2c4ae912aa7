"""Rank functions for the CheckpointManager tests under a process group (run by ``ranks.run``)."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import numpy as np
import torch

import trainstate


def _state(rank: int, value: float) -> dict[str, Any]:
    return {
        "weight": torch.full((64, 64), value),  # equal on every rank: written once
        "mine": trainstate.PerRank(torch.full((1024,), float(rank) + value)),  # this rank's own
        "step": int(value),
    }


def run_with_retention(rank: int, world: int, directory: str, async_save: bool) -> Any:
    """Steps 0..9, saving every 2 and keeping 2; returns what each rank saw."""
    saved = []
    torch.manual_seed(1000 + rank)  # each rank its own RNG stream, captured by the manager
    with trainstate.CheckpointManager(directory, every_steps=2, keep_last=2, async_save=async_save) as mgr:
        for step in range(10):
            state = _state(rank, float(step))
            saved.append(mgr.save(step, state))
            if step == 8:
                expected_rng_next = float(torch.rand(1))  # the next draw after the last checkpoint
        mgr.wait()
        listed = [c.step for c in mgr.list()]
        history = [(h.step, h.error) for h in mgr.history()]
    back = _state(rank, -1.0)
    with trainstate.CheckpointManager(directory) as again:
        start = again.restore_latest(back)
    return {
        "saved": saved,
        "listed": listed,
        "history": history,
        "start": start,
        "weight": back["weight"].numpy(),
        "mine": back["mine"].value.numpy(),
        "rng_next": float(torch.rand(1)),  # the captured RNG came back: this rank's own stream
        "expected_rng_next": expected_rng_next,
    }


def preempted_on_one_rank(rank: int, world: int, directory: str) -> Any:
    """Rank 1 alone is signalled at step 3: every rank saves step 3 and stops."""
    mgr = trainstate.CheckpointManager(directory, every_steps=100, preemption_signals=("SIGUSR1",))
    last = None
    for step in range(10):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        mgr.save(step, _state(rank, float(step)))
        last = step
        if mgr.preempted:
            break
    mgr.close()
    return {"last": last, "steps": [c.step for c in mgr.list()], "reasons": [h.reason for h in mgr.history()]}


def different_steps(rank: int, world: int, directory: str) -> Any:
    with trainstate.CheckpointManager(directory, every_steps=1) as mgr:
        mgr.save(5 + rank, _state(rank, 1.0))


def one_rank_cannot_encode(rank: int, world: int, directory: str, async_save: bool) -> Any:
    """At step 2, rank 1's state holds a value that cannot be stored: no rank hangs, nothing commits."""
    errors = []
    with trainstate.CheckpointManager(directory, every_steps=2, async_save=async_save) as mgr:
        for step in range(5):
            state = _state(rank, float(step))
            if rank == 1 and step == 2:
                state["bad"] = object()
            try:
                mgr.save(step, state)
                if step == 2:
                    mgr.wait()
            except trainstate.CheckpointError as e:
                errors.append((step, type(e).__name__, str(e)[:300]))
        mgr.wait()
        return {"errors": errors, "steps": [c.step for c in mgr.list()]}


def one_rank_cannot_encode_and_the_loop_goes_on(rank: int, world: int, directory: str) -> Any:
    """Async, a save every step, rank 1's state unsavable at step 1, every error caught: the loop trains on
    (the new-user trial: the ranks fell out of step and waited until the timeout)."""
    os.environ["TRAINSTATE_DIST_TIMEOUT"] = "30"  # a hang shows as "lost contact" in 30 s, not 600
    errors = []
    try:
        with trainstate.CheckpointManager(directory, every_steps=1, async_save=True) as mgr:
            for step in range(6):
                state = _state(rank, float(step))
                if rank == 1 and step == 1:
                    state["bad"] = object()
                try:
                    mgr.save(step, state)
                except trainstate.CheckpointError as e:
                    errors.append((step, type(e).__name__, str(e)[:300]))
            mgr.wait()
            return {"errors": errors, "steps": [c.step for c in mgr.list()]}
    finally:
        del os.environ["TRAINSTATE_DIST_TIMEOUT"]


def restore_skips_what_one_rank_cannot_read(rank: int, world: int, directory: str) -> Any:
    back = _state(rank, -1.0)
    with trainstate.CheckpointManager(directory) as mgr:
        start = mgr.restore_latest(back)
    return {"start": start, "mine": back["mine"].value.numpy(), "weight": back["weight"].numpy()}


def write_two(rank: int, world: int, directory: str) -> Any:
    with trainstate.CheckpointManager(directory, every_steps=1, capture_rng=False) as mgr:
        mgr.save(1, _state(rank, 1.0))
        mgr.save(2, _state(rank, 2.0))
    body = json.loads(open(os.path.join(directory, "step_00000002", "manifest.json")).read())
    return {name: [c["file"] for c in t["chunks"]] for name, t in body["tensors"].items()}


def restore_into_other_structure(rank: int, world: int, directory: str) -> Any:
    with trainstate.CheckpointManager(directory) as mgr:
        state = _state(rank, 0.0)
        if rank == 1:
            state["weight"] = torch.zeros(3)
        mgr.restore_latest(state)


def own_managers(rank: int, world: int, root: str) -> Any:
    with trainstate.CheckpointManager(os.path.join(root, f"rank{rank}"), collective=False, capture_rng=False) as mgr:
        mgr.save(3 + rank, {"x": torch.full((4,), float(rank))}, force=True)  # different steps: no agreement
        return [c.step for c in mgr.list()]


# -- exact resume: a 2-rank DDP run with a shuffling loader and augmentation in workers ------------------


def ddp_train(
    rank: int, world: int, directory: str, steps: int, kill_at: int, async_save: bool, workers: int = 2
) -> Any:
    """Train ``steps`` optimizer steps with DDP, saving every 4; SIGKILL every rank after step ``kill_at``."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    import resume_recipe as recipe

    data = np.random.default_rng(42)
    x = torch.from_numpy(data.standard_normal((203, 10)).astype(np.float32))
    y = torch.from_numpy(data.integers(0, 4, 203))
    ds = recipe.Augmented(x, y)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4))
    ddp = DistributedDataParallel(model)
    torch.manual_seed(100 + rank)  # each rank its own dropout stream
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    sampler = trainstate.ResumableSampler(ds, seed=7, num_replicas=world, rank=rank)
    loader = sampler.attach(DataLoader(ds, batch_size=8, sampler=sampler, num_workers=workers))
    state = {"model": ddp, "optim": opt, "sched": sched, "sampler": sampler, "rng": trainstate.RNGState()}
    mgr = trainstate.CheckpointManager(
        os.path.join(directory, "ckpt"), every_steps=4, keep_last=2, async_save=async_save
    )
    start = mgr.restore_latest(state) or 0

    def on_step(step: int) -> None:
        mgr.save(step, state)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    recipe.train({"model": ddp, "optim": opt, "sched": sched}, loader, start, steps, on_step)
    mgr.close()
    return {
        "start": start,
        "model": {k: v.numpy().copy() for k, v in model.state_dict().items()},
        "optim": [t.numpy().copy() for s in opt.state_dict()["state"].values() for t in s.values()],
        "rng_next": float(torch.rand(1)),
    }


def threads_of_many_managers(rank: int, world: int, directory: str, count: int) -> list[int]:
    """Open, use and close ``count`` managers one after another (async saves, a restore), as a sweep or a loop
    that makes a manager per phase does; the process's threads after each (gloo's own included)."""
    threads = []
    for i in range(count):
        with trainstate.CheckpointManager(os.path.join(directory, f"run{i}"), async_save=True) as mgr:
            mgr.save(0, _state(rank, 1.0), force=True)
            mgr.wait()
            mgr.restore_latest(_state(rank, -1.0))
        threads.append(len(os.listdir("/proc/self/task")))
    return threads
