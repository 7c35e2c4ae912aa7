"""Restore rules users meet by habit: partial loads without a target, objects vs saved plain values, depth."""

from __future__ import annotations

import numpy as np
import pytest

import trainstate


def test_load_without_target_honours_include_and_exclude(tmp_path):
    state = {"model": {"w": np.ones(3), "b": np.zeros(2)}, "optim": {"m": np.arange(4)}, "step": 7}
    trainstate.save(tmp_path / "c", state)
    only_model = trainstate.load(tmp_path / "c", include="model.*")
    assert set(only_model) == {"model"} and set(only_model["model"]) == {"w", "b"}
    no_bias = trainstate.load(tmp_path / "c", exclude=["model.b", "optim.*"])
    assert set(no_bias) == {"model", "step"} and set(no_bias["model"]) == {"w"}
    with trainstate.open(tmp_path / "c") as ck:
        assert set(ck.load(include="optim.*")) == {"optim"}


class _Averaged:
    """Stands in for torch.optim.swa_utils.AveragedModel: an object with state."""

    def __init__(self) -> None:
        self.loaded = False

    def state_dict(self):
        return {"n": np.zeros(1)}

    def load_state_dict(self, state):
        self.loaded = True


@pytest.mark.parametrize("live", [_Averaged(), {"n": np.zeros(1)}, [np.zeros(1)]], ids=["object", "dict", "list"])
def test_a_saved_plain_value_never_replaces_a_live_object(tmp_path, live):
    trainstate.save(tmp_path / "c", {"ema": None, "step": 3})
    target = {"ema": live, "step": 0}
    with pytest.raises(trainstate.StateMismatchError, match="ema"):
        trainstate.load(tmp_path / "c", target)
    assert target["ema"] is live and target["step"] == 0  # nothing was touched


def _nest(levels: int):
    value: object = np.arange(3)
    for i in range(levels):
        value = {"k": value} if i % 2 else [value]
    return value


def test_what_saves_also_opens_at_the_depth_limit(tmp_path):
    deepest = _nest(trainstate._tree.MAX_DEPTH)
    trainstate.save(tmp_path / "deep", {"x": _nest(trainstate._tree.MAX_DEPTH - 1)})
    back = trainstate.load(tmp_path / "deep")
    with trainstate.open(tmp_path / "deep") as ck:
        assert len(ck.keys()) == 1
    node = back["x"]
    for _ in range(trainstate._tree.MAX_DEPTH - 1):
        node = node["k"] if isinstance(node, dict) else node[0]
    assert np.array_equal(node, np.arange(3))
    trainstate.save(tmp_path / "deepest", deepest)
    trainstate.load(tmp_path / "deepest")
    with pytest.raises(trainstate.UnsupportedValueError, match="deeper"):
        trainstate.save(tmp_path / "too", {"x": deepest})
    assert not (tmp_path / "too").exists()


def test_a_stateful_chain_counts_levels_like_containers(tmp_path):
    class Wrap:
        def __init__(self, inner):
            self.inner = inner

        def state_dict(self):
            return self.inner

        def load_state_dict(self, s):
            pass

    value: object = 1
    for _ in range(trainstate._tree.MAX_DEPTH + 1):
        value = Wrap(value)
    with pytest.raises(trainstate.UnsupportedValueError, match="deeper"):
        trainstate.save(tmp_path / "c", value)


def test_include_or_exclude_that_matches_nothing_says_so(tmp_path):
    trainstate.save(tmp_path / "c", {"model": {"w": np.ones(3)}, "step": 1})
    for what in ("include", "exclude"):
        for patterns in ("nomatch", "nomatch.*", ["model", "y"]):  # a typo in a list is caught too
            with pytest.raises(trainstate.InvalidArgumentError, match=f"{what} pattern.*matches no key"):
                trainstate.load(tmp_path / "c", **{what: patterns})
    with pytest.raises(trainstate.InvalidArgumentError, match="glob pattern"):
        trainstate.load(tmp_path / "c", include=3)
    assert trainstate.load(tmp_path / "c", exclude="*") == {}


def test_a_pattern_naming_a_key_takes_everything_under_it(tmp_path):
    """``exclude=["rng"]`` (as docs/distributed.md says) skips the RNG state; it used to match only a leaf
    called "rng" and silently skip nothing -- and ``exclude="model"`` restored the model anyway."""
    trainstate.save(tmp_path / "c", {"model": {"w": np.ones(3)}, "rng": {"torch": np.arange(4)}, "step": 1})
    mine = {"model": {"w": np.zeros(3)}, "rng": {"torch": np.zeros(4, dtype=np.int64)}, "step": 0}
    out = trainstate.load(tmp_path / "c", mine, exclude=["rng", "model"])
    assert out["step"] == 1 and not mine["model"]["w"].any() and not mine["rng"]["torch"].any()
    assert set(trainstate.load(tmp_path / "c", include="model")) == {"model"}


def test_reading_an_unknown_tensor_is_a_checkpoint_error_and_a_key_error(tmp_path):
    trainstate.save(tmp_path / "c", {"model": {"weight": np.ones(3)}})
    with trainstate.open(tmp_path / "c") as ck:
        with pytest.raises(trainstate.UnknownKeyError, match="model.weight"):
            ck.read("model.weight2")
        with pytest.raises(KeyError):
            ck.info("nope")


class _Holder:
    """An object with state (a model of some framework) whose state_dict names its arrays with dotted keys."""

    def __init__(self, arrays):
        self.arrays = arrays

    def state_dict(self):
        return self.arrays

    def load_state_dict(self, state):
        self.arrays = state


VALUES = {"0.w": np.arange(2.0), "0.b": np.arange(1.0) + 5, "1.w": np.arange(3.0) + 7}


def _nested(values):
    return {"0": {"w": values["0.w"], "b": values["0.b"]}, "1": {"w": values["1.w"]}}


@pytest.mark.parametrize("saved", ["dotted", "object"])
def test_names_map_by_path_from_dotted_keys_and_objects_into_nested_dicts(tmp_path, saved):
    """A tensor's name is its path: dotted keys and nested dicts name the same arrays, and an object's state
    restores into a plain container of the same paths (a torch model's state into a JAX program's dicts)."""
    trainstate.save(tmp_path / "c", {"m": _Holder(VALUES) if saved == "object" else VALUES})
    target = {"m": _nested({k: np.zeros_like(v) for k, v in VALUES.items()})}
    restored = trainstate.load(tmp_path / "c", target)
    assert restored is target and restored["m"].keys() == {"0", "1"} and restored["m"]["0"].keys() == {"w", "b"}
    for key, value in VALUES.items():
        outer, inner = key.split(".")
        assert np.array_equal(restored["m"][outer][inner], value), key
    wrong = {"m": _nested({k: np.zeros_like(v) for k, v in VALUES.items()})}
    wrong["m"]["1"]["b"] = np.zeros(1)
    del wrong["m"]["0"]["b"]
    with pytest.raises(trainstate.StateMismatchError) as e:
        trainstate.load(tmp_path / "c", wrong)
    assert e.value.missing == ["m.1.b"] and e.value.unexpected == ["m.0.b"]


def test_names_map_by_path_from_nested_dicts_into_dotted_keys(tmp_path):
    trainstate.save(tmp_path / "c", {"m": _nested(VALUES)})
    target = {"m": {k: np.zeros_like(v) for k, v in VALUES.items()}}
    trainstate.load(tmp_path / "c", target)
    assert target["m"].keys() == VALUES.keys() and all(np.array_equal(target["m"][k], v) for k, v in VALUES.items())
