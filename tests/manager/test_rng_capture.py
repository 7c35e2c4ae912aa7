"""The RNG a manager captures on its own: declared in the checkpoint, so any reader may leave it out."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest

import trainstate

LEGACY = Path(__file__).parent.parent / "fixtures" / "v1.0" / "manager_rng"  # a 0.1 manager's step 3


def facts(checkpoint: Path) -> dict:
    with trainstate.open(checkpoint) as ck:
        return ck.metadata["trainstate"]


def test_the_manager_declares_the_rng_key_it_added(tmp_path):
    state = {"w": np.arange(4, dtype=np.float32), "step": 0}
    with trainstate.CheckpointManager(tmp_path / "run", every_steps=1) as mgr:
        mgr.save(1, state)
    assert facts(tmp_path / "run" / "step_00000001")["added_keys"] == ["_rng"]
    assert "_rng" not in state  # the user's dict keeps its own keys


def test_a_manager_checkpoint_loads_into_a_users_state_with_plain_load(tmp_path):
    state = {"w": np.arange(4, dtype=np.float32), "step": 7}
    with trainstate.CheckpointManager(tmp_path / "run", every_steps=1) as mgr:
        mgr.save(1, state)
    fresh = {"w": np.zeros(4, dtype=np.float32), "step": 0}
    trainstate.load(tmp_path / "run" / "step_00000001", fresh)  # strict: "_rng" is not unexpected
    assert fresh["step"] == 7 and fresh["w"].tolist() == [0, 1, 2, 3]
    assert "_rng" not in fresh


def test_a_target_that_asks_for_the_declared_key_gets_it(tmp_path):
    with trainstate.CheckpointManager(tmp_path / "run", every_steps=1) as mgr:
        mgr.save(1, {"step": 1})
    expected = np.random.random(3)
    np.random.random(10)
    trainstate.load(tmp_path / "run" / "step_00000001", {"step": 0, "_rng": trainstate.RNGState()})
    assert np.random.random(3).tolist() == expected.tolist()


def test_with_capture_rng_off_nothing_is_declared_and_a_users_rng_key_is_theirs(tmp_path):
    with trainstate.CheckpointManager(tmp_path / "run", every_steps=1, capture_rng=False) as mgr:
        mgr.save(1, {"step": 1, "_rng": {"mine": 1}})
    path = tmp_path / "run" / "step_00000001"
    assert facts(path)["added_keys"] == []
    with pytest.raises(trainstate.StateMismatchError, match="_rng.mine"):
        trainstate.load(path, {"step": 0})  # the user saved it: leaving it out is reported, like any key


def test_a_checkpoint_of_a_manager_without_the_declaration_still_loads_without_its_rng(tmp_path):
    # written by trainstate 0.1, which skipped "_rng" by name: the compatibility rule keeps that
    assert "added_keys" not in facts(LEGACY) and "seq" in facts(LEGACY)
    state = {"w": np.zeros((2, 3), dtype=np.float32), "step": 0}
    trainstate.load(LEGACY, state)
    assert state["step"] == 3 and state["w"].ravel().tolist() == [0, 1, 2, 3, 4, 5]


def test_a_manager_resumes_from_a_checkpoint_written_before_the_declaration(tmp_path):
    shutil.copytree(LEGACY, tmp_path / "run" / "step_00000003")
    saved_rng = trainstate.load(LEGACY, include="_rng.*")["_rng"]
    random.random()
    state = {"w": np.zeros((2, 3), dtype=np.float32), "step": 0}
    with trainstate.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore_latest(state) == 4
    assert state["step"] == 3 and "_rng" not in state
    assert random.getstate()[1] == tuple(int(x) for x in saved_rng["python"]["state"])  # the RNG came back
