"""JAX arrays: ``jax.Array`` on any device and sharding, typed PRNG keys (``jax.random.key``) included.

A JAX array is stored as the array it is, with the manifest kind ``"numpy"`` (format 1.x has no kind for it,
docs/format.md §4): a checkpoint written from JAX reads into NumPy, torch and JAX alike, and a JAX reader
returns JAX arrays when the target holds them or ``framework="jax"`` asks. A typed key is stored as its key
data (``jax.random.key_data``: uint32, one more dimension); restored into a typed key it is wrapped with the
target's implementation.

Arrays are immutable, so reads land in a fresh host array and :func:`assign` makes the new array from it,
placed on the *target's* sharding -- whatever sharding saved it: each device gets its own slice of the host
array (``jax.make_array_from_callback``) -- and committed to it only when the target was. Saving copies each
distinct shard (one replica of each) into its place in the host bytes.

On accelerators both directions go through reused host buffers. An async save's staging (:func:`copy_out`)
starts every device-to-host transfer before it waits for the first, and all have landed when save()
returns, so a step that donates the arrays cannot reach the copy. A restore reads through the ring of
``_restore/ring.py`` (:func:`on_accelerator`, :func:`copy_in_async`): each round's arrays are made on the
target's sharding while the next round is read, and host memory stays at the ring's size.

An array spread over several processes (``jax.distributed``: not fully addressable) is saved by all of them
together (``_distributed/save.py``, agreeing through ``_distributed/jax_group.py``): each process stores the
:class:`Region` its devices hold, and restores only its region of the target.

The pytrees that hold arrays (Flax, Optax) and Flax NNX objects are ``jax_tree.py``'s.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from trainstate._format import dtypes
from trainstate._frameworks import numpy as numpy_adapter
from trainstate._frameworks.jax_tree import NnxObject
from trainstate._frameworks.protocol import RefusedPair
from trainstate._optional import optional
from trainstate.errors import UnsupportedValueError

with optional("jax", extra="jax", needed_for="JAX arrays (framework='jax')"):
    import jax
    import jax.numpy as jnp

KIND = numpy_adapter.KIND  # see the module's docstring
HOST_PLATFORMS = frozenset({"cpu"})  # devices whose arrays are host memory already (tests may empty it)
AHEAD = 512 << 20  # bytes of device-to-host transfers started ahead of the copy into place (see _land)


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
    _check_alive(value)
    return np.asarray(jax.random.key_data(value) if is_key(value) else value)


def _check_alive(value: Any) -> None:
    if value.is_deleted():
        raise UnsupportedValueError(
            "this jax.Array was deleted (donated to a jitted function, or deleted by hand): use the arrays the "
            "step returned, not the ones it consumed"
        )


def describe(value: Any) -> tuple[str, tuple[int, ...], str]:
    """(dtype code, shape, kind); refuses a traced value, a deleted array, and an abstract one JAX could not
    make (see :func:`_check_makeable`)."""
    if isinstance(value, jax.core.Tracer):
        raise UnsupportedValueError(
            "a traced value (inside jax.jit, grad or vmap) has no values yet: save and load outside the "
            "transformed function"
        )
    if has_values(value):
        _check_alive(value)
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


class Region(NamedTuple):
    """The box of an array spread over several processes (``jax.distributed``) that this process addresses:
    the smallest box holding its devices' shards. Saving writes that box (:func:`byte_view` assembles it
    from the shards, one replica each); restoring reads it and builds the new global array from it
    (:func:`assign`), each device taking its slice."""

    array: Any  # the jax.Array, or the abstract target (jax.ShapeDtypeStruct)
    offset: tuple[int, ...]
    shape: tuple[int, ...]


def local_part(value: Any) -> tuple[Region, tuple[int, ...]] | None:
    """The :class:`Region` this process addresses of an array no process holds whole; None for the rest
    (one process saves and restores those whole, see :func:`_host`)."""
    sharding = value.sharding
    if sharding is None:
        return None
    if not has_values(value):
        sharding = _concrete(sharding)
    if sharding.is_fully_addressable:
        return None
    shape = tuple(value.shape)
    boxes = {
        tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        for index in sharding.addressable_devices_indices_map(shape).values()
    }
    trailing = tuple(jax.eval_shape(jax.random.key_data, value).shape[len(shape) :]) if is_key(value) else ()
    if not boxes or not shape:  # a scalar, or none of its devices here
        lo, hi = (0,) * len(shape), (tuple(shape) if boxes else (0,) * len(shape))
    else:
        lo = tuple(min(b[d][0] for b in boxes) for d in range(len(shape)))
        hi = tuple(max(b[d][1] for b in boxes) for d in range(len(shape)))
        if has_values(value) and sum(math.prod(e - b for b, e in box) for box in boxes) != math.prod(
            e - b for b, e in zip(lo, hi)
        ):
            raise UnsupportedValueError(
                f"this process's devices hold parts of it that do not form one box (sharding {sharding}), "
                "which a save cannot store as this process's part: lay the mesh out so each process's devices "
                "are neighbours (jax.make_mesh does)"
            )
    offset = lo + (0,) * len(trailing)
    return Region(value, offset, tuple(e - b for b, e in zip(lo, hi)) + trailing), offset


def byte_view(value: Any) -> memoryview:
    if isinstance(value, Region):
        return numpy_adapter.byte_view(_assembled(value))
    return numpy_adapter.byte_view(_host(value))


def _assembled(region: Region) -> np.ndarray:
    """The values of ``region`` from this process's shards, one replica of each."""
    dtype = np.dtype(_data(region.array).dtype)
    host = np.empty(math.prod(region.shape) * dtype.itemsize, dtype=np.uint8)
    _land(list(_landings(region, host)), bounded=on_accelerator(region))
    out: np.ndarray = host.view(dtype).reshape(region.shape)
    return out


