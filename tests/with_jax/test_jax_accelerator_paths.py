"""JAX arrays on accelerators, end to end: async staging with every device-to-host transfer started before the
first is waited for, and restores (into arrays and into abstract ``jax.ShapeDtypeStruct`` targets) through the
ring of reused host buffers, placed on the target's sharding.

No accelerator runs here: the tests empty ``HOST_PLATFORMS`` so that the eight CPU devices (tests/conftest.py)
count as accelerators and take those paths as a GPU's arrays do. What only a GPU shows -- the transfers
really overlapping, the time save() blocks -- is bench/bench_jax.py's; the last test runs on a GPU only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import trainstate  # noqa: E402
from trainstate._frameworks import jax as jax_adapter  # noqa: E402
from trainstate._restore import read as restore_read  # noqa: E402
from trainstate._restore import ring  # noqa: E402

MIB = 1 << 20
SLOT = MIB // 2  # two arrays a round


@pytest.fixture
def as_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU devices count as accelerators: their arrays take the accelerator paths."""
    monkeypatch.setattr(jax_adapter, "HOST_PLATFORMS", frozenset())


def mesh(rows: int, cols: int) -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[: rows * cols]).reshape(rows, cols), ("a", "b"))  # also on a GPU host


def values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"w{i}": rng.standard_normal((64, 1024)).astype(np.float32) for i in range(8)}  # 256 KiB each


def state_of(vals: dict[str, np.ndarray], sharding: Any) -> dict[str, Any]:
    out: dict[str, Any] = {k: jax.device_put(v, sharding) for k, v in vals.items()}
    out["half"] = jax.device_put(np.arange(48, dtype=np.float32).reshape(8, 6).astype(jax.numpy.bfloat16), sharding)
    out["scalar"] = jax.device_put(np.float32(2.5))
    out["key"] = jax.random.key(7)
    return out


class _Source:
    """A stand-in for a device array that logs when its transfer starts and when it is read."""

    def __init__(self, name: str, nbytes: int, log: list[str]) -> None:
        self.name, self.data, self.log = name, np.full(nbytes, len(name), np.uint8), log

    def copy_to_host_async(self) -> None:
        self.log.append(f"start {self.name}")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self.log.append(f"land {self.name}")
        return self.data


def test_every_transfer_starts_before_the_first_is_waited_for_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    hosts = [np.zeros(100, np.uint8) for _ in range(4)]
    jax_adapter._land([(_Source(str(i), 100, log), h) for i, h in enumerate(hosts)])
    assert log == ["start 0", "start 1", "start 2", "start 3", "land 0", "land 1", "land 2", "land 3"]
    assert all((h == 1).all() for h in hosts)
    log.clear()
    monkeypatch.setattr(jax_adapter, "AHEAD", 250)  # at most two of 100 bytes started and not landed
    jax_adapter._land([(_Source(str(i), 100, log), h) for i, h in enumerate(hosts)])
    assert log == ["start 0", "start 1", "land 0", "start 2", "land 1", "start 3", "land 2", "land 3"]


@pytest.mark.usefixtures("as_accelerator")
def test_an_async_save_of_sharded_arrays_copies_before_save_returns_though_the_loop_donates(tmp_path: Path) -> None:
    vals = values()
    sharding = NamedSharding(mesh(4, 2), P("a", "b"))
    state = state_of(vals, sharding)
    assert jax_adapter.on_accelerator(state["w0"])
    expected = {k: np.asarray(jax.random.key_data(v) if k == "key" else v).copy() for k, v in state.items()}
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    with trainstate.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
        mgr.save(1, state)
        donated = {k: v for k, v in state.items() if k != "key"}
        step(donated)  # the saved arrays' buffers are reused now, while the write goes on
        assert all(v.is_deleted() for v in donated.values())
        mgr.wait()
        assert [r.error for r in mgr.history()] == [None]
        loaded = trainstate.load(mgr.path_for(1))
    for k, v in expected.items():
        np.testing.assert_array_equal(np.asarray(loaded[k]), v, err_msg=k)


