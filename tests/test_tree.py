"""The state tree: one typed representation, one walker, one depth rule for whatever writes or reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trainstate
from helpers import assert_same, reseal_manifest
from trainstate import _checksum as checksum
from trainstate import _state
from trainstate import _tree as tree
from trainstate._restore.plan import Restorer

MAX = tree.MAX_DEPTH


class Wrap:
    """A user's stateful object whose state is whatever it wraps."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner

    def state_dict(self) -> Any:
        return self.inner

    def load_state_dict(self, state: Any) -> None:
        self.inner = state

    def __hash__(self) -> int:
        return 1


def _wrap(kind: str, value: Any) -> Any:
    return {
        "list": lambda: [value],
        "tuple": lambda: (value,),
        "dict": lambda: {"k": value},
        "stateful": lambda: Wrap(value),
    }[kind]()


def nest(kind: str, levels: int, leaf: Any = None) -> Any:
    """``leaf`` (a tensor by default) under ``levels`` containers of ``kind``: it sits at depth ``levels``."""
    value: Any = np.arange(3) if leaf is None else leaf
    for _ in range(levels):
        value = _wrap(kind, value)
    return value


KINDS = ["list", "tuple", "dict", "stateful"]


# -- one depth rule, for writing and for reading -------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_deepest_state_that_saves_opens_and_one_level_more_is_refused_by_both(tmp_path, kind):
    trainstate.save(tmp_path / "deepest", nest(kind, MAX))
    with trainstate.open(tmp_path / "deepest") as ck:
        assert len(ck.keys()) == 1
        (name,) = ck.keys()
    back = trainstate.load(tmp_path / "deepest")
    for _ in range(MAX):
        back = back["k"] if isinstance(back, dict) else back if kind == "stateful" else back[0]
    assert np.array_equal(back, np.arange(3))

    with pytest.raises(trainstate.UnsupportedValueError, match=f"deeper than {MAX}"):
        trainstate.save(tmp_path / "too", nest(kind, MAX + 1))
    assert not (tmp_path / "too").exists()

    # the same state, one level deeper, written by hand: the reader refuses it by the same count
    one_more = {
        "list": lambda t: {"t": "list", "v": [t]},
        "tuple": lambda t: {"t": "tuple", "v": [t]},
        "dict": lambda t: {"t": "dict", "v": [["k", t]]},
        "stateful": lambda t: {"t": "stateful", "type": "x.Wrap", "v": t},
    }[kind]
    reseal_manifest(tmp_path / "deepest", lambda b: b.update(tree=one_more(b["tree"])))
    with pytest.raises(trainstate.CorruptCheckpointError, match=f"deeper than {MAX}"):
        trainstate.open(tmp_path / "deepest")


def test_dict_keys_count_levels_the_same_way_for_writing_and_reading(tmp_path):
    # a tuple key of a dict at depth MAX - 1 is at MAX, and its elements at MAX + 1: too deep for both
    trainstate.save(tmp_path / "ok", nest("list", MAX - 1, {(): 1}))  # an empty tuple key has no elements
    assert trainstate.load(tmp_path / "ok") is not None
    with pytest.raises(trainstate.UnsupportedValueError, match="deeper"):
        trainstate.save(tmp_path / "deep", nest("list", MAX - 1, {(1,): 1}))

    def deepen(body: dict[str, Any]) -> None:
        node = body["tree"]
        while node["t"] == "list" and node["v"][0]["t"] == "list":
            node = node["v"][0]
        node["v"][0]["v"][0][0] = {"t": "tuple", "v": [1]}

    reseal_manifest(tmp_path / "ok", deepen)
    with pytest.raises(trainstate.CorruptCheckpointError, match="deeper"):
        trainstate.open(tmp_path / "ok")


def test_the_walk_is_iterative_for_writing_and_reading():
    """100,000 levels: refused with trainstate's errors, never a RecursionError from either side."""
    deep_state: list[Any] = []
    deep_json: dict[str, Any] = {"t": "list", "v": []}
    state_end, json_end = deep_state, deep_json
    for _ in range(100_000):
        state_end.append([])
        state_end = state_end[0]
        child: dict[str, Any] = {"t": "list", "v": []}
        json_end["v"].append(child)
        json_end = child
    with pytest.raises(trainstate.UnsupportedValueError, match="deeper"):
        _state.encode(deep_state, lambda path, value: "x")
    with pytest.raises(trainstate.CorruptCheckpointError, match="deeper"):
        tree.parse(deep_json, set())