def _data(value: Any) -> Any:
    """What is stored of an array: its key data for a typed key, else the array itself."""
    return jax.random.key_data(value) if is_key(value) else value


def _landings(value: Any, host: np.ndarray) -> Iterator[tuple[Any, np.ndarray]]:
    """(single-device array, the view of ``host`` it lands in) for each distinct shard of ``value`` (an array,
    or this process's :class:`Region` of one) that this process holds: one replica of each, each into its own
    place in ``host`` (the value's flat bytes), so nothing is assembled in between."""
    array = value.array if isinstance(value, Region) else value
    _check_alive(array)
    data = _data(array)
    offset = value.offset if isinstance(value, Region) else (0,) * data.ndim
    shape = value.shape if isinstance(value, Region) else tuple(data.shape)
    out = host.view(np.dtype(data.dtype)).reshape(shape)
    done = set()
    for shard in data.addressable_shards:
        box = tuple(s.indices(n)[:2] for s, n in zip(shard.index, data.shape))
        if box in done:
            continue
        done.add(box)
        yield shard.data, out[tuple(slice(b - o, e - o) for (b, e), o in zip(box, offset))] if box else out


def _land(landings: list[tuple[Any, np.ndarray]], *, bounded: bool = True) -> None:
    """Copy each device array into its host view, the device-to-host transfers started ahead of the copies.

    ``copy_to_host_async`` starts a transfer into JAX's own host copy of the array (no JAX API takes a
    destination buffer), so transfers run together while earlier ones are copied into place. ``bounded``
    (arrays on accelerators): at most :data:`AHEAD` bytes are started and not yet copied *in this process*,
    across every ``_land`` running at once (the staging lanes of a save), see :class:`_Ahead`. JAX keeps that
    host copy as long as the array object it was made for: a shard of a multi-device array is a new object,
    dropped once landed; a single-device array is its own shard, so its host copy lives until the loop drops
    the array (as after ``np.asarray``). On the CPU the transfers are no-ops and ``np.asarray`` is a view.
    """
    if not bounded:
        for source, dst in landings:
            np.copyto(dst, np.asarray(source))
        return
    pending, started = deque(landings), deque[tuple[Any, np.ndarray]]()
    mine = 0  # bytes this call started and has not copied into place
    try:
        while pending or started:
            while pending and _AHEAD.start(pending[0][1].nbytes, alone=not started):
                source, dst = pending.popleft()
                mine += dst.nbytes
                source.copy_to_host_async()
                started.append((source, dst))
            if started:
                source, dst = started.popleft()
                np.copyto(dst, np.asarray(source))
                mine -= dst.nbytes
                _AHEAD.landed(dst.nbytes)
    finally:
        if mine:
            _AHEAD.landed(mine)  # a failed transfer or copy: what it still held is given back


