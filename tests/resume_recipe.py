"""The exact-resume recipe as a small training program, shared by the in-process and SIGKILL tests.

Run as a script it trains with a CheckpointManager and can kill itself with SIGKILL at a given step:
    python tests/resume_recipe.py DIR --loader sampler|stateful --steps N [--kill-at K] [--async]
        [--workers W] [--augment] [--no-seed-per-sample] [--local PATH [--local-every K]]
and writes the final model and optimizer state to DIR/final. ``main([DIR, ...])`` runs the same in-process.

``--augment`` swaps the fixed tensors for a dataset that augments in ``__getitem__`` with Python's
``random``, NumPy's global generator and torch's, the way a fine-tune masks tokens in its workers.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import trainstate

ACCUM = 2  # micro-batches per optimizer step


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Masks, jitters and flips each sample with all three global generators, as augmentation code does."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i].clone()
        x[torch.rand(x.shape) < 0.15] = 0.0  # token masking: torch's global generator
        x += torch.from_numpy(np.random.normal(0.0, 0.1, x.shape).astype(np.float32))  # NumPy's global one
        if random.random() < 0.5:  # Python's random
            x = x.flip(0)
        return x, self.y[i]


def build(
    loader_kind: str, init_seed: int = 0, workers: int = 2, augment: bool = False, seed_per_sample: bool = True
) -> tuple[dict[str, Any], Any]:
    data = np.random.default_rng(42)
    x = torch.from_numpy(data.standard_normal((203, 10)).astype(np.float32))
    y = torch.from_numpy(data.integers(0, 4, 203))
    ds: Dataset[Any] = Augmented(x, y) if augment else TensorDataset(x, y)
    random.seed(init_seed)  # a user's script seeds all three; the checkpoint's RNG state then takes over
    np.random.seed(init_seed)
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched, "rng": trainstate.RNGState()}
    if loader_kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(ds, batch_size=8, shuffle=True, num_workers=workers)
        if seed_per_sample:
            trainstate.seed_per_sample(loader)
        state["loader"] = loader
    else:
        sampler = trainstate.ResumableSampler(ds, seed=7)
        loader = sampler.attach(DataLoader(ds, batch_size=8, sampler=sampler, num_workers=workers))
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--loader", default="sampler")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--augment", action="store_true")
    ap.add_argument("--no-seed-per-sample", dest="seed_per_sample", action="store_false")
    ap.add_argument("--local", help="a LocalTier path: a local checkpoint every --local-every steps")
    ap.add_argument("--local-every", type=int, default=1)
    args = ap.parse_args(argv)
    state, loader = build(
        args.loader, init_seed=0, workers=args.workers, augment=args.augment, seed_per_sample=args.seed_per_sample
    )
    local = trainstate.LocalTier(args.local, every_steps=args.local_every) if args.local else None
    mgr = trainstate.CheckpointManager(
        os.path.join(args.dir, "ckpt"), every_steps=args.every, keep_last=2, async_save=args.async_save, local=local
    )
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
