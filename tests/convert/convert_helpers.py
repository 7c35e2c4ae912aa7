"""What the conversion tests share: small real torch models, a tensor comparison, the CLI run as a user runs it."""

from __future__ import annotations

import json
from typing import Any

import torch

import trainstate
from helpers import cli

BIG = 4096  # a 4096 x 4096 float32 weight: 64 MiB


class TiedLM(torch.nn.Module):
    """A language model's shape in small: the output projection shares the input embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(x))))


class Mixed(torch.nn.Module):
    """Every kind of tensor a model's state_dict holds: float32, bfloat16 and float16 weights, BatchNorm's
    int64 counter, a bool buffer, a 0-d parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(5, 4)
        self.small = torch.nn.Linear(4, 3).to(torch.float16)
        self.brain16 = torch.nn.Linear(3, 2).to(torch.bfloat16)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.scale = torch.nn.Parameter(torch.tensor(2.5))


def seeded(cls: type[torch.nn.Module], seed: int) -> Any:
    torch.manual_seed(seed)
    model = cls()
    if isinstance(model, Mixed):
        model.norm.num_batches_tracked.fill_(7 + seed)
        model.norm.running_mean.uniform_()
    return model


def training_state(model: torch.nn.Module, step: int = 3) -> dict[str, Any]:
    """The model beside what a training loop also saves, after a real optimizer step."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.dtype == torch.float32], lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return {"model": model, "optim": opt, "step": step, "rng": trainstate.RNGState()}


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names, dtypes, shapes and bytes (NaN-safe, -0.0 told from 0.0)."""
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and bytes(a[k].detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        == bytes(b[k].detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        for k in a
    )


def cli_json(*args: str) -> Any:
    return json.loads(cli(*args, "--json").stdout)  # stdout holds JSON and nothing else
