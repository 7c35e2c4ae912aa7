"""JAX arrays: ``jax.Array`` on any device and sharding, typed PRNG keys (``jax.random.key``) included.

A JAX array is stored as the array it is, with the manifest kind ``"numpy"`` (format 1.x has no kind for it,
docs/format.md §4): a checkpoint written from JAX reads into NumPy, torch and JAX alike, and a JAX reader
returns JAX arrays when the target holds them or ``framework="jax"`` asks. A typed key is stored as its key
data (``jax.random.key_data``: uint32, one more dimension); restored into a typed key it is wrapped with the
target's implementation.

Arrays are immutable, so reads land in a fresh host array and :func:`assign` makes the new array from it,
placed on the *target's* sharding -- whatever sharding saved it: each device gets its own slice of the host
array (``jax.make_array_from_callback``) -- and committed to it only when the target was. Saving reads each
array through ``np.asarray``, which assembles a sharded array from its shards, one replica of each; one
process writes them all, so an array spread over several processes (``jax.distributed``, not fully
addressable) is refused with a clear error.

The pytrees that hold arrays (Flax, Optax) and Flax NNX objects are ``jax_tree.py``'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainstate._format import dtypes
from trainstate._frameworks import numpy as numpy_adapter
from trainstate._frameworks.jax_tree import NnxObject
from trainstate._optional import optional
from trainstate.errors import UnsupportedValueError

with optional("jax", extra="jax", needed_for="JAX arrays (framework='jax')"):
    import jax
    import jax.numpy as jnp

KIND = numpy_adapter.KIND  # see the module's docstring


def is_array(value: Any) -> bool:
    """A ``jax.Array``, or a ``jax.ShapeDtypeStruct``: an abstract array (``jax.eval_shape``,
    ``nnx.eval_shape``) that a restore fills with a new array of its shape, dtype and sharding."""
    return isinstance(value, (jax.Array, jax.ShapeDtypeStruct))


def has_values(value: Any) -> bool:
    return not isinstance(value, jax.ShapeDtypeStruct)


def is_key(value: Any) -> bool:
    """Whether ``value`` is a typed PRNG key array (``jax.random.key``), stored as its key data."""
    return bool(jnp.issubdtype(value.dtype, jax.dtypes.prng_key))


def _host(value: Any) -> np.ndarray:
    """The array's values in host memory (its key data for a typed key): assembled from its shards."""
    if value.is_deleted():
        raise UnsupportedValueError(
            "this jax.Array was deleted (donated to a jitted function, or deleted by hand): use the arrays the "
            "step returned, not the ones it consumed"
        )
    if not value.is_fully_addressable:
        raise UnsupportedValueError(
            f"a jax.Array spread over {jax.process_count()} processes (sharding {value.sharding}) cannot be saved "
            "by one process; save it from one process after gathering it (jax.experimental.multihost_utils."
            "process_allgather), or shard it over this process's devices only"
        )
    return np.asarray(jax.random.key_data(value) if is_key(value) else value)


def describe(value: Any) -> tuple[str, tuple[int, ...], str]:
    """(dtype code, shape, kind); refuses a traced value, a deleted or multi-process array, and an abstract
    one JAX could not make (see :func:`_check_makeable`)."""
    if isinstance(value, jax.core.Tracer):
        raise UnsupportedValueError(
            "a traced value (inside jax.jit, grad or vmap) has no values yet: save and load outside the "
            "transformed function"
        )
    if has_values(value) and (value.is_deleted() or not value.is_fully_addressable):
        _host(value)  # raises the error that says why
    data = jax.eval_shape(jax.random.key_data, value) if is_key(value) else value
    if not has_values(value):
        _check_makeable(value)
    return dtypes.from_numpy(np.dtype(data.dtype)).code, tuple(data.shape), KIND


def _check_makeable(target: Any) -> None:
    """Refuse, before anything is read, an abstract target whose array JAX would not make as asked."""
    if target.sharding is not None:
        sharding = _concrete(target.sharding)
        try:
            sharding.shard_shape(tuple(target.shape))
        except ValueError as e:
            raise UnsupportedValueError(f"its sharding does not fit its shape {list(target.shape)}: {e}") from None


