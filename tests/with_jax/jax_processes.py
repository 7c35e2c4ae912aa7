"""One process of a multi-process JAX job (``jax.distributed`` on CPU devices), for test_jax_processes.py.

    python jax_processes.py SCENARIO PROCESS PROCESSES DEVICES PORT DIR

Each process prints one line, ``RESULT <json>``: what it saw. The values every scenario saves and checks
are made in NumPy (:func:`expected`), so any process count can check any process count's checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

if __name__ == "__main__":  # before JAX is imported: this process's CPU devices
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[4]}"
    os.environ.setdefault("TRAINSTATE_DIST_TIMEOUT", "60")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import trainstate  # noqa: E402


def expected(step: int = 0) -> dict[str, np.ndarray]:
    """The values of the state after ``step`` training steps (each adds 1 to w and m)."""
    m = (np.arange(48, dtype=np.float32).reshape(8, 6) / 7).astype(ml_dtypes.bfloat16)
    for _ in range(step):  # rounded to bfloat16 after each step, as the jitted step does
        m = (m.astype(np.float32) + 1).astype(ml_dtypes.bfloat16)
    return {
        "w": np.arange(48, dtype=np.float32).reshape(8, 6) + step,
        "b": np.arange(8, dtype=np.float32) * 0.5,
        "m": m,
        "step": np.array(step, dtype=np.int32),
        "key": np.array([0, 3], dtype=np.uint32),  # jax.random.key(3)'s key data
    }


def state_on(mesh: Any, w_spec: Any, step: int = 0) -> dict[str, Any]:
    """The state, each array made global over ``mesh`` from its NumPy values; ``w_spec`` shards w and m."""
    want = expected(step)

    def put(name: str, spec: Any) -> Any:
        return jax.make_array_from_callback(want[name].shape, NamedSharding(mesh, spec), lambda i: want[name][i])

    everywhere = NamedSharding(mesh, P())
    return {
        "params": {"w": put("w", w_spec), "b": put("b", P("y") if "y" in mesh.axis_names else P())},
        "opt": {"m": put("m", w_spec)},
        "step": put("step", P()),
        "key": jax.jit(lambda: jax.random.key(3), out_shardings=everywhere)(),
        "note": "hi",
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    """A restore target: ``state``'s structure and shardings with other values (keys: another key)."""

    def other(a: Any) -> Any:
        if not isinstance(a, jax.Array):
            return a
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.jit(lambda: jax.random.key(99), out_shardings=a.sharding)()
        return jax.jit(jnp.zeros_like, out_shardings=a.sharding)(a)

    return jax.tree.map(other, state)


def check(state: dict[str, Any], step: int = 0) -> list[str]:
    """What differs between ``state``'s shards on this process and :func:`expected`: an empty list if nothing."""
    want = expected(step)
    found = {"w": state["params"]["w"], "b": state["params"]["b"], "m": state["opt"]["m"], "step": state["step"]}
    found["key"] = jax.random.key_data(state["key"])
    bad = []
    for name, array in found.items():
        for shard in array.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), want[name][shard.index]):
                bad.append(f"{name}{shard.index}")
    return bad


def error_of(call: Any) -> str:
    try:
        call()
    except trainstate.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


KEY = "5a" * 32  # the key of the encrypted save


