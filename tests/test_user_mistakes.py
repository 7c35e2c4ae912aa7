"""Mistakes a first-time user made (a trial with no knowledge of the code): each is a clear error now."""

from __future__ import annotations

import numpy as np
import pytest

import trainstate


def _state():
    return {"model": {"w": np.arange(6, dtype=np.float32)}, "optim": {"m": np.ones(3)}, "step": 2}


def test_a_typo_in_one_include_pattern_of_a_list_is_an_error_not_a_partial_restore(tmp_path):
    trainstate.save(tmp_path / "c", _state())
    target = {"model": {"w": np.zeros(6, np.float32)}, "optim": {"m": np.zeros(3)}, "step": 0}
    with pytest.raises(trainstate.InvalidArgumentError, match="optimizer"):
        trainstate.load(tmp_path / "c", target, include=["model.*", "optimizer.*"])
    assert not target["model"]["w"].any()  # nothing was restored
    trainstate.load(tmp_path / "c", target, include=["model.*", "optim.*"])
    assert target["optim"]["m"].all()


def test_a_manager_pointed_at_a_checkpoint_refuses_instead_of_starting_over(tmp_path):
    trainstate.save(tmp_path / "ck", _state())
    with pytest.raises(trainstate.InvalidArgumentError, match="is a checkpoint, not a run directory"):
        trainstate.CheckpointManager(tmp_path / "ck", every_steps=1)
    assert not [p.name for p in (tmp_path / "ck").iterdir() if not p.name.startswith(("data-", "manifest"))]


def test_policies_that_are_not_policies_are_refused_at_construction(tmp_path):
    with pytest.raises(trainstate.InvalidArgumentError):
        trainstate.CheckpointManager(tmp_path, save_policies=trainstate.EverySteps(2))  # not a list
    with pytest.raises(trainstate.InvalidArgumentError, match="save_policies"):
        trainstate.CheckpointManager(tmp_path, save_policies=[trainstate.KeepLast(1)])


def test_read_into_an_array_of_the_wrong_dtype_or_shape_is_refused(tmp_path):
    trainstate.save(tmp_path / "c", _state())
    with trainstate.open(tmp_path / "c") as ck:
        for wrong in (np.zeros(6, np.int32), np.zeros((2, 3), np.float32), np.zeros(24, np.uint8)):
            with pytest.raises(trainstate.InvalidArgumentError, match="dtype F32 and shape"):
                ck.read_into("model.w", wrong)
            assert not wrong.any()
        right = np.zeros(6, np.float32)
        ck.read_into("model.w", right)
        assert list(right) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "call",
    [
        lambda d: trainstate.load(None),
        lambda d: trainstate.open(None),
        lambda d: trainstate.save("", {"x": 1}),
        lambda d: trainstate.save(d / "new", {"x": 1}, threads=0),
        lambda d: trainstate.load(d / "c", threads=0),
        lambda d: trainstate.load(d / "c", framework="tensorflow"),
    ],
    ids=["load-None", "open-None", "save-empty-path", "save-threads-0", "load-threads-0", "load-framework-tensorflow"],
)
def test_wrong_arguments_get_a_clear_error_before_anything_is_touched(tmp_path, call):
    trainstate.save(tmp_path / "c", {"x": np.zeros(3)})
    with pytest.raises(trainstate.InvalidArgumentError):
        call(tmp_path)
    assert not (tmp_path / "new").exists()


def test_an_int_too_long_for_json_is_an_unsupported_value(tmp_path):
    # Python converts at most sys.get_int_max_str_digits() digits: such an int could be written by no writer
    # and parsed by no reader, so the save refuses it instead of raising a bare ValueError.
    with pytest.raises(trainstate.UnsupportedValueError, match=r"an int of \d+ bits cannot be stored"):
        trainstate.save(tmp_path / "ck", {"n": 10**5000})
    assert not (tmp_path / "ck").exists()
    trainstate.save(tmp_path / "ok", {"n": 10**4000})
    assert trainstate.load(tmp_path / "ok")["n"] == 10**4000
