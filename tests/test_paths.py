"""What a user passes as a checkpoint path: a link they made to one, or a manager's run directory."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import trainstate


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A manager's run directory with steps 50 and 100, and the user's ``latest -> step_00000100`` link."""
    d = tmp_path / "run"
    mgr = trainstate.CheckpointManager(d, save_on_preemption=False, capture_rng=False)
    for step in (50, 100):
        mgr.save(step, {"w": np.full(3, float(step)), "step": step}, force=True)
    mgr.close()
    os.symlink("step_00000100", d / "latest")
    return d


def test_a_users_link_to_a_checkpoint_loads(run: Path) -> None:
    assert trainstate.load(run / "latest")["step"] == 100
    target = {"w": np.zeros(3), "step": 0}
    trainstate.load(str(run / "latest"), target)
    assert target["step"] == 100 and target["w"].tolist() == [100.0] * 3
    with trainstate.open(run / "latest") as ck:
        assert ck.read("w").tolist() == [100.0] * 3
        ck.verify()


def test_a_link_outside_the_run_directory_loads(run: Path, tmp_path: Path) -> None:
    link = tmp_path / "best"
    os.symlink(run / "step_00000050", link)  # absolute, from elsewhere
    assert trainstate.load(link)["step"] == 50


def test_links_inside_a_linked_checkpoint_are_still_refused(run: Path, tmp_path: Path) -> None:
    data = next((run / "step_00000100").glob("data-*.safetensors"))
    outside = tmp_path / "outside.bin"
    os.replace(data, outside)
    os.symlink(outside, data)
    with pytest.raises(trainstate.CorruptCheckpointError, match="symlink"):
        trainstate.load(run / "latest")


def test_a_dangling_or_file_link_is_not_a_checkpoint(run: Path, tmp_path: Path) -> None:
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    with pytest.raises(trainstate.CheckpointNotFoundError):
        trainstate.load(dangling)
    (tmp_path / "file").write_bytes(b"x")
    os.symlink(tmp_path / "file", tmp_path / "to-file")
    with pytest.raises(trainstate.CheckpointNotFoundError, match="not a checkpoint directory"):
        trainstate.load(tmp_path / "to-file")


@pytest.mark.parametrize("opener", [trainstate.load, trainstate.open])
def test_a_manager_directory_says_how_to_load_from_it(run: Path, opener: object) -> None:
    with pytest.raises(trainstate.CheckpointError) as err:
        opener(run)  # type: ignore[operator]
    message = str(err.value)
    assert not isinstance(err.value, trainstate.IncompleteCheckpointError)  # nothing failed to commit
    assert "CheckpointManager" in message and "restore_latest" in message
    assert "step_00000100" in message  # a path to one checkpoint: the newest
    assert "never committed" not in message
    # following the advice works
    assert trainstate.load(run / "step_00000100")["step"] == 100
    state = {"w": np.zeros(3), "step": 0}
    assert trainstate.CheckpointManager(run, read_only=True).restore_latest(state) == 101  # next step
    assert state["step"] == 100


def test_an_empty_directory_is_still_an_incomplete_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    with pytest.raises(trainstate.IncompleteCheckpointError, match="never committed"):
        trainstate.load(tmp_path / "c")
