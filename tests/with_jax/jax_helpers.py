"""What the JAX tests share: arrays made without compiling, comparisons, and a small Flax NNX training run
whose jitted step compiles once for every test file (the compilation cache is the process's)."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# Every jitted function and every eager JAX op of a new shape is an XLA compilation (a few tenths of a second
# each on a CPU): arrays are made in NumPy and put on a device, the training steps are jitted once and shared.


def put(array: Any) -> Any:
    """A JAX array holding a NumPy array's values (no compilation)."""
    return jax.device_put(np.asarray(array))


def filled(tree: Any, start: int) -> Any:
    """``tree`` with every array leaf replaced by distinct values of its dtype and shape, starting at ``start``."""
    leaves, treedef = jax.tree.flatten(tree)
    new = [
        put((np.arange(leaf.size) + start + 10 * i).reshape(leaf.shape).astype(leaf.dtype))
        for i, leaf in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, new)


def host(value: Any) -> np.ndarray:
    """An array's values on the host; a typed key's as its key data."""
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    return np.asarray(value)


def assert_same_leaves(a: Any, b: Any) -> None:
    """Same pytree structure, and every leaf the same dtype, shape and bytes."""
    (la, ta), (lb, tb) = jax.tree.flatten(a), jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert host(x).tobytes() == host(y).tobytes()


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.uniform(1.0)
        self.l1 = nnx.Linear(3, 4, kernel_init=init, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)  # batch statistics: state that is not a parameter
        self.drop = nnx.Dropout(0.5, rngs=rngs)  # draws from its own key: restored, the next mask is the same
        self.l2 = nnx.Linear(4, 2, kernel_init=init, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


@nnx.jit
def nnx_run(key: Any) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(nnx.Rngs(key))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


@partial(jax.jit, static_argnums=0)
def _nnx_step(graphdef: Any, state: Any, x: Any, y: Any) -> tuple[Any, Any]:
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss, nnx.state((model, optimizer))


def nnx_step(model: MLP, optimizer: nnx.Optimizer, x: Any, y: Any) -> Any:
    """One training step (NNX's functional API: one compilation serves every model of this structure)."""
    graphdef, state = nnx.split((model, optimizer))
    loss, state = _nnx_step(graphdef, state, x, y)
    nnx.update((model, optimizer), state)
    return loss


BATCH = (
    put(np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)),
    put(np.linspace(0, 1, 10, dtype=np.float32).reshape(5, 2)),
)


def raw_key(seed: int) -> Any:
    """``jax.random.PRNGKey(seed)`` for a small seed, made without a compilation."""
    return put(np.array([0, seed], dtype=np.uint32))
