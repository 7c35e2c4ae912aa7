"""JAX training states save and restore as their users hold them: a Flax NNX model and optimizer in place, Flax
Linen parameters in a TrainState, Optax states of every shape, PRNG keys typed and raw; a target that does not
fit is refused before anything changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")


import flax.linen as nn  # noqa: E402
import flax.struct  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax_helpers import BATCH, MLP, assert_same_leaves, filled, host, nnx_run, nnx_step, put, raw_key  # noqa: E402

import trainstate  # noqa: E402

# -- Flax NNX: stateful objects, restored in place ----------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MLP, nnx.Optimizer]:
    """An NNX model and optimizer trained two steps, and their checkpoint."""
    model, optimizer = nnx_run(raw_key(0))
    for _ in range(2):
        nnx_step(model, optimizer, *BATCH)
    path = tmp_path_factory.mktemp("nnx") / "c"
    trainstate.save(path, {"model": model, "optim": optimizer, "step": 2})
    return path, model, optimizer


def test_nnx_model_and_optimizer_restore_in_place_into_fresh_objects(
    trained: tuple[Path, MLP, nnx.Optimizer],
) -> None:
    path, model, optimizer = trained
    fresh, fresh_optimizer = nnx_run(raw_key(1))  # other weights, another dropout key, no optimizer steps
    assert host(fresh.l1.kernel[...]).tobytes() != host(model.l1.kernel[...]).tobytes()
    layer, kernel = fresh.l1, fresh.l1.kernel
    restored = trainstate.load(path, {"model": fresh, "optim": fresh_optimizer, "step": 0})

    assert restored["model"] is fresh and restored["optim"] is fresh_optimizer and restored["step"] == 2
    assert fresh.l1 is layer and fresh.l1.kernel is kernel  # the user's references still hold the model's parts
    assert_same_leaves(nnx.state((fresh, fresh_optimizer)), nnx.state((model, optimizer)))
    assert host(kernel[...]).tobytes() == host(model.l1.kernel[...]).tobytes()
    # one more step (its dropout mask drawn from the restored key) gives the original run's numbers, bit for bit
    assert (
        host(nnx_step(fresh, fresh_optimizer, *BATCH)).tobytes() == host(nnx_step(model, optimizer, *BATCH)).tobytes()
    )
    assert_same_leaves(nnx.state((fresh, fresh_optimizer)), nnx.state((model, optimizer)))


def test_nnx_mismatch_is_refused_before_the_model_changes(trained: tuple[Path, MLP, nnx.Optimizer]) -> None:
    path = trained[0]
    saved = trainstate.load(path)["model"]
    wider, _ = nnx_run(raw_key(1))
    wider.head = nnx.Linear(2, 1, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(raw_key(2)))  # a layer more
    before = jax.tree.map(host, nnx.state(wider))
    with pytest.raises(trainstate.StateMismatchError) as e:
        trainstate.load(path, {"model": wider}, include="model")
    assert e.value.missing == ["model.head"] and "model.head" in str(e.value)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, host(b)), before, nnx.state(wider))
    trainstate.load(path, {"model": wider}, include="model", strict=False)  # the new layer keeps its weights
    np.testing.assert_array_equal(host(wider.l1.kernel[...]), saved["l1"]["kernel"])
    np.testing.assert_array_equal(host(wider.head.kernel[...]), before["head"]["kernel"])


def test_an_nnx_checkpoint_restores_into_a_pytree_of_its_state(trained: tuple[Path, MLP, nnx.Optimizer]) -> None:
    """Names map by path: the saved model's state restores into an ``nnx.State`` (a pytree, no module) and
    into plain nested dicts of arrays, as JAX code that holds the state apart from the module would."""
    path = trained[0]
    saved = trainstate.load(path)["model"]
    module = nnx_run(raw_key(1))[0]
    as_state = trainstate.load(path, {"model": nnx.state(module)}, include="model")["model"]
    as_dicts = trainstate.load(path, {"model": nnx.to_pure_dict(nnx.state(module))}, include="model")["model"]
    assert type(as_state) is nnx.State and type(as_dicts) is dict
    for restored in (nnx.to_pure_dict(as_state), as_dicts):
        assert jax.tree.structure(jax.tree.map(host, restored)) == jax.tree.structure(saved)
        for a, b in zip(jax.tree.leaves(jax.tree.map(host, restored)), jax.tree.leaves(saved)):
            assert a.tobytes() == b.tobytes()
    assert host(module.l1.kernel[...]).tobytes() != saved["l1"]["kernel"].tobytes()  # the module was not touched


# -- Flax Linen: parameters in a flax.struct TrainState, rebuilt from the target's structure -----------------


class Dense2(nn.Module):
    width: int = 4

    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.Dense(2)(nn.relu(nn.Dense(self.width)(x)))


MODULE, TX = Dense2(), optax.adamw(1e-2)  # one of each, so the jitted step compiles once


def linen_state(seed: int, module: Dense2 = MODULE) -> train_state.TrainState:
    """A TrainState of Linen parameters and AdamW's state, of the shapes ``init`` gives, filled from ``seed``."""
    params = filled(jax.eval_shape(module.init, raw_key(0), BATCH[0])["params"], start=100 * seed)
    opt_state = filled(jax.eval_shape(TX.init, params), start=100 * seed + 50)
    return train_state.TrainState(step=0, apply_fn=module.apply, params=params, tx=TX, opt_state=opt_state)


