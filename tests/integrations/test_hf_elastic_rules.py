"""The HF callback's rules for a resume at another number of processes, without a Trainer: which data positions
may resume where (``_hf_data.elastic_differences``), the epoch's tail, and ``DeferredRNG.rederive``."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import trainstate  # noqa: E402
from trainstate.integrations import _hf_data as data  # noqa: E402
from trainstate.integrations._hf_state import DeferredRNG  # noqa: E402

SEQUENTIAL = torch.utils.data.DataLoader(list(range(40)), batch_size=8)  # one order at any world size
SHUFFLED = torch.utils.data.DataLoader(list(range(40)), batch_size=8, shuffle=True)  # torch's RandomSampler


def _position(per_device: int, accumulation: int, world: int, **changes: Any) -> dict[str, Any]:
    """The position the callback records for 40 samples, 3 updates an epoch (a global batch of 16 at most)."""
    batches = -(-40 // (per_device * world))  # per process, padded to whole rounds (even_batches)
    out = {
        "epoch": 1,
        "batches_into_epoch": accumulation,
        "batches_per_epoch": batches,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": per_device,
        "world_size": world,
        "seed": 0,
        "samples": 40,
        "seeded_per_sample": True,
    }
    out.update(changes)
    return out


SAVED = _position(4, 2, 2)  # 4 per device x 2 accumulation x 2 processes: 16


@pytest.mark.parametrize(
    ("now", "loader", "refused"),
    [
        (_position(8, 2, 1), SEQUENTIAL, []),  # the per-device batch doubled
        (_position(4, 4, 1), SEQUENTIAL, []),  # the accumulation doubled
        (_position(16, 1, 1), SEQUENTIAL, []),  # one micro-batch of 16
        (_position(4, 2, 1), SEQUENTIAL, ["global_batch_size", "updates_per_epoch", "world_size"]),
        (_position(8, 2, 1, seed=1), SEQUENTIAL, ["seed", "world_size"]),
        (_position(8, 2, 1, samples=41), SEQUENTIAL, ["samples", "world_size"]),
        (_position(8, 2, 1, seeded_per_sample=False), SEQUENTIAL, ["seeded_per_sample", "world_size"]),
        (_position(8, 2, 1, batches_per_epoch=-1), SEQUENTIAL, ["updates_per_epoch", "world_size"]),
        (_position(8, 2, 1), SHUFFLED, ["order", "world_size"]),
    ],
)
def test_another_world_size_resumes_when_the_global_batch_and_the_order_are_kept(
    now: dict[str, Any], loader: Any, refused: list[str]
) -> None:
    wrong = data.elastic_differences(SAVED, now, loader)
    assert [key for key, _, _ in wrong] == [f"data.{name}" for name in refused]


def test_the_refusal_names_the_global_batch_on_both_sides() -> None:
    (key, now, saved), *_ = data.elastic_differences(SAVED, _position(4, 2, 1), SEQUENTIAL)
    assert key == "data.global_batch_size"
    assert now == "8 (4 per device x 2 accumulation x 1 processes)"
    assert saved == "16 (4 per device x 2 accumulation x 2 processes)"


@pytest.mark.parametrize(
    "now", [_position(4, 2, 2, train_batch_size=8), _position(4, 2, 2, seed=3), _position(4, 2, 2, batches_per_epoch=6)]
)
def test_the_same_world_size_checks_every_value_as_before(now: dict[str, Any]) -> None:
    """As before, and a changed global batch named first (the value a user thinks in)."""
    wrong = data.elastic_differences(SAVED, now, SHUFFLED)
    named_first = [("data.global_batch_size", data._global(now), data._global(SAVED))]
    changed = data.global_batch(now) != data.global_batch(SAVED)
    assert wrong == (named_first if changed else []) + data.differences(SAVED, now) and data.differences(SAVED, now)
    assert data.elastic_differences(SAVED, SAVED, SHUFFLED) == []


def test_a_position_saved_without_its_values_is_checked_as_before() -> None:
    old = {"epoch": 0, "world_size": 2}
    assert data.elastic_differences(old, _position(8, 2, 1), SEQUENTIAL) == data.differences(old, _position(8, 2, 1))


def test_the_epochs_tail_differs_unless_the_dataset_is_whole_rounds_at_both_sizes() -> None:
    assert not data.uneven_tail(SAVED, _position(8, 2, 1))  # 40 = 5 x (4 x 2) = 5 x (8 x 1)
    assert not data.uneven_tail(SAVED, _position(4, 4, 1))
    assert data.uneven_tail(_position(4, 2, 2, samples=36), _position(8, 2, 1, samples=36))  # 36 = 4.5 x 8


def test_rederive_holds_the_rule_s_generators_and_leaves_the_process_s_alone() -> None:
    rng = DeferredRNG()
    rng.seed = 7
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    before = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    rng.rederive(0, 800)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == before  # untouched
    assert rng.rederived == (0, 800)
    rng.apply()
    got = (random.random(), float(np.random.rand()), float(torch.rand(())))
    trainstate.RNGState(seed=7).rederive(0, 800)
    assert got == (random.random(), float(np.random.rand()), float(torch.rand(())))
    assert rng.pending is None