class _Ahead:
    """The bytes of device-to-host transfers started and not yet copied into place, in this process.

    One count for every :func:`_land` at once, so the staging lanes of a save start at most :data:`AHEAD`
    bytes together, not each. A call that has transfers of its own in flight never waits here: it copies its
    oldest into place instead (which gives bytes back); only a call with none in flight waits, holding
    nothing, for the others to give bytes back. So no call waits on one that waits. A transfer larger than
    the bound starts once nothing else is in flight.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._bytes = 0

    def start(self, nbytes: int, *, alone: bool) -> bool:
        """Count ``nbytes`` in and say True if they fit; ``alone`` (the caller has none in flight): wait until
        they fit. False: the caller should copy one of its own into place first."""
        with self._changed:
            while self._bytes and self._bytes + nbytes > AHEAD:
                if not alone:
                    return False
                self._changed.wait()
            self._bytes += nbytes
            return True

    def landed(self, nbytes: int) -> None:
        with self._changed:
            self._bytes -= nbytes
            self._changed.notify_all()


_AHEAD = _Ahead()  # a fork's child starts with nothing in flight: see _fork_reset


def _fork_reset() -> None:
    global _AHEAD
    _AHEAD = _Ahead()  # the parent's count (and a lock a parent thread may have held) are not the child's


os.register_at_fork(after_in_child=_fork_reset)


def empty(code: str, shape: tuple[int, ...]) -> np.ndarray:
    return numpy_adapter.empty(code, shape)


def writable_view(target: Any) -> memoryview | None:
    return None  # immutable: read into a host array, then assign() makes the new array


def on_accelerator(value: Any) -> bool:
    """An array, an abstract one (``jax.ShapeDtypeStruct``) or a :class:`Region` whose sharding is on
    accelerators only (no device of :data:`HOST_PLATFORMS`): a save stages it with its transfers started
    together (:func:`copy_out`), a restore makes it anew from bytes read through the ring of reused host
    buffers (``_restore/ring.py``) instead of one fresh host array per array. An abstract target without a
    sharding goes to the default device, which this does not guess: it takes the host path."""
    devices = _devices(value)
    return bool(devices) and all(getattr(d, "platform", "cpu") not in HOST_PLATFORMS for d in devices)


def _devices(value: Any) -> set[Any]:
    array = value.array if isinstance(value, Region) else value
    try:
        if isinstance(array, jax.ShapeDtypeStruct):
            return set() if array.sharding is None else set(_concrete(array.sharding).device_set)
        return set(array.sharding.device_set) if isinstance(array, jax.Array) else set()
    except (AttributeError, RuntimeError, UnsupportedValueError):  # a deleted (donated) array; no concrete mesh
        return set()


def staging(nbytes: int, like: Any) -> np.ndarray:
    """Ordinary (pageable) host memory, reused save after save and round after round.

    Not page-locked: JAX has no public way to pin memory it did not allocate, nor to transfer into a buffer
    the caller gives. Its pinned memory is a memory kind (``jax.device_put(x,
    sharding.with_memory_kind("pinned_host"))``): a new JAX array each time, not a reused buffer, which NumPy
    reads only through one more copy -- and CPU-only JAX has no such memory kind at all. So transfers go
    through JAX's own host copies (:func:`_land`) and :func:`assign`, and land here with one host copy.
    """
    return numpy_adapter.staging(nbytes, like)


def cuttable(value: Any) -> bool:
    return False  # immutable: a new array is made from the whole of its bytes


def copy_in_async(pairs: list[tuple[Any, int | None, np.ndarray]]) -> Callable[[], list[Any]]:
    """New arrays with each target's dtype and sharding, from host bytes (``assign``; a typed key's bytes are
    its key data, a :class:`Region`'s this process's box); the transfers run while the caller goes on, and
    the wait blocks until they are ready (then ``host`` may be reused)."""
    made = []
    for i, (target, _, host) in enumerate(pairs):
        data = target.array if isinstance(target, Region) else target
        aval = jax.eval_shape(jax.random.key_data, data) if is_key(data) else data
        values = host.view(np.dtype(aval.dtype)).reshape(target.shape if isinstance(target, Region) else aval.shape)
        devices = _devices(target)
        if not devices or any(getattr(d, "platform", "cpu") == "cpu" for d in devices):
            values = values.copy()  # on the host CPU device_put may share the buffer's memory, which is reused
        try:
            made.append(assign(target, values))
        except UnsupportedValueError as e:  # 64-bit values that do not fit: the caller names the tensor
            for array in made:
                array.block_until_ready()  # no transfer may still read the host bytes once this raises
            raise RefusedPair(str(e), i) from None

    def wait() -> list[Any]:
        for array in made:
            array.block_until_ready()
        return made

    return wait


def copy_out(pairs: list[tuple[Any, np.ndarray]]) -> None:
    """Every array's bytes into its host slice (async staging): every device-to-host transfer is started
    before the first is waited for (:func:`_land`), and all have landed when this returns, so a step that
    then donates the arrays cannot touch the copy."""
    by_place: dict[bool, list[tuple[Any, np.ndarray]]] = {}
    for value, host in pairs:
        by_place.setdefault(on_accelerator(value), []).extend(_landings(value, host.reshape(-1)))
    for bounded, landings in by_place.items():  # on the host: views already, nothing started ahead
        _land(landings, bounded=bounded)


def copy_range_out(value: Any, offset: int, host: np.ndarray) -> None:
    np.copyto(host, np.frombuffer(byte_view(value), np.uint8)[offset : offset + host.nbytes])  # via the host


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
    if isinstance(target, Region):
        return _from_region(target, source)
    host, impl = _host_for(target, source)
    sharding = target.sharding if has_values(target) or target.sharding is None else _concrete(target.sharding)
    if sharding is None or not getattr(target, "committed", True):  # on one device: the default one, or its own
        with jax.default_device(None if sharding is None else next(iter(sharding.device_set))):
            value = jax.device_put(host)
            return value if impl is None else jax.random.wrap_key_data(value, impl=impl)
    if impl is not None:
        return jax.device_put(jax.random.wrap_key_data(jnp.asarray(host), impl=impl), sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _host_for(target: Any, source: np.ndarray) -> tuple[np.ndarray, Any]:
    """``source`` in the dtype the new array gets, and the target's key implementation (None: not a key)."""
    host = np.asarray(source)
    impl = _key_impl(target) if is_key(target) else None
    if impl is None and host.dtype != np.dtype(target.dtype):  # strict=False: cast, as for every framework
        host = host.astype(target.dtype)
    if impl is None:
        host = _narrowed(host)  # an abstract 64-bit target without x64
    return host, impl


def _from_region(region: Region, source: np.ndarray) -> Any:
    """The new global array of ``region.array``'s sharding, from the box this process read (``source``): each
    of its devices takes its slice; the other processes build theirs alike."""
    target = region.array
    host, impl = _host_for(target, source)
    sharding = target.sharding if has_values(target) else _concrete(target.sharding)
    shape = tuple(target.shape) + tuple(host.shape[len(target.shape) :])

    def piece(index: tuple[slice, ...] | None) -> np.ndarray:
        assert index is not None  # JAX passes None only for a sharding with no index: not one over processes
        return host[tuple(slice(*(i - o for i in s.indices(n)[:2])) for s, n, o in zip(index, shape, region.offset))]

    if impl is None:
        return jax.make_array_from_callback(shape, sharding, piece)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise UnsupportedValueError(
            f"a key array spread over several processes is restored onto a NamedSharding, not {type(sharding).__name__}"
        )
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    data_sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))  # type: ignore[no-untyped-call]
    return jax.random.wrap_key_data(jax.make_array_from_callback(shape, data_sharding, piece), impl=impl)


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
