"""What a JAX user gets wrong, and the error that says so (from the new-user trial)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import trainstate  # noqa: E402


def test_64_bit_values_jax_would_cut_are_refused_and_ones_that_fit_are_narrowed(tmp_path: Path) -> None:
    assert not jax.config.read("jax_enable_x64")  # JAX's default: 64-bit arrays are made 32-bit
    trainstate.save(
        tmp_path / "c",
        {
            "big": np.array([2**40 + 1, -1]),
            "small": np.array([3, 4]),
            "fine": np.array([1 + 1e-12]),
            "half": np.array([0.5]),
        },
    )
    for target in (None, {"big": jax.ShapeDtypeStruct((2,), np.int64)}):
        with pytest.raises(trainstate.UnsupportedValueError, match=r"big: its int64 values do not fit int32"):
            if target is None:
                trainstate.load(tmp_path / "c", framework="jax", include="big")
            else:
                trainstate.load(tmp_path / "c", target, include="big")
    with pytest.raises(trainstate.UnsupportedValueError, match=r"fine: its float64 values do not fit float32"):
        trainstate.load(tmp_path / "c", framework="jax", include="fine")
    with trainstate.open(tmp_path / "c") as ck, pytest.raises(trainstate.UnsupportedValueError, match="big: "):
        ck.read("big", framework="jax")
    exact = trainstate.load(tmp_path / "c", framework="jax", include=["small", "half"])
    assert exact["small"].dtype == jnp.int32 and exact["small"].tolist() == [3, 4]
    assert exact["half"].dtype == jnp.float32 and exact["half"].tolist() == [0.5]


def test_saving_inside_jit_names_the_traced_value(tmp_path: Path) -> None:
    @jax.jit
    def step(x: jax.Array) -> jax.Array:
        trainstate.save(tmp_path / "c", {"w": x})
        return x + 1

    with pytest.raises(trainstate.UnsupportedValueError, match=r"w: a traced value .*outside the transformed function"):
        step(jnp.ones(2))
    assert not (tmp_path / "c").exists()


def test_a_loops_step_counter_restores_whether_it_is_a_number_or_a_0d_array(tmp_path: Path) -> None:
    """``state = {"step": 0}`` holds an array after the first jitted step; a fresh state on resume holds 0."""
    trainstate.save(tmp_path / "c", {"step": jnp.int32(4), "loss": jnp.float32(0.5), "seen": 7})
    fresh = {"step": 0, "loss": 0.0, "seen": jnp.int32(0)}
    trainstate.load(tmp_path / "c", fresh)
    assert fresh["step"] == 4 and type(fresh["step"]) is int
    assert fresh["loss"] == 0.5 and type(fresh["loss"]) is float
    assert isinstance(fresh["seen"], jax.Array) and int(fresh["seen"]) == 7
    wrong = {"step": 0.0, "loss": 0, "seen": jnp.int32(0)}  # a float where an int was saved, and back
    with pytest.raises(trainstate.StateMismatchError, match=r"(?s)step: target has float.*loss: target has int"):
        trainstate.load(tmp_path / "c", wrong)
    assert wrong == {"step": 0.0, "loss": 0, "seen": wrong["seen"]} and int(wrong["seen"]) == 0
    trainstate.save(tmp_path / "big", {"n": 2**40})  # a saved number a 0-d int32 array cannot hold
    with pytest.raises(trainstate.StateMismatchError, match="n: "):
        trainstate.load(tmp_path / "big", {"n": jnp.int32(0)})