def save(directory: str, process: int) -> dict[str, Any]:
    """Save on a 4x2 mesh over every process; refusals; a manager run; restore onto another sharding; then
    :func:`load`."""
    out: dict[str, Any] = {}
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    state = state_on(mesh, P("x", "y"))
    out["fully_addressable"] = state["params"]["w"].is_fully_addressable
    out["saved"] = trainstate.save(f"{directory}/one", state).path
    big = np.tile(np.arange(64, dtype=np.float32), (512, 1))  # compressible: zstd pays on every shard
    zstd = {**state, "big": jax.make_array_from_callback(big.shape, NamedSharding(mesh, P("x", "y")), lambda i: big[i])}
    out["zstd"] = trainstate.save(f"{directory}/zstd", zstd, compression="zstd").path  # each process its own
    sealed = trainstate.save(f"{directory}/sealed", zstd, compression="zstd", key=KEY)  # each encrypts its own
    out["sealed"] = sealed.path
    # an incremental run: each process shares its own shards of the frozen "big" through the run's pool
    with trainstate.CheckpointManager(f"{directory}/inc", keep_last=2, incremental=True, compression="zstd") as mgr:
        for step in range(3):
            moving = np.full((64, 8), float(step), np.float32)
            part = {
                "big": zstd["big"],
                "moving": jax.make_array_from_callback(
                    moving.shape, NamedSharding(mesh, P("x", "y")), lambda i, m=moving: m[i]
                ),
            }
            mgr.save(step, part)
        out["inc_written"] = {r.step: r.nbytes for r in mgr.history()}
    # the global sample stream: each process takes its micro-batches; the position saved is the job's
    batches = trainstate.GlobalBatches(60, global_batch_size=12, seed=4, rank=process, world_size=2, micro_batches=2)
    taken = []
    for part in batches:
        taken.append(part.tolist())
        if len(taken) == 6:  # three global batches
            break
    trainstate.save(f"{directory}/stream", {"data": batches, "step": 3})
    out["stream_taken"] = taken
    out["solo"] = error_of(lambda: trainstate.save(f"{directory}/solo{process}", state, collective=False))
    for i in range(8):  # many saves, each exchanging through the store
        trainstate.save(f"{directory}/many/{i}", {"step": state["step"]})
    devices = jax.devices()  # by process: interleave them, so no process's devices are neighbours in the mesh
    apart = jax.sharding.Mesh(np.array([devices[i // 2 + (i % 2) * (len(devices) // 2)] for i in range(8)]), ("x",))
    out["interleaved"] = error_of(lambda: trainstate.save(f"{directory}/apart", state_on(apart, P("x"))))

    step_once = jax.jit(lambda w, m: (w + 1, m + 1))
    out["paths"] = error_of(lambda: trainstate.save(f"{directory}/path{process}", {"a": np.zeros(3)}))
    with trainstate.CheckpointManager(f"{directory}/run", keep_last=2, async_save=True) as mgr:
        assert mgr.restore_latest(state) is None  # nothing yet; gets the async staging ready for this state
        for step in range(1, 4):
            state["params"]["w"], state["opt"]["m"] = step_once(state["params"]["w"], state["opt"]["m"])
            state["step"] = jax.jit(lambda s: s + 1)(state["step"])
            mgr.save(step, state, metrics={"loss": 1.0 / step})
    one_row = jax.make_mesh((8, 1), ("x", "y"))  # a different sharding over the same processes
    target = zeros_like(state_on(one_row, P("x", None)))
    with trainstate.CheckpointManager(f"{directory}/run") as mgr:
        out["restored_step"] = mgr.restore_latest(target)
        out["kept"] = [c.step for c in mgr.list()]
    out["restored_bad"] = check(target, step=3)
    out["restored_sharding"] = str(target["params"]["w"].sharding.spec)
    out.update(load(directory, process))
    if process == 0:  # what the coordination stayed at in the JAX runtime's store, against what it exchanged
        from jax._src.distributed import global_state

        from trainstate._distributed import jax_group

        out["store_keys"] = sorted(k for k, _ in global_state.client.key_value_dir_get_bytes("trainstate/"))
        out["exchanges"] = sum(jax_group._counters.values())
    if process == 0:  # the others never come to this save: it times out, and nothing is committed
        out["alone"] = error_of(lambda: trainstate.save(f"{directory}/alone", {"a": np.zeros(3)}, timeout=3))
    else:  # comes late, once process 0 gave up: must not pair its call with another call of process 0's
        from jax._src.distributed import global_state

        global_state.client.blocking_key_value_get_bytes("trainstate/save/abandoned", 60_000)
        out["late"] = error_of(lambda: trainstate.save(f"{directory}/late", {"a": np.zeros(3)}))
    return out


def parts_read(call: Any, *args: Any) -> tuple[Any, dict[str, Any]]:
    """``call(*args)``'s result, and the part of each tensor it read: [offset, shape] (None: the whole tensor);
    "ring" lists those read through the restore ring."""
    from trainstate._restore import read

    seen: dict[str, Any] = {"ring": []}
    views, to_device = read.read_views, read.read_to_device

    def box_of(box: Any) -> Any:
        return None if box is None else [list(box[0]), list(box[1])]

    def spy_views(ck: Any, reads: Any, **kwargs: Any) -> None:
        seen.update({name: box_of(box) for name, _, box in reads})
        views(ck, reads, **kwargs)

    def spy_ring(ck: Any, staged: Any, *args: Any, **kwargs: Any) -> int:
        seen.update({s.name: box_of(s.box) for s in staged})
        seen["ring"] += sorted(s.name for s in staged)
        return to_device(ck, staged, *args, **kwargs)

    read.read_views, read.read_to_device = spy_views, spy_ring
    try:
        return call(*args), seen
    finally:
        read.read_views, read.read_to_device = views, to_device


def load(directory: str, process: int) -> dict[str, Any]:
    """Restore checkpoints saved by another process count onto this job's mesh, in place and abstract; the
    parts of "one" each process read; and an abstract restore through the restore ring, the CPU devices
    counting as accelerators (the path a GPU's arrays take)."""
    from trainstate._frameworks import jax as jax_adapter

    out: dict[str, Any] = {}
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    for name in ("one", "single"):
        target = zeros_like(state_on(mesh, P("y", "x")))
        restored, parts = parts_read(trainstate.load, f"{directory}/{name}", target)
        out[name] = check(restored, step=0)
        out[f"{name}_fully_addressable"] = restored["params"]["w"].is_fully_addressable
        out[f"{name}_parts"] = parts
    abstract = jax.tree.map(  # nothing allocated: shapes, dtypes and shardings (keys too)
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) if isinstance(a, jax.Array) else a,
        state_on(mesh, P("y", None)),
    )
    out["abstract"] = check(trainstate.load(f"{directory}/one", abstract))
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) if isinstance(a, jax.Array) else a,
        state_on(mesh, P("y", "x")),
    )
    jax_adapter.HOST_PLATFORMS = frozenset()
    try:
        restored, out["ring_parts"] = parts_read(trainstate.load, f"{directory}/one", abstract)
    finally:
        jax_adapter.HOST_PLATFORMS = frozenset({"cpu"})
    out["ring"] = check(restored)
    return out


def main() -> None:
    scenario, process, processes, _, port, directory = sys.argv[1:7]
    if int(processes) > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(processes), process_id=int(process))
    result = {"save": save, "load": load}[scenario](directory, int(process))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
