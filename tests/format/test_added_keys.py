"""Keys a writer declares it added (metadata trainstate.added_keys, docs/format.md §6a), for any writer."""

from __future__ import annotations

import numpy as np
import pytest

import trainstate
from helpers import reseal_manifest


def test_a_key_declared_by_any_writer_is_optional_for_a_target_without_it(tmp_path):
    # a tool of the user's own adds "provenance" beside the state it was handed, and says so
    state = {"w": np.arange(3.0), "provenance": {"git": "abc123"}}
    trainstate.save(tmp_path / "c", state, metadata={"trainstate": {"added_keys": ["provenance"]}})
    target = {"w": np.zeros(3)}
    trainstate.load(tmp_path / "c", target)  # strict, yet "provenance" is not unexpected
    assert target["w"].tolist() == [0.0, 1.0, 2.0] and "provenance" not in target
    asking = {"w": np.zeros(3), "provenance": {"git": ""}}
    trainstate.load(tmp_path / "c", asking)
    assert asking["provenance"] == {"git": "abc123"}  # restored like any key for a target that has it


def test_a_declared_key_is_optional_only_at_the_top_level(tmp_path):
    trainstate.save(
        tmp_path / "c",
        {"w": np.arange(3.0), "inner": {"provenance": 1}},
        metadata={"trainstate": {"added_keys": ["provenance"]}},
    )
    with pytest.raises(trainstate.StateMismatchError, match="inner.provenance"):
        trainstate.load(tmp_path / "c", {"w": np.zeros(3), "inner": {}})


def test_an_undeclared_rng_key_is_the_users_like_any_other(tmp_path):
    # saved with trainstate.save, not by a manager: nothing says a writer added it, so it is not skipped
    trainstate.save(tmp_path / "c", {"w": np.arange(3.0), "_rng": trainstate.RNGState()})
    with pytest.raises(trainstate.StateMismatchError, match="_rng"):
        trainstate.load(tmp_path / "c", {"w": np.zeros(3)})
    trainstate.load(tmp_path / "c", {"w": np.zeros(3)}, exclude="_rng.*")


@pytest.mark.parametrize("declared", ["provenance", [1], {"provenance": True}])
def test_a_malformed_declaration_is_refused_when_saving(tmp_path, declared):
    with pytest.raises(trainstate.InvalidArgumentError, match="added_keys"):
        trainstate.save(tmp_path / "c", {"w": np.arange(3.0)}, metadata={"trainstate": {"added_keys": declared}})
    assert not (tmp_path / "c").exists()


def test_a_malformed_declaration_in_a_checkpoint_is_corruption(tmp_path):
    trainstate.save(tmp_path / "c", {"w": np.arange(3.0)}, metadata={"trainstate": {"added_keys": ["w"]}})
    # the metadata's encoded tree: {"trainstate": {"added_keys": ...}}; a string instead of a list
    reseal_manifest(tmp_path / "c", lambda body: body["metadata"]["v"][0][1]["v"][0].__setitem__(1, "w"))
    with pytest.raises(trainstate.CorruptCheckpointError, match="added_keys should be a list"):
        trainstate.load(tmp_path / "c", {"w": np.zeros(3)})
