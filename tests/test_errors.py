"""Error messages a user meets: the StateMismatchError hint names what would actually help."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import trainstate


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "c"
    trainstate.save(path, {"model": {"w": np.zeros((3, 4), np.float32), "b": np.zeros(3, np.float32)}, "step": 5})
    return path


def _hint(error: trainstate.StateMismatchError) -> str:
    return str(error).splitlines()[-1]


@pytest.mark.parametrize("strict", [True, False])
def test_shape_mismatch_hint_does_not_offer_strict_false(ckpt: Path, strict: bool) -> None:
    target = {"model": {"w": np.zeros((3, 5), np.float32), "b": np.zeros(3, np.float32)}, "step": 0}
    with pytest.raises(trainstate.StateMismatchError) as err:
        trainstate.load(ckpt, target, strict=strict)
    hint = _hint(err.value)
    assert "strict=False" not in hint, hint  # it would not help: shapes must always match
    assert "shape" in hint and "exclude=['model.w']" in hint, hint
    trainstate.load(ckpt, target, strict=strict, exclude=["model.w"])  # the hint's advice works
    assert target["step"] == 5


def test_kind_mismatch_hint_does_not_offer_strict_false(ckpt: Path) -> None:
    target = {"model": {"w": {"nested": 1}, "b": np.zeros(3, np.float32)}, "step": 0}
    with pytest.raises(trainstate.StateMismatchError) as err:
        trainstate.load(ckpt, target, strict=False)
    hint = _hint(err.value)
    assert "strict=False" not in hint and "exclude=['model.w']" in hint, hint


def test_missing_keys_and_dtypes_hint_offers_strict_false(ckpt: Path) -> None:
    target = {"model": {"w": np.zeros((3, 4), np.float64), "b": np.zeros(3, np.float32)}, "step": 0, "new": 1}
    with pytest.raises(trainstate.StateMismatchError) as err:
        trainstate.load(ckpt, target)
    hint = _hint(err.value)
    assert "strict=False" in hint and "missing" in hint and "dtype" in hint, hint
    trainstate.load(ckpt, target, strict=False)  # the hint's advice works
    assert target["model"]["w"].dtype == np.float64 and target["step"] == 5


def test_mixed_mismatches_say_what_strict_false_covers_and_what_it_does_not(ckpt: Path) -> None:
    target = {"model": {"w": np.zeros((3, 5), np.float32), "b": np.zeros(3, np.float32)}, "step": 0, "new": 1}
    with pytest.raises(trainstate.StateMismatchError) as err:
        trainstate.load(ckpt, target)
    hint = _hint(err.value)
    assert "strict=False" in hint and "missing" in hint and "exclude=['model.w']" in hint, hint
    trainstate.load(ckpt, target, strict=False, exclude="model.w")
    assert target["step"] == 5
