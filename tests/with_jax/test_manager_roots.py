"""The manager with an immutable JAX state: restored values come back, never half a restore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
train_state = pytest.importorskip("flax.training.train_state")

import jax.numpy as jnp  # noqa: E402

import trainstate  # noqa: E402


def _state(v: float) -> Any:
    """A TrainState whose step, Adam count and params all say ``v``."""
    s = train_state.TrainState.create(apply_fn=None, params={"w": jnp.full(4, v)}, tx=optax.adam(1e-3))
    adam = s.opt_state[0]._replace(count=jnp.asarray(int(v)))
    return s.replace(step=jnp.asarray(int(v)), opt_state=(adam, s.opt_state[1]))


def test_restore_latest_refuses_an_immutable_root_before_touching_it(tmp_path: Path) -> None:
    with trainstate.CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"ts": _state(7.0)})
    target = _state(0.0)
    with trainstate.CheckpointManager(tmp_path) as mgr, pytest.raises(trainstate.InvalidArgumentError, match="dict"):
        mgr.restore_latest(target)
    assert float(target.params["w"][0]) == 0.0  # its mutable params dict was not filled either

    state = {"ts": _state(0.0)}
    with trainstate.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest(state) == 4
    assert int(state["ts"].step) == 7 and int(state["ts"].opt_state[0].count) == 7
