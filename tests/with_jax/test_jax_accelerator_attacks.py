"""Attacks on the accelerator paths of issue 32 (async staging with transfers started together; restores
through the ring), taken on the CPU devices by emptying ``HOST_PLATFORMS``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import trainstate  # noqa: E402
from trainstate._frameworks import jax as jax_adapter  # noqa: E402
from trainstate._restore import read as restore_read  # noqa: E402
from trainstate._restore import ring  # noqa: E402
from trainstate.errors import CheckpointError  # noqa: E402

MIB = 1 << 20
SLOT = MIB // 2


@pytest.fixture
def as_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax_adapter, "HOST_PLATFORMS", frozenset())


def mesh(rows: int, cols: int) -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[: rows * cols]).reshape(rows, cols), ("a", "b"))


def _reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {"ring": set(), "allocated": 0}
    to_device = restore_read.read_to_device

    def spy_ring(ck: Any, staged: Any, *args: Any, **kwargs: Any) -> int:
        seen["ring"] |= {s.name for s in staged}
        allocated = to_device(ck, staged, *args, **kwargs)
        seen["allocated"] += allocated
        return allocated

    monkeypatch.setattr(restore_read, "read_to_device", spy_ring)
    monkeypatch.setattr(ring, "slot_bytes", lambda threads: SLOT)
    return seen


def _np(a: Any) -> np.ndarray:
    if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _async_save(path: Path, state: Any) -> None:
    with trainstate.CheckpointManager(path, async_save=True) as mgr:
        mgr.save(1, state)
        mgr.wait()
        assert [r.error for r in mgr.history()] == [None]


LAYOUTS = {
    "4x2": (mesh(4, 2), P("a", "b")),
    "8x1": (mesh(8, 1), P("a", "b")),
    "2x4": (mesh(2, 4), P("a", "b")),
    "2x4-cols": (mesh(2, 4), P(None, "b")),
    "replicated": (mesh(4, 2), P()),
    "half-replicated": (mesh(4, 2), P("a")),
}


@pytest.mark.parametrize("abstract", [False, True], ids=["arrays", "abstract"])
@pytest.mark.parametrize("to", list(LAYOUTS))
@pytest.mark.parametrize("frm", ["4x2", "replicated", "half-replicated", "2x4-cols"])
@pytest.mark.usefixtures("as_accelerator")
def test_layouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, frm: str, to: str, abstract: bool) -> None:
    rng = np.random.default_rng(1)
    vals = {f"w{i}": rng.standard_normal((64, 1024)).astype(np.float32) for i in range(4)}
    vals["small"] = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
    saved = {k: jax.device_put(v, NamedSharding(*LAYOUTS[frm])) for k, v in vals.items()}
    _async_save(tmp_path / "run", saved)
    target = {k: jax.device_put(np.zeros_like(v), NamedSharding(*LAYOUTS[to])) for k, v in vals.items()}
    if abstract:
        target = _abstract(target)
    seen = _reads(monkeypatch)
    got = trainstate.load(trainstate.CheckpointManager(tmp_path / "run").path_for(1), target)
    assert seen["ring"] == set(vals)
    for k, v in vals.items():
        assert got[k].sharding == NamedSharding(*LAYOUTS[to]), k
        np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)


@pytest.mark.usefixtures("as_accelerator")
def test_a_64bit_value_that_does_not_fit_is_refused_naming_it_through_the_ring(tmp_path: Path) -> None:
    """docs/jax.md Limits: without x64 a 64-bit tensor that does not fit 32 bits is refused with
    UnsupportedValueError *naming it*; the host path says "big: ...", the ring path drops the name."""
    if jax.config.jax_enable_x64:
        pytest.skip("needs JAX's 64-bit mode off")
    trainstate.save(tmp_path / "c", {"big": np.array([1, 2**40], np.int64).repeat(4)})
    target = {"big": jax.ShapeDtypeStruct((8,), np.int64, sharding=NamedSharding(mesh(4, 2), P("a")))}
    with pytest.raises(trainstate.UnsupportedValueError, match="big"):
        trainstate.load(tmp_path / "c", target)


@pytest.mark.usefixtures("as_accelerator")
def test_the_bytes_started_ahead_stay_within_ahead_across_lanes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/jax.md: transfers are started together, "at most 512 MiB started ahead of the copies into place"
    (AHEAD). A save over 64 MiB with several threads splits the arrays over lanes, each its own _land."""
    import threading

    ahead = 2 * MIB
    monkeypatch.setattr(jax_adapter, "AHEAD", ahead)
    lock, flight = threading.Lock(), {"now": 0, "max": 0}

    class Tracked:
        def __init__(self, source: Any, nbytes: int) -> None:
            self.source, self.nbytes = source, nbytes

        def copy_to_host_async(self) -> None:
            with lock:
                flight["now"] += self.nbytes
                flight["max"] = max(flight["max"], flight["now"])
            self.source.copy_to_host_async()

        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            out = np.asarray(self.source)
            threading.Event().wait(0.002)  # the copy into place takes a while: the lanes overlap
            with lock:
                flight["now"] -= self.nbytes
            return out

    landings = jax_adapter._landings
    monkeypatch.setattr(
        jax_adapter, "_landings", lambda value, host: ((Tracked(s, d.nbytes), d) for s, d in landings(value, host))
    )
    sharding = NamedSharding(mesh(4, 2), P("a", "b"))
    state = {f"w{i}": jax.device_put(np.full((1024, 2048), i, np.float32), sharding) for i in range(10)}  # 80 MiB
    with trainstate.CheckpointManager(tmp_path / "run", async_save=True, threads=4) as mgr:
        mgr.save(1, state)
        mgr.wait()
    assert flight["max"] > 0
    assert flight["max"] <= ahead, flight


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.usefixtures("as_accelerator")
def test_sharded_and_replicated_typed_keys_through_the_ring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, impl: str
) -> None:
    k0 = jax.random.key(3, impl=impl)
    state = {
        "k": k0,
        "ks": jax.device_put(jax.random.split(k0, 8), NamedSharding(mesh(4, 2), P("a"))),
        "kr": jax.device_put(jax.random.split(k0, 4), NamedSharding(mesh(4, 2), P())),
    }
    _async_save(tmp_path / "run", state)
    seen = _reads(monkeypatch)
    got = trainstate.load(trainstate.CheckpointManager(tmp_path / "run").path_for(1), _abstract(state))
    assert seen["ring"] == set(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].sharding == v.sharding, k
        np.testing.assert_array_equal(_np(got[k]), _np(v), err_msg=k)


@pytest.mark.parametrize("abstract", [False, True], ids=["arrays", "abstract"])
@pytest.mark.usefixtures("as_accelerator")
def test_a_corrupt_tensor_through_the_ring_raises_and_leaves_the_target_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, abstract: bool
) -> None:
    sharding = NamedSharding(mesh(4, 2), P("a", "b"))
    rng = np.random.default_rng(0)
    trainstate.save(
        tmp_path / "c",
        {f"w{i}": jax.device_put(rng.standard_normal((64, 1024)).astype(np.float32), sharding) for i in range(8)},
    )
    chunk = trainstate.open(tmp_path / "c").manifest.tensors["w7"].chunks[0]
    with open(tmp_path / "c" / chunk.file, "r+b") as f:
        f.seek(chunk.byte_range[1] - 10)
        byte = f.read(1)
        f.seek(chunk.byte_range[1] - 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    target = {f"w{i}": jax.device_put(np.zeros((64, 1024), np.float32), sharding) for i in range(8)}
    if abstract:
        target = _abstract(target)
    before = dict(target)
    seen = _reads(monkeypatch)
    with pytest.raises(CheckpointError):
        trainstate.load(tmp_path / "c", target)
    assert seen["ring"]
    assert all(target[k] is before[k] for k in target)
