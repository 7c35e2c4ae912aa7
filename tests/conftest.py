"""Shared fixtures: small real models and a training state with every part a checkpoint holds."""

from __future__ import annotations

from typing import Any

import pytest


def make_training_state(seed: int = 0, steps: int = 2) -> dict[str, Any]:
    """A small model trained a few steps with AdamW and a scheduler, plus counters and RNG."""
    import torch

    import trainstate

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    for _ in range(steps):
        loss = model(torch.randn(8, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return {"model": model, "optim": opt, "sched": sched, "step": steps, "epoch": 0, "rng": trainstate.RNGState()}


def fresh_like(seed: int = 123) -> dict[str, Any]:
    """The same structure, untrained, with different weights."""
    return make_training_state(seed=seed, steps=0)


@pytest.fixture
def training_state() -> dict[str, Any]:
    return make_training_state()
