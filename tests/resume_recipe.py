"""The exact-resume recipe as a small training program, shared by the in-process and SIGKILL tests.

Run as a script it trains with a CheckpointManager and can kill itself with SIGKILL at a given step:
    python tests/resume_recipe.py DIR --loader sampler|stateful --steps N [--kill-at K] [--async]
and writes the final model and optimizer state to DIR/final.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import trainstate

ACCUM = 2  # micro-batches per optimizer step


def build(loader_kind: str, init_seed: int = 0) -> tuple[dict[str, Any], Any]:
    data = np.random.default_rng(42)
    x = torch.from_numpy(data.standard_normal((203, 10)).astype(np.float32))
    y = torch.from_numpy(data.integers(0, 4, 203))
    ds = TensorDataset(x, y)
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched, "rng": trainstate.RNGState()}
    if loader_kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(ds, batch_size=8, shuffle=True, num_workers=2)
        state["loader"] = loader
    else:
        sampler = trainstate.ResumableSampler(ds, seed=7)
        loader = sampler.attach(DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2))
        state["sampler"] = sampler
    return state, loader


def train(state: dict[str, Any], loader: Any, start: int, stop: int, on_step: Any = None) -> None:
    """Optimizer steps ``start``..``stop-1``; ``on_step(step)`` runs after each one (saves go there)."""
    model, opt, sched = state["model"], state["optim"], state["sched"]
    model.train()
    step, micro = start, 0
    while step < stop:
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            (loss / ACCUM).backward()
            micro += 1
            if micro % ACCUM:
                continue
            opt.step()
            sched.step()
            opt.zero_grad()
            if on_step is not None:
                on_step(step)
            step += 1
            if step >= stop:
                break


def final_state(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": state["model"], "optim": state["optim"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--loader", default="sampler")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--async", dest="async_save", action="store_true")
    args = ap.parse_args()
    state, loader = build(args.loader, init_seed=0)
    mgr = trainstate.CheckpointManager(os.path.join(args.dir, "ckpt"), every_steps=args.every, keep_last=2,
                                       async_save=args.async_save)
    start = mgr.restore_latest(state) or 0
    print(f"start {start}", flush=True)

    def on_step(step: int) -> None:
        mgr.save(step, state)
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    train(state, loader, start, args.steps, on_step)
    mgr.close()
    trainstate.save(os.path.join(args.dir, "final"), final_state(state), overwrite=True)


if __name__ == "__main__":
    main()
