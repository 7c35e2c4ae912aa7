"""The CheckpointManager with JAX states, the way a Flax training script uses it: sync and async saves,
retention, resuming into fresh objects, and a loop that keeps replacing (and donating) its arrays while an
async save of the old ones is in flight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import flax.struct  # noqa: E402
from jax_helpers import BATCH, assert_same_leaves, host, nnx_run, nnx_step, put, raw_key  # noqa: E402

import trainstate  # noqa: E402


def manager(directory: Path, **kwargs: Any) -> trainstate.CheckpointManager:
    return trainstate.CheckpointManager(directory, save_on_preemption=False, **kwargs)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_nnx_run_saves_keeps_the_last_two_and_resumes_into_fresh_objects(tmp_path: Path, async_save: bool) -> None:
    model, optimizer = nnx_run(raw_key(0))
    mgr = manager(tmp_path / "run", keep_last=2, async_save=async_save)
    saved = {}
    for step in range(4):
        nnx_step(model, optimizer, *BATCH)
        mgr.save(step, {"model": model, "optim": optimizer, "epoch": step // 2})
        saved[step] = jax.tree.map(host, nnx.state((model, optimizer)))  # what save() was given
    mgr.wait()
    assert [info.step for info in mgr.list()] == [2, 3]
    assert all(record.background == async_save and record.error is None for record in mgr.history())
    mgr.close()

    fresh, fresh_optimizer = nnx_run(raw_key(1))
    state = {"model": fresh, "optim": fresh_optimizer, "epoch": 0}
    resumed = manager(tmp_path / "run", keep_last=2, async_save=async_save)
    assert resumed.restore_latest(state) == 4
    assert state["model"] is fresh and state["epoch"] == 1
    assert_same_leaves(jax.tree.map(host, nnx.state((fresh, fresh_optimizer))), saved[3])
    assert (
        host(nnx_step(fresh, fresh_optimizer, *BATCH)).tobytes() == host(nnx_step(model, optimizer, *BATCH)).tobytes()
    )
    resumed.restore(2, state)  # an older one, by step
    assert_same_leaves(jax.tree.map(host, nnx.state((fresh, fresh_optimizer))), saved[2])
    resumed.close()


def _train(params: dict[str, Any], grads: dict[str, Any]) -> dict[str, Any]:
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)


train = jax.jit(_train)
train_donating = jax.jit(_train, donate_argnums=0)  # the old arrays' buffers are reused: they are deleted


@pytest.mark.parametrize("donate", [False, True], ids=["replaced", "donated"])
def test_an_async_save_holds_the_arrays_of_save_time_while_the_loop_replaces_them(tmp_path: Path, donate: bool) -> None:
    """save() returns at once and the write goes on in the background while the loop replaces the arrays --
    with donation, deletes them. The checkpoint holds what save() was given, and nothing in the background
    touches the deleted arrays."""
    step_fn = train_donating if donate else train
    params = {"w": put(np.arange(64 * 64, dtype=np.float32).reshape(64, 64)), "b": put(np.ones(64, np.float32))}
    grads = jax.tree.map(lambda p: put(np.full(p.shape, 0.25, np.float32)), params)
    mgr = manager(tmp_path / "run", async_save=True, max_in_flight=2)
    expected = {}
    for step in range(4):
        mgr.save(step, {"params": params, "step": step})
        expected[step] = jax.tree.map(np.array, params)  # copies, taken before the arrays are replaced
        old = params
        params = step_fn(params, grads)
        assert all(a.is_deleted() for a in jax.tree.leaves(old)) == donate
    mgr.wait()
    assert [r.error for r in mgr.history()] == [None] * 4
    for step, values in expected.items():
        loaded = trainstate.load(mgr.path_for(step))
        assert loaded["step"] == step
        for name, value in values.items():
            np.testing.assert_array_equal(loaded["params"][name], value, err_msg=f"step {step} {name}")
    mgr.close()


def test_a_donated_array_given_to_an_async_save_is_refused_at_once(tmp_path: Path) -> None:
    params = {"w": put(np.ones((4, 4), np.float32))}
    train_donating(params, {"w": put(np.ones((4, 4), np.float32))})  # donated: params["w"] is deleted
    mgr = manager(tmp_path / "run", async_save=True)
    with pytest.raises(trainstate.UnsupportedValueError, match=r"^params\.w: .*deleted"):
        mgr.save(1, {"params": params})
    assert mgr.list() == []
    mgr.close()


@flax.struct.dataclass
class Run:
    params: dict[str, Any]
    step: Any


def test_a_state_that_cannot_change_in_place_is_refused_by_restore_latest_and_returned_by_restore(
    tmp_path: Path,
) -> None:
    """JAX pytrees (a TrainState) and arrays are immutable: restoring makes new ones. restore_latest returns the
    step, not the state, so it refuses one before reading anything (its restored value would be lost and the
    state half restored: a dict inside it filled, its step not); restore returns the restored value."""
    mgr = manager(tmp_path / "run")
    mgr.save(3, Run(params={"w": put(np.ones(3, np.float32))}, step=3))
    fresh = Run(params={"w": put(np.zeros(3, np.float32))}, step=0)
    for immutable in (fresh, fresh.params["w"]):
        with pytest.raises(trainstate.InvalidArgumentError, match="cannot change in place.*dict"):
            mgr.restore_latest(immutable)
    assert not np.asarray(fresh.params["w"]).any() and fresh.step == 0  # nothing was read
    restored = mgr.restore(3, fresh)
    assert type(restored) is Run and restored.step == 3 and np.asarray(restored.params["w"]).all()
    mgr.save(4, {"run": restored})  # the way: a dict holding it
    holder = {"run": fresh}
    assert mgr.restore_latest(holder) == 5 and holder["run"].step == 3 and np.asarray(holder["run"].params["w"]).all()
    mgr.close()
