"""Dict keys that all share one hash value: Python's int and float hashes are not randomized (an int hashes to
itself modulo 2**61 - 1), so the keys ``k * (2**61 - 1)`` all hash to 0 and each insertion into a dict probes
every earlier key. A manifest of a few MB holding such a dict would take hours to load; trainstate refuses a
dict with more than a few distinct keys of one hash, when it reads and when it saves."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trainstate
from helpers import reseal_manifest
from trainstate import _tree as tree

M = (1 << 61) - 1  # hash(k * M) == 0 for every int k
N = 20_000  # building a dict of N such keys takes seconds; refusing them takes milliseconds


def _flood_node(n: int) -> dict[str, Any]:
    return {"t": "dict", "v": [[k * M, k] for k in range(1, n + 1)]}


def test_a_manifest_dict_of_keys_sharing_one_hash_is_refused_quickly() -> None:
    started = time.perf_counter()
    with pytest.raises(trainstate.CorruptCheckpointError, match="share one hash"):
        tree.parse({"t": "dict", "v": [["opt", _flood_node(N)]]}, set())
    assert time.perf_counter() - started < 1.5  # the quadratic build takes several seconds


def test_a_checkpoint_whose_tree_holds_such_a_dict_is_refused_naming_its_manifest(tmp_path: Path) -> None:
    trainstate.save(tmp_path / "c", {"w": np.ones(3), "n": 1})
    reseal_manifest(tmp_path / "c", lambda body: body["tree"]["v"].append(["flood", _flood_node(N)]))
    started = time.perf_counter()
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"manifest.*share one hash"):
        trainstate.load(tmp_path / "c")
    assert time.perf_counter() - started < 3


def test_tuple_keys_built_from_colliding_ints_are_refused() -> None:
    keys = [{"t": "tuple", "v": [k * M, 1]} for k in range(1, 50)]
    with pytest.raises(trainstate.CorruptCheckpointError, match="share one hash"):
        tree.parse({"t": "dict", "v": [[k, 0] for k in keys]}, set())


def test_a_state_whose_keys_collide_is_refused_at_save_not_saved_unreadable(tmp_path: Path) -> None:
    state = {"opt": {k * M: k for k in range(1, 20)}}
    with pytest.raises(trainstate.UnsupportedValueError, match=r"opt: .*share one hash"):
        trainstate.save(tmp_path / "c", state)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "keys",
    [
        list(range(100_000)),  # an optimizer's parameter indices
        [-1, -2, 0, M, 2 * M, 0.5, -0.5, True, None, (1, 2), (2, 1), 1.5, float("nan"), float("inf")],
        [k * M for k in range(1, 9)],  # a few keys of one hash: no real state has them, but they cost nothing
    ],
    ids=["indices", "mixed", "eight-of-one-hash"],
)
def test_real_keys_still_save_and_load(tmp_path: Path, keys: list[Any]) -> None:
    state = {"opt": {k: i for i, k in enumerate(keys)}}
    trainstate.save(tmp_path / "c", state)
    loaded = trainstate.load(tmp_path / "c")
    assert len(loaded["opt"]) == len(state["opt"])
    assert [loaded["opt"][k] for k in keys if k == k] == [state["opt"][k] for k in keys if k == k]