# -- hostile manifests ---------------------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    trainstate.save(tmp_path / "c", {"w": np.ones(3), "n": 1}, metadata={"run": "x"})
    return tmp_path / "c"


def _seal_tree_text(path: Path, tree_text: str) -> None:
    """Write a manifest whose tree is ``tree_text`` as it is: JSON too deep for json.dumps to write."""
    body = json.loads((path / "manifest.json").read_bytes())
    body.pop("checksum")

    def canonical(fields: dict[str, Any]) -> bytes:
        texts = {k: json.dumps(v, sort_keys=True, separators=(",", ":")) for k, v in fields.items()}
        texts["tree"] = tree_text
        return ("{" + ",".join(f"{json.dumps(k)}:{texts[k]}" for k in sorted(texts)) + "}").encode()

    digest = checksum.digest(canonical(body))
    (path / "manifest.json").write_bytes(canonical({**body, "checksum": digest}) + b"\n")


def test_a_manifest_nested_100k_levels_deep_is_refused(ckpt):
    n = 100_000
    _seal_tree_text(ckpt, '{"t":"list","v":[' * n + "]}" * n)
    with pytest.raises(trainstate.CorruptCheckpointError):
        trainstate.open(ckpt)
    with pytest.raises(trainstate.CorruptCheckpointError):
        trainstate.load(ckpt)


HOSTILE_TREES = {
    "bare list": [1, 2],
    "untagged dict": {"w": 1},
    "unknown tag": {"t": "pickle", "v": "cos\nsystem\n"},
    "list without items": {"t": "list"},
    "list items not a list": {"t": "list", "v": {"a": 1}},
    "dict items not a list": {"t": "dict", "v": 5},
    "dict item not a pair": {"t": "dict", "v": [["a", 1, 2]]},
    "dict item a string": {"t": "dict", "v": ["ab"]},
    "list as a key": {"t": "dict", "v": [[{"t": "list", "v": []}, 1]]},
    "dict as a key": {"t": "dict", "v": [[{"t": "dict", "v": []}, 1]]},
    "tensor as a key": {"t": "dict", "v": [[{"t": "tensor", "name": "w"}, 1]]},
    "stateful as a key": {"t": "dict", "v": [[{"t": "stateful", "type": "x", "v": 1}, 1]]},
    "list inside a tuple key": {"t": "dict", "v": [[{"t": "tuple", "v": [{"t": "list", "v": []}]}, 1]]},
    "tensor without a name": {"t": "tensor"},
    "tensor name not a string": {"t": "tensor", "name": ["w"]},
    "tensor not listed": {"t": "tensor", "name": "nope"},
    "stateful without a type": {"t": "stateful", "v": 1},
    "stateful without a state": {"t": "stateful", "type": "x"},
    "float not non-finite": {"t": "float", "v": "1.5"},
    "float value unhashable": {"t": "float", "v": ["nan"]},
    "bytes not base64": {"t": "bytes", "v": "!!"},
    "bytes not a string": {"t": "bytes", "v": 3},
    "bare NaN": {"t": "list", "v": [float("nan")]},
    "bare infinity as a key": {"t": "dict", "v": [[float("inf"), 1]]},
}


@pytest.mark.parametrize("bad", HOSTILE_TREES.values(), ids=HOSTILE_TREES.keys())
def test_wrong_node_shapes_are_corrupt_checkpoints(ckpt, bad):
    reseal_manifest(ckpt, lambda b: b.update(tree=bad))
    with pytest.raises(trainstate.CorruptCheckpointError):
        trainstate.open(ckpt)
    with pytest.raises(trainstate.CorruptCheckpointError):
        trainstate.load(ckpt, {"w": np.zeros(3), "n": 0})


@pytest.mark.parametrize(
    "bad", [{"t": "tensor", "name": "w"}, {"t": "dict", "v": [["a", {"t": "tensor", "name": "w"}]]}]
)
def test_metadata_may_hold_no_tensor(ckpt, bad):
    reseal_manifest(ckpt, lambda b: b.update(metadata=bad))
    with pytest.raises(trainstate.CorruptCheckpointError, match="metadata"):
        trainstate.open(ckpt)


