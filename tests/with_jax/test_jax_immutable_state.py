"""A state that cannot change in place (a Flax ``TrainState``, a JAX array) is never half-restored in silence.

``trainstate.load`` and ``CheckpointManager.restore`` return the restored state, a new one where the old one
cannot change; ``restore_latest`` returns only a step, so it refuses such a state (wrap it in a dict) rather
than leave the user training from the step counter and optimizer count of a fresh run.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("flax.training.train_state")
pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402 - after the skips
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import trainstate  # noqa: E402
from trainstate.errors import InvalidArgumentError  # noqa: E402


def _train_state(value: float) -> TrainState:
    params = {"w": jnp.full((3,), value)}
    return TrainState.create(apply_fn=lambda p, x: x, params=params, tx=optax.adam(1e-2))


def _trained() -> TrainState:
    state = _train_state(1.0)
    return state.apply_gradients(grads={"w": jnp.ones(3)})  # step 1, Adam's count 1


def test_restore_latest_refuses_a_train_state_it_could_only_half_restore(tmp_path):
    with trainstate.CheckpointManager(tmp_path) as manager:
        manager.save(1, _trained())
    with trainstate.CheckpointManager(tmp_path) as manager:
        with pytest.raises(InvalidArgumentError, match=r"put it in a dict.*mgr.restore"):
            manager.restore_latest(_train_state(0.0))


def test_restore_latest_into_a_dict_holding_a_train_state_restores_all_of_it(tmp_path):
    saved = _trained()
    with trainstate.CheckpointManager(tmp_path) as manager:
        manager.save(1, {"train": saved})
    state = {"train": _train_state(0.0)}
    with trainstate.CheckpointManager(tmp_path) as manager:
        assert manager.restore_latest(state) == 2
    assert state["train"].step == 1 and int(state["train"].opt_state[0].count) == 1
    assert np.array_equal(state["train"].params["w"], saved.params["w"])


def test_manager_restore_returns_the_new_train_state(tmp_path):
    saved = _trained()
    with trainstate.CheckpointManager(tmp_path) as manager:
        manager.save(1, saved)
        restored = manager.restore(1, _train_state(0.0))
    assert isinstance(restored, TrainState) and restored.step == 1 and int(restored.opt_state[0].count) == 1
    assert np.array_equal(restored.params["w"], saved.params["w"])


def test_restore_latest_still_takes_a_tuple_whose_parts_change_in_place(tmp_path):
    with trainstate.CheckpointManager(tmp_path) as manager:
        manager.save(1, (np.arange(3.0), np.ones(2)))
    state = (np.zeros(3), np.zeros(2))
    with trainstate.CheckpointManager(tmp_path) as manager:
        assert manager.restore_latest(state) == 2
    assert np.array_equal(state[0], np.arange(3.0)) and np.array_equal(state[1], np.ones(2))