@jax.jit
def linen_step(state: train_state.TrainState) -> train_state.TrainState:
    x, y = BATCH
    grads = jax.grad(lambda p: ((state.apply_fn({"params": p}, x) - y) ** 2).mean())(state.params)
    return state.apply_gradients(grads=grads)


def test_linen_params_in_a_train_state_restore_into_a_fresh_one(tmp_path: Path) -> None:
    state = linen_step(linen_state(seed=0))
    trainstate.save(tmp_path / "c", {"train": state})
    with trainstate.open(tmp_path / "c") as ck:  # by path: fields, Linen module names, tuple indices
        assert {"train.step", "train.params.Dense_0.kernel", "train.opt_state.0.1.Dense_0.kernel"} <= set(ck.keys())
    fresh = linen_state(seed=1)  # as TrainState.create makes it: step 0, a Python int
    restored = trainstate.load(tmp_path / "c", {"train": fresh})["train"]
    assert type(restored) is train_state.TrainState
    assert restored.apply_fn is fresh.apply_fn and restored.tx is fresh.tx  # static fields: the target's
    assert type(restored.opt_state[0]) is type(state.opt_state[0])  # Optax's named tuples come back as such
    assert restored.step == 1 and type(restored.step) is int  # saved as the jitted step's array: the target's type
    assert_same_leaves((restored.params, restored.opt_state), (state.params, state.opt_state))
    assert_same_leaves(linen_step(restored), linen_step(state))  # and train on identically


def test_linen_shape_mismatch_names_every_tensor(tmp_path: Path) -> None:
    trainstate.save(tmp_path / "c", {"train": linen_state(seed=0)})
    wider = linen_state(seed=1, module=Dense2(width=5))
    with pytest.raises(trainstate.StateMismatchError) as e:
        trainstate.load(tmp_path / "c", {"train": wider})
    found = {key: (want, got) for key, want, got in e.value.mismatched}
    assert found["train.params.Dense_1.kernel"] == ("tensor F32[3, 5]", "tensor F32[3, 4]")
    assert "train.opt_state.0.1.Dense_1.kernel" in found and "train.opt_state.0.2.Dense_1.bias" in found  # Adam's


@flax.struct.dataclass
class Flags:
    on: Any
    scale: Any


