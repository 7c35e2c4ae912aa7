"""Which tensors of a training checkpoint are the model's: the first module saved, or what select names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import trainstate  # noqa: E402
from trainstate._convert.select import weights as model_weights  # noqa: E402


def weights(tmp_path: Path, state: Any, **options: Any) -> dict[str, str]:
    trainstate.save(tmp_path / "ckpt", state)
    with trainstate.open(tmp_path / "ckpt") as ck:
        return {w.name: w.stored for w in model_weights(ck, **options)}


def test_the_first_module_is_found_past_rng_scheduler_and_optimizer(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # moments exist: the optimizer's state holds tensors too
    state = {
        "rng": trainstate.RNGState(),
        "optim": opt,
        "sched": torch.optim.lr_scheduler.StepLR(opt, 1),
        "train": {"step": 1, "net": model},
        "ema": torch.nn.Linear(2, 3),
    }
    assert weights(tmp_path, state) == {"weight": "train.net.weight", "bias": "train.net.bias"}


def test_no_module_and_a_select_that_matches_nothing_are_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(trainstate.InvalidArgumentError, match="holds no module") as e:
        weights(tmp_path, {"step": 1, "state_dict": {"w": torch.zeros(2)}})  # as a Lightning checkpoint holds it
    assert "select='state_dict.*'" in str(e.value)  # the key the tensors are under, not 'model'
    with pytest.raises(trainstate.InvalidArgumentError, match="match no key"):
        weights(tmp_path / "b", {"model": torch.nn.Linear(2, 3)}, select="model.weights")