def test_numpy_scalars_in_metadata_are_stored_as_the_numbers_they_stand_for(tmp_path):
    meta = {"lr": np.float32(0.5), "steps": [np.int64(3), np.uint8(2)], "done": (np.bool_(True),)}
    trainstate.save(tmp_path / "c", {"w": np.ones(2)}, metadata=meta)
    with trainstate.open(tmp_path / "c") as ck:
        got = ck.metadata
    assert got == {"lr": 0.5, "steps": [3, 2], "done": (True,)}
    assert [type(v) for v in got["steps"]] == [int, int] and type(got["lr"]) is float
    with pytest.raises(trainstate.UnsupportedValueError, match="metadata.a: arrays cannot"):
        trainstate.save(tmp_path / "d", {"w": np.ones(2)}, metadata={"a": np.ones(2)})  # an array is still refused


# -- what saves, opens -----------------------------------------------------------------------------------


def test_a_key_holding_a_stateful_object_is_refused_when_saving_not_when_opening(tmp_path):
    """The key rule is the reader's: before, this saved a manifest that no reader would open."""
    with pytest.raises(trainstate.UnsupportedValueError, match="dict key"):
        trainstate.save(tmp_path / "c", {"cache": {(1, Wrap()): np.zeros(2)}})
    assert not (tmp_path / "c").exists()


def test_every_key_the_reader_accepts_round_trips(tmp_path):
    nan = float("nan")
    state = {"d": {None: 1, True: 2, 3: 3, 1.5: 4, "s": 5, b"raw": 6, (1, ("a", b"b")): 7, float("inf"): 8, nan: 9}}
    trainstate.save(tmp_path / "c", state)
    back = trainstate.load(tmp_path / "c")
    assert_same(state, back)
    assert [type(k) for k in back["d"]] == [type(k) for k in state["d"]]


def test_the_tree_text_is_what_the_v1_fixture_holds():
    raw = json.loads((Path(__file__).parent / "fixtures" / "v1.0" / "basic" / "manifest.json").read_bytes())
    node = tree.parse(raw["tree"], raw["tensors"])
    assert tree.to_json(node) == json.dumps(raw["tree"], sort_keys=True, separators=(",", ":"))
    assert tree.to_json(tree.parse(raw["metadata"], None)) == '{"t":"dict","v":[["run","golden"]]}'


# -- one set of dotted keys -------------------------------------------------------------------------------


def _mixed_state() -> dict[str, Any]:
    from helpers import make_training_state

    state = make_training_state()
    state.update(
        {
            "flags": [True, None, 2.5, b"\x00"],
            "pair": (np.ones(2, dtype=np.float16), "label"),
            "by_int": {0: np.zeros(3), 7: {"deep": [np.arange(2), {"x": 1}]}},
            "empty": {"d": {}, "l": [], "t": ()},
            "user": Wrap({"hist": np.arange(4.0), "count": 3}),
            "nan": float("nan"),
        }
    )
    return state


def test_keys_the_cli_and_the_planner_agree_on_the_dotted_keys(tmp_path):
    pytest.importorskip("torch")
    trainstate.save(tmp_path / "c", _mixed_state())
    with trainstate.open(tmp_path / "c") as ck:
        tensors = ck.keys()
        planned = Restorer(ck, strict=True, selected=None)._leaves(ck.manifest.tree, ())
    proc = subprocess.run(
        [sys.executable, "-m", "trainstate", "inspect", str(tmp_path / "c"), "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    listed = json.loads(proc.stdout)
    values = [v["path"] for v in listed["values"]]
    assert sorted(t["name"] for t in listed["tensors"]) == sorted(tensors)  # the table is stored sorted
    assert len(planned) == len(set(planned)) and not set(tensors) & set(values)
    assert set(planned) == set(tensors) | set(values)
    assert {"model.0.weight", "optim.state.model.0.weight.exp_avg", "by_int.7.deep.0", "pair.0", "user.hist"} <= set(
        tensors
    )
    assert {"flags.3", "pair.1", "by_int.7.deep.1.x", "empty.d", "empty.l", "empty.t", "user.count"} <= set(values)
    for key in planned:  # each key the planner lists selects exactly one part
        part = trainstate.load(tmp_path / "c", include=key)
        assert len(tree.leaves(_state.encode(part, lambda p, v: "x"))) == 1, key