def test_numbers_and_0d_arrays_restore_into_each_other_in_a_pytree(tmp_path: Path) -> None:
    """JAX makes a Python number a 0-d array wherever a jitted function takes or returns it: a TrainState's step
    is 0 when created and an int32 array after a jitted step. In a pytree either restores into the other, as the
    target holds it; a number never takes an array of another kind or shape."""
    created, stepped = linen_state(seed=0), linen_step(linen_state(seed=0))
    trainstate.save(tmp_path / "created", {"train": created, "flags": Flags(on=True, scale=0.5)})
    trainstate.save(
        tmp_path / "stepped", {"train": stepped, "flags": Flags(on=put(np.bool_(False)), scale=put(np.float32(2)))}
    )

    arrays = trainstate.load(
        tmp_path / "created", {"train": stepped, "flags": Flags(put(np.bool_(False)), put(np.float32(0)))}
    )
    assert isinstance(arrays["train"].step, jax.Array) and arrays["train"].step.dtype == stepped.step.dtype
    assert int(arrays["train"].step) == 0 and arrays["flags"].scale.dtype == np.float32 and bool(arrays["flags"].on)
    numbers = trainstate.load(tmp_path / "stepped", {"train": created, "flags": Flags(on=True, scale=1.0)})
    assert type(numbers["train"].step) is int and numbers["train"].step == 1
    assert numbers["flags"] == Flags(on=False, scale=2.0) and type(numbers["flags"].on) is bool

    with pytest.raises(trainstate.StateMismatchError) as e:  # a number never takes an array of another kind
        trainstate.load(tmp_path / "stepped", {"train": created.replace(step=0.0), "flags": Flags(on=1, scale=1.0)})
    assert sorted(e.value.mismatched) == [("flags.on", "int", "tensor BOOL[]"), ("train.step", "float", "tensor I32[]")]


# -- Optax states: NamedTuples of every shape ----------------------------------------------------------------