def _narrowed(array: np.ndarray) -> np.ndarray:
    """``array`` in the dtype JAX will make of it. With ``jax_enable_x64`` off JAX makes 64-bit values 32-bit:
    that cast is done here when it loses nothing (integers in range, floats that round-trip exactly), and
    refused otherwise, since JAX would cut them in silence."""
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(array.dtype))
    if dtype == array.dtype:
        return array
    narrow = array.astype(dtype)
    same = np.array_equal(narrow, array, equal_nan=dtype.kind in "fc")
    if not same:
        raise UnsupportedValueError(
            f"its {array.dtype} values do not fit {dtype}, and JAX makes {array.dtype} arrays only in 64-bit mode: "
            "turn it on (jax.config.update('jax_enable_x64', True)), load as NumPy (framework='numpy'), or restore "
            f"into a {dtype} target with strict=False to cast"
        )
    return narrow


def _concrete(sharding: Any) -> Any:
    """``sharding`` on a concrete mesh: one on an abstract mesh (``jax.eval_shape`` under ``jax.set_mesh``)
    is put on the mesh set where the restore runs."""
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.AbstractMesh):
        return sharding
    current = jax.sharding.get_mesh()
    if not isinstance(current, jax.sharding.Mesh) or current.empty or current.abstract_mesh != mesh:
        raise UnsupportedValueError(
            f"its sharding is on an abstract mesh ({mesh}), and no concrete mesh of that shape is set: restore "
            "inside `with jax.set_mesh(mesh):`, or give the target a NamedSharding on a concrete mesh"
        )
    return jax.sharding.NamedSharding(current, sharding.spec)


def identity(value: Any) -> tuple[object, ...] | None:
    return None  # immutable: two places holding one array are two tensors, each restored on its own


def local_part(value: Any) -> tuple[Any, tuple[int, ...]] | None:
    return None  # one process holds every shard it saves (see _host)


def byte_view(value: Any) -> memoryview:
    return numpy_adapter.byte_view(_host(value))


def empty(code: str, shape: tuple[int, ...]) -> np.ndarray:
    return numpy_adapter.empty(code, shape)


def writable_view(target: Any) -> memoryview | None:
    return None  # immutable: read into a host array, then assign() makes the new array


def on_accelerator(value: Any) -> bool:
    return False  # reads go through a host array whatever the device (writable_view is None)


def staging(nbytes: int, like: Any) -> np.ndarray:
    return numpy_adapter.staging(nbytes, like)


def copy_in(pairs: list[tuple[Any, np.ndarray]]) -> None:
    numpy_adapter.copy_in(pairs)


def finish(array: np.ndarray, kind: str) -> Any:
    """A freshly read host array as a JAX array on the default device."""
    return jax.device_put(_narrowed(array))


def assign(target: Any, source: np.ndarray) -> Any:
    """A new array holding ``source`` with ``target``'s dtype, sharding (devices) and key implementation.

    Committed to that sharding only when ``target`` was: an uncommitted array (made without naming a device)
    is one JAX may still move, and committing it would make each jitted function compile again and refuse
    it beside arrays on other devices. An abstract target (``jax.ShapeDtypeStruct``) is committed to its
    sharding when it names one, else the new array goes to the default device.
    """
    host = np.asarray(source)
    impl = _key_impl(target) if is_key(target) else None
    if impl is None and host.dtype != np.dtype(target.dtype):  # strict=False: cast, as for every framework
        host = host.astype(target.dtype)
    if impl is None:
        host = _narrowed(host)  # an abstract 64-bit target without x64
    sharding = target.sharding if has_values(target) or target.sharding is None else _concrete(target.sharding)
    if sharding is None or not getattr(target, "committed", True):  # on one device: the default one, or its own
        with jax.default_device(None if sharding is None else next(iter(sharding.device_set))):
            value = jax.device_put(host)
            return value if impl is None else jax.random.wrap_key_data(value, impl=impl)
    if impl is not None:
        return jax.device_put(jax.random.wrap_key_data(jnp.asarray(host), impl=impl), sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _key_impl(target: Any) -> Any:
    """The PRNG implementation of a typed key array, or of an abstract one (its key dtype holds it: JAX's
    ``key_impl`` takes only arrays)."""
    if isinstance(target, jax.ShapeDtypeStruct):
        impl = getattr(target.dtype, "_impl", None)
        if impl is None:
            raise UnsupportedValueError(f"cannot tell the PRNG implementation of {target}: restore into a key array")
        return impl
    return jax.random.key_impl(target)


def from_numpy(array: np.ndarray) -> Any:
    return jax.device_put(_narrowed(array))


def load_takes_strict(obj: Any) -> bool:
    return isinstance(obj, NnxObject)  # a Flax NNX module's own variables are the truth, as nn.Module's


def rebuilt_from_checkpoint(obj: Any) -> bool:
    return False


def after_restore(restored: Any) -> None:
    return None
