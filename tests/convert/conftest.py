"""Fixtures of the conversion tests: a 256 MB checkpoint of four 64 MB tensors for the memory checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from convert_helpers import BIG

import trainstate


@pytest.fixture(scope="session")
def big_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints (steps 1 and 2) of a model of four 64 MiB weights and its SGD state."""
    root = tmp_path_factory.mktemp("big")
    layers = [torch.nn.utils.skip_init(torch.nn.Linear, BIG, BIG, bias=False) for _ in range(4)]
    model = torch.nn.Sequential(*layers)
    paths = []
    for step in (1, 2):
        for i, layer in enumerate(layers):
            layer.weight.data.fill_(0.25 * (i + step))
        path = root / f"step_{step}"
        trainstate.save(path, {"model": model, "step": step})
        paths.append(path)
    return paths[0], paths[1]