PARAMS = {"w": put(np.arange(6.0, dtype=np.float32).reshape(2, 3)), "b": put(np.ones(3, dtype=np.float32))}
OPTIMIZERS = {
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    "inject-hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=1e-4),
    "masked": lambda: optax.masked(optax.adam(1e-3), {"w": True, "b": False}),
    "multi-steps": lambda: optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
    "empty-state": lambda: optax.sgd(1e-2),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optax_states_restore_as_their_named_tuples(tmp_path: Path, name: str) -> None:
    tx = OPTIMIZERS[name]()
    shapes = jax.eval_shape(tx.init, PARAMS)
    saved, fresh = filled(shapes, start=1), filled(shapes, start=1000)
    trainstate.save(tmp_path / "c", {"opt": saved})
    restored = trainstate.load(tmp_path / "c", {"opt": fresh})["opt"]
    assert_same_leaves(restored, saved)  # the same NamedTuple types (the treedefs compare them) and values
    if name == "inject-hyperparams":
        assert set(restored.hyperparams) == {"learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay"}
    jax.eval_shape(tx.update, PARAMS, restored, PARAMS)  # the optimizer takes it (traced, not compiled)


# -- PRNG keys --------------------------------------------------------------------------------------------

WORDS = {"threefry2x32": 2, "rbg": 4}  # a key's size in uint32 words


def typed_key(impl: str, start: int, batch: tuple[int, ...] = ()) -> Any:
    data = np.arange(start, start + WORDS[impl] * int(np.prod(batch)), dtype=np.uint32)
    return jax.random.wrap_key_data(put(data.reshape(*batch, WORDS[impl])), impl=impl)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_restore_with_the_targets_implementation(tmp_path: Path, impl: str) -> None:
    state = {"key": typed_key(impl, 7), "keys": typed_key(impl, 70, batch=(3,))}
    trainstate.save(tmp_path / "c", state)
    target = {"key": typed_key(impl, 0), "keys": typed_key(impl, 0, batch=(3,))}
    restored = trainstate.load(tmp_path / "c", target)
    for name, saved in state.items():
        assert jax.random.key_impl(restored[name]) == jax.random.key_impl(saved)
        assert restored[name].shape == saved.shape and host(restored[name]).tobytes() == host(saved).tobytes()
    # stored as its key data: what another framework reads is uint32 words
    assert trainstate.load(tmp_path / "c")["keys"].shape == (3, WORDS[impl])


def test_raw_keys_and_typed_keys_restore_into_each_other(tmp_path: Path) -> None:
    raw = jax.random.PRNGKey(5)
    trainstate.save(tmp_path / "raw", {"rng": raw})
    restored = trainstate.load(tmp_path / "raw", {"rng": raw_key(0)})["rng"]
    assert restored.dtype == jnp.uint32 and host(restored).tobytes() == host(raw).tobytes()
    typed = trainstate.load(tmp_path / "raw", {"rng": typed_key("threefry2x32", 0)})["rng"]
    assert jax.random.key_impl(typed) == jax.random.key_impl(jax.random.key(0))  # jax.random.key(5) itself
    assert host(typed).tobytes() == host(raw).tobytes()
    trainstate.save(tmp_path / "typed", {"rng": typed})
    back = trainstate.load(tmp_path / "typed", {"rng": raw_key(0)})["rng"]
    assert back.dtype == jnp.uint32 and host(back).tobytes() == host(raw).tobytes()
    with pytest.raises(
        trainstate.StateMismatchError, match="rng: target has tensor U32.4., checkpoint has tensor U32.2."
    ):
        trainstate.load(tmp_path / "typed", {"rng": typed_key("rbg", 0)})  # an rbg key is four words, not two


# -- dtypes, keys and shapes that do not fit -----------------------------------------------------------------

DTYPES = [np.float32, jnp.bfloat16, np.float16, jnp.float8_e4m3fn, jnp.float8_e5m2, np.int8, np.uint32, np.bool_]


def test_every_dtype_restores_as_the_target_has_it(tmp_path: Path) -> None:
    state = {np.dtype(d).name: put((np.arange(6) % 3).astype(d).reshape(2, 3)) for d in DTYPES}
    trainstate.save(tmp_path / "c", state)
    target = {name: put(np.zeros(value.shape, value.dtype)) for name, value in state.items()}
    restored = trainstate.load(tmp_path / "c", target)
    assert_same_leaves(restored, state)


def test_a_dtype_mismatch_is_refused_unless_strict_is_off_then_cast(tmp_path: Path) -> None:
    values = np.linspace(0, 1, 5, dtype=np.float32)
    trainstate.save(tmp_path / "c", {"a": put(values), "n": put(np.arange(3, dtype=np.int32))})
    target = {"a": put(np.zeros(5, jnp.bfloat16)), "n": put(np.zeros(3, np.float32))}
    with pytest.raises(trainstate.StateMismatchError) as e:
        trainstate.load(tmp_path / "c", target)
    assert sorted(e.value.mismatched) == [
        ("a", "tensor BF16[5]", "tensor F32[5]"),
        ("n", "tensor F32[3]", "tensor I32[3]"),
    ]
    restored = trainstate.load(tmp_path / "c", target, strict=False)
    assert restored["a"].dtype == jnp.bfloat16 and restored["n"].dtype == jnp.float32
    assert host(restored["a"]).tobytes() == values.astype(jnp.bfloat16).tobytes()
    np.testing.assert_array_equal(restored["n"], [0.0, 1.0, 2.0])


@pytest.mark.parametrize(
    ("change", "missing", "unexpected"),
    [
        (lambda t: t["params"]["dense"].pop("bias"), [], ["params.dense.bias"]),
        (lambda t: t["params"].update(extra={"w": put(np.zeros(2))}), ["params.extra"], []),
    ],
    ids=["unexpected", "missing"],
)
def test_a_key_on_one_side_only_is_named_before_anything_changes(
    tmp_path: Path, change: Any, missing: list[str], unexpected: list[str]
) -> None:
    trainstate.save(tmp_path / "c", {"params": {"dense": {"kernel": put(np.ones((3, 2))), "bias": put(np.ones(2))}}})
    target = {"params": {"dense": {"kernel": put(np.zeros((3, 2))), "bias": put(np.zeros(2))}}}
    change(target)
    kernel = target["params"]["dense"]["kernel"]
    with pytest.raises(trainstate.StateMismatchError) as e:
        trainstate.load(tmp_path / "c", target)
    assert e.value.missing == missing and e.value.unexpected == unexpected
    assert target["params"]["dense"]["kernel"] is kernel  # the target's containers were left alone


def test_a_deleted_array_is_refused_with_its_path(tmp_path: Path) -> None:
    """An array donated to a jitted step is gone: saving it says which one, and what to save instead."""
    step = jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)
    params = {"dense": {"kernel": put(np.ones((2, 2), np.float32))}}
    new = step(params)
    assert params["dense"]["kernel"].is_deleted()
    with pytest.raises(trainstate.UnsupportedValueError, match=r"^params\.dense\.kernel: .*deleted") as e:
        trainstate.save(tmp_path / "c", {"params": params})
    assert "use the arrays the step returned" in str(e.value)
    assert not (tmp_path / "c").exists()
    trainstate.save(tmp_path / "c", {"params": new})
    np.testing.assert_array_equal(trainstate.load(tmp_path / "c")["params"]["dense"]["kernel"], np.full((2, 2), 2.0))
