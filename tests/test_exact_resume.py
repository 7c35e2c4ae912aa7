"""Exact resume: a run restored mid-epoch ends bit-identical to one that never stopped.

Dropout, a shuffling loader with worker processes, gradient accumulation, AdamW and a scheduler are all
in play; both a torchdata StatefulDataLoader and a plain DataLoader with ResumableSampler are covered.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import trainstate
from helpers import assert_same

torch = pytest.importorskip("torch")
from resume_recipe import build, final_state, train  # noqa: E402

LOADERS = [
    "sampler",
    pytest.param(
        "stateful",
        marks=pytest.mark.skipif(
            pytest.importorskip("importlib").util.find_spec("torchdata") is None, reason="torchdata not installed"
        ),
    ),
]


@pytest.mark.parametrize("loader_kind", LOADERS)
@pytest.mark.parametrize("save_at", [5, 12, 13])  # mid-epoch (13 steps per epoch), its last step, in epoch 2
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
    from trainstate import _data as data

    monkeypatch.setattr(data, "arm_exact_resume", lambda target: None)
    pytest.importorskip("torchdata")
    state, loader = build("stateful")
    train(state, loader, 0, 20, lambda s: trainstate.save(tmp_path / "c", state) if s == 5 else None)
    resumed, loader2 = build("stateful", init_seed=99)
    trainstate.load(tmp_path / "c", resumed)
    train(resumed, loader2, 6, 20)
    assert not torch.equal(state["model"][0].weight, resumed["model"][0].weight)


RECIPE = __import__("pathlib").Path(__file__).with_name("resume_recipe.py")


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RECIPE), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "loader_kind, kill_at, async_save",
    [
        pytest.param(  # killed with an async save possibly in flight, mid-epoch
            "sampler",
            9,
            True,
            marks=pytest.mark.slow,  # CI: the 2-rank DDP SIGKILL test saves async too
        ),
        pytest.param(
            "stateful",
            17,
            False,
            marks=[
                pytest.mark.skipif(
                    pytest.importorskip("importlib").util.find_spec("torchdata") is None,
                    reason="torchdata not installed",
                ),
                pytest.mark.slow,  # its path (StatefulDataLoader, SIGKILL, resume) runs in test_worker_randomness
            ],
        ),
    ],
)
def test_sigkill_and_resume_in_a_new_process_is_bit_identical(tmp_path, loader_kind, kill_at, async_save):
    """The contract: kill -9 at some step, resume from the latest checkpoint in a fresh process."""
    import signal

    flags = ["--loader", loader_kind, "--steps", "30", "--every", "4"] + (["--async"] if async_save else [])
    ref = _run([str(tmp_path / "ref"), *flags])
    assert ref.returncode == 0, ref.stderr
    killed = _run([str(tmp_path / "run"), *flags, "--kill-at", str(kill_at)])
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "run" / "final").exists()
    resumed = _run([str(tmp_path / "run"), *flags])
    assert resumed.returncode == 0, resumed.stderr
    start = int(resumed.stdout.split("start ")[1].split()[0])
    assert 0 < start <= kill_at + 1  # it really resumed, from a checkpoint at or before the kill
    assert_same(trainstate.load(tmp_path / "ref" / "final"), trainstate.load(tmp_path / "run" / "final"))


def test_resumable_sampler_counts_samples_with_an_explicit_batch_sampler(tmp_path):
    from torch.utils.data import BatchSampler, DataLoader

    data = list(range(40))
    sampler = trainstate.ResumableSampler(data, seed=3)
    loader = sampler.attach(DataLoader(data, batch_sampler=BatchSampler(sampler, 8, drop_last=False)))
    it = iter(loader)
    next(it), next(it)
    trainstate.save(tmp_path / "c", {"sampler": sampler})
    rest = [b.tolist() for b in it]
    fresh = trainstate.ResumableSampler(data, seed=3)
    loader2 = fresh.attach(DataLoader(data, batch_sampler=BatchSampler(fresh, 8, drop_last=False)))
    trainstate.load(tmp_path / "c", {"sampler": fresh})
    assert fresh.consumed == 16 and [b.tolist() for b in loader2] == rest


def test_resumable_sampler_moves_to_the_next_epoch_when_the_loop_stops_on_the_last_batch():
    from torch.utils.data import DataLoader

    data = list(range(12))
    sampler = trainstate.ResumableSampler(data, seed=1)
    loader = sampler.attach(DataLoader(data, batch_size=4, sampler=sampler))
    first = [b.tolist() for _, b in zip(range(3), loader)]  # all 3 batches, StopIteration never seen
    second = [b.tolist() for b in loader]
    assert len(second) == 3 and sorted(sum(second, [])) == data and second != first
    assert sampler.epoch == 2
