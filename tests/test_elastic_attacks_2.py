"""Attacks on the global sample stream's restore (attack29): a checkpoint whose saved position was edited (a
re-sealed manifest: negative counts, a micro-batch past the last, floats and bools for ints) must be refused by
the restore with a trainstate error, not served as extra / missing batches or left to fail with a raw exception
at the first batch; and a sampler built with no micro-batches must be refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import trainstate  # noqa: E402
from helpers import reseal_manifest  # noqa: E402
from trainstate import GlobalBatches  # noqa: E402
from trainstate.errors import CheckpointError, InvalidArgumentError  # noqa: E402

TOTAL, GLOBAL_BATCH = 20, 4  # 5 global batches an epoch


def _saved(path: Path, key: str, value: Any) -> Path:
    """A GlobalBatches checkpoint taken one global batch into epoch 0, its ``key`` then set to ``value``."""
    batches = GlobalBatches(TOTAL, global_batch_size=GLOBAL_BATCH)
    next(iter(batches))
    trainstate.save(path, {"data": batches})

    def edit(body: dict[str, Any]) -> None:
        for pair in body["tree"]["v"][0][1]["v"]["v"]:
            if pair[0] == key:
                pair[1] = value

    reseal_manifest(path, edit)
    return path


def _restored_epoch(path: Path, **kw: Any) -> list[list[int]]:
    """Restore into a fresh GlobalBatches and run the rest of its epoch; a trainstate error counts as a refusal."""
    batches = GlobalBatches(TOTAL, global_batch_size=GLOBAL_BATCH, **kw)
    trainstate.load(path, {"data": batches})
    return [b.tolist() for b in batches]


def test_a_negative_batch_count_in_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path / "ck", "batches", -3)
    try:
        rest = _restored_epoch(path)
    except CheckpointError:
        return
    assert len(rest) <= TOTAL // GLOBAL_BATCH and all(rest), rest


def test_a_negative_epoch_in_the_checkpoint_is_refused_by_the_restore(tmp_path: Path) -> None:
    path = _saved(tmp_path / "ck", "epoch", -1)
    with pytest.raises(CheckpointError):
        _restored_epoch(path)


@pytest.mark.parametrize("micro", [7, -2])
def test_a_micro_batch_out_of_range_in_the_checkpoint_is_refused_by_the_restore(tmp_path: Path, micro: int) -> None:
    path = _saved(tmp_path / "ck", "micro", micro)
    with pytest.raises(CheckpointError):
        _restored_epoch(path)


def test_the_global_resumable_sampler_refuses_a_micro_batch_past_its_last() -> None:
    from torch.utils.data import DataLoader

    def sampler() -> trainstate.ResumableSampler:
        return trainstate.ResumableSampler(TOTAL, global_batch_size=GLOBAL_BATCH, num_replicas=2, rank=0, seed=0)

    saved = sampler()
    saved.attach(DataLoader(list(range(TOTAL)), batch_sampler=saved))
    state = {**saved.state_dict(), "batches": 1, "micro": 3}  # micro 3 of 1 micro-batch per global batch
    resumed = sampler()
    loader = resumed.attach(DataLoader(list(range(TOTAL)), batch_sampler=resumed))
    try:
        resumed.load_state_dict(state)
    except CheckpointError:
        return
    rest = [b.tolist() for b in loader]
    assert len(rest) == TOTAL // GLOBAL_BATCH - 1, f"global batch 1 is still to train: {rest}"


@pytest.mark.parametrize(("key", "value"), [("epoch", 1.5), ("batches", 2.9), ("seed", True), ("epoch", True)])
def test_a_float_or_bool_for_an_int_in_the_saved_position_is_refused(tmp_path: Path, key: str, value: Any) -> None:
    path = _saved(tmp_path / "ck", key, value)
    with pytest.raises(CheckpointError):
        _restored_epoch(path)


def test_a_global_resumable_sampler_with_no_micro_batches_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        trainstate.ResumableSampler(TOTAL, global_batch_size=GLOBAL_BATCH, micro_batches=0)


def test_the_global_resumable_sampler_takes_numpy_integers_as_global_batches_does() -> None:
    import numpy as np

    GlobalBatches(TOTAL, global_batch_size=np.int64(GLOBAL_BATCH), rank=np.int64(1), world_size=np.int64(2))
    trainstate.ResumableSampler(
        TOTAL,
        global_batch_size=np.int64(GLOBAL_BATCH),
        num_replicas=np.int64(2),
        rank=np.int64(1),
        micro_batches=np.int64(1),
    )
