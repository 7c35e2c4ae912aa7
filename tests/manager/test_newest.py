"""newest_restorable's one rule (trainstate/_manager/newest.py): which failure moves on to the checkpoint before,
which one is raised at once. restore_latest and TrainstateCallback.resume_point both choose through it
(tests/integrations/test_huggingface_newest.py checks that they agree)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import trainstate
from trainstate._manager.newest import FATAL, newest_restorable
from trainstate.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    StateMismatchError,
    StorageError,
    WrongKeyError,
)


@pytest.fixture
def manager(tmp_path: Path) -> trainstate.CheckpointManager:
    with trainstate.CheckpointManager(tmp_path / "run") as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(4, step, dtype=np.float32)}, force=True)
    return trainstate.CheckpointManager(tmp_path / "run", read_only=True)


@pytest.mark.parametrize(
    "error",
    [
        CorruptCheckpointError("checksum mismatch"),
        IncompleteCheckpointError("no manifest"),
        CheckpointNotFoundError("a data file is missing"),
        StorageError("I/O error"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_damage_moves_on_to_the_checkpoint_before(manager: trainstate.CheckpointManager, error: Exception) -> None:
    def attempt(name: str) -> str:
        if name == "step_00000002":
            raise error
        return name

    found = newest_restorable(manager.list, manager.catalog, attempt)
    assert found is not None and (found.name, found.step, found.skipped) == ("step_00000001", 1, ["step_00000002"])


@pytest.mark.parametrize(
    "error",
    [
        StateMismatchError(["w"], [], []),
        InvalidArgumentError("wrong"),
        WrongKeyError("another key"),
        trainstate.FormatVersionError("newer"),
        DistributedError("rank 1 fell silent"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_what_is_not_damage_is_raised_at_once(manager: trainstate.CheckpointManager, error: Exception) -> None:
    tried = []

    def attempt(name: str) -> str:
        tried.append(name)
        raise error

    assert isinstance(error, FATAL)
    with pytest.raises(type(error)):
        newest_restorable(manager.list, manager.catalog, attempt)
    assert tried == ["step_00000002"]  # never an older one


def test_none_that_restores_lists_each_and_why(manager: trainstate.CheckpointManager) -> None:
    def attempt(name: str) -> str:
        raise CorruptCheckpointError(f"{name} is damaged\nmore advice")

    with pytest.raises(CorruptCheckpointError, match="none of the 2") as caught:
        newest_restorable(manager.list, manager.catalog, attempt, advice=lambda failures: "\nmove them away")
    assert str(caught.value).splitlines()[1:] == [
        "  step_00000002: step_00000002 is damaged",
        "  step_00000001: step_00000001 is damaged",
        "move them away",
    ]


def test_an_error_outside_the_tree_goes_through(manager: trainstate.CheckpointManager) -> None:
    def attempt(name: str) -> str:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        newest_restorable(manager.list, manager.catalog, attempt)
    assert not issubclass(RuntimeError, CheckpointError)
