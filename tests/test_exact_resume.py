"""Exact resume: a run restored mid-epoch ends bit-identical to one that never stopped.

Dropout, a shuffling loader with worker processes, gradient accumulation, AdamW and a scheduler are all
in play; both a torchdata StatefulDataLoader and a plain DataLoader with ResumableSampler are covered.
"""

from __future__ import annotations

import pytest

import trainstate
from helpers import assert_same

torch = pytest.importorskip("torch")
from resume_recipe import build, final_state, train  # noqa: E402

LOADERS = ["sampler", pytest.param("stateful", marks=pytest.mark.skipif(
    pytest.importorskip("importlib").util.find_spec("torchdata") is None, reason="torchdata not installed"))]


@pytest.mark.parametrize("loader_kind", LOADERS)
@pytest.mark.parametrize("save_at", [5, 13])  # mid-epoch (13 steps per epoch), and later in epoch 2
def test_restore_mid_epoch_is_bit_identical(tmp_path, loader_kind, save_at):
    steps = 30
    state, loader = build(loader_kind)

    def save(step: int) -> None:
        if step == save_at:
            trainstate.save(tmp_path / "c", state)

    train(state, loader, 0, steps, save)
    reference = trainstate.load(tmp_path / "c")  # noqa: F841 - proves the checkpoint loads standalone
    resumed, loader2 = build(loader_kind, init_seed=99)
    trainstate.load(tmp_path / "c", resumed)
    train(resumed, loader2, save_at + 1, steps)
    assert_same(final_state(state)["model"].state_dict(), final_state(resumed)["model"].state_dict())
    assert_same(state["optim"].state_dict()["state"], resumed["optim"].state_dict()["state"])


def test_without_the_rng_fix_the_run_diverges(tmp_path, monkeypatch):
    """The RNG trap is real: skip the post-iterator-start RNG re-apply and dropout masks differ."""
    from trainstate import data

    monkeypatch.setattr(data, "arm_exact_resume", lambda target: None)
    pytest.importorskip("torchdata")
    state, loader = build("stateful")
    train(state, loader, 0, 20, lambda s: trainstate.save(tmp_path / "c", state) if s == 5 else None)
    resumed, loader2 = build("stateful", init_seed=99)
    trainstate.load(tmp_path / "c", resumed)
    train(resumed, loader2, 6, 20)
    assert not torch.equal(state["model"][0].weight, resumed["model"][0].weight)