def _reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What a restore reads: per tensor, whether through the ring, and the ring's host bytes."""
    seen: dict[str, Any] = {"ring": set(), "host": set(), "allocated": 0}
    to_device, views = restore_read.read_to_device, restore_read.read_views

    def spy_ring(ck: Any, staged: Any, *args: Any, **kwargs: Any) -> int:
        seen["ring"] |= {s.name for s in staged}
        allocated = to_device(ck, staged, *args, **kwargs)
        seen["allocated"] += allocated
        return allocated

    def spy_views(ck: Any, reads: Any, **kwargs: Any) -> None:
        seen["host"] |= {name for name, _, _ in reads}
        views(ck, reads, **kwargs)

    monkeypatch.setattr(restore_read, "read_to_device", spy_ring)
    monkeypatch.setattr(restore_read, "read_views", spy_views)
    monkeypatch.setattr(ring, "slot_bytes", lambda threads: SLOT)  # a ring of 1.5 MiB for a 2 MiB+ state
    return seen


@pytest.mark.parametrize("abstract", [False, True], ids=["arrays", "shape-dtype-structs"])
@pytest.mark.usefixtures("as_accelerator")
def test_a_restore_onto_accelerators_goes_through_the_ring_onto_the_targets_sharding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, abstract: bool
) -> None:
    """Every array through the ring (host memory: its slots, not one host array per array; the arrays here fit
    a slot), made anew on the target's sharding -- another mesh than the saver's -- typed keys included."""
    vals = values()
    saved = state_of(vals, NamedSharding(mesh(4, 2), P("a", "b")))
    trainstate.save(tmp_path / "c", saved)
    sharding = NamedSharding(mesh(8, 1), P("a", "b"))
    target = state_of({k: np.zeros_like(v) for k, v in vals.items()}, sharding)
    target["key"] = jax.device_put(jax.random.key(99), sharding.mesh.devices.flat[3])
    if abstract:
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), target)
    seen = _reads(monkeypatch)
    restored = trainstate.load(tmp_path / "c", target)
    assert seen["ring"] == set(saved) and seen["allocated"] == ring.SLOTS * SLOT
    assert sum(v.nbytes for v in vals.values()) > seen["allocated"]  # the state is larger than the ring
    for k, v in saved.items():
        got = restored[k]
        assert isinstance(got, jax.Array) and got.sharding == target[k].sharding and got.dtype == v.dtype, k
        data = (lambda a: jax.random.key_data(a)) if k == "key" else (lambda a: a)
        np.testing.assert_array_equal(np.asarray(data(got)), np.asarray(data(v)), err_msg=k)
        assert k == "key" or got.committed == getattr(target[k], "committed", True), k


def test_arrays_on_cpu_devices_take_the_host_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fixture the same restore reads into host arrays: the ring is for accelerators only."""
    vals = values()
    trainstate.save(tmp_path / "c", state_of(vals, NamedSharding(mesh(4, 2), P("a", "b"))))
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        state_of({k: np.zeros_like(v) for k, v in vals.items()}, NamedSharding(mesh(8, 1), P("a", "b"))),
    )
    seen = _reads(monkeypatch)
    trainstate.load(tmp_path / "c", target)
    assert seen["ring"] == set() and seen["allocated"] == 0


@pytest.mark.skipif(jax.devices()[0].platform == "cpu", reason="needs an accelerator")
def test_on_an_accelerator_a_restore_and_an_async_save_take_those_paths(tmp_path: Path) -> None:  # pragma: no cover
    state = {k: jax.device_put(v) for k, v in values().items()}
    assert all(jax_adapter.on_accelerator(v) for v in state.values())
    with trainstate.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
        mgr.save(1, state)
        mgr.wait()
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        assert jax_adapter.on_accelerator(abstract["w0"])
        restored = trainstate.load(mgr.path_for(1), abstract)
    for k, v in state.items():
        assert restored[k].sharding == v.sharding
        np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(v), err_msg=k)
