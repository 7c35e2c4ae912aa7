"""Sharded arrays on eight CPU devices (tests/conftest.py): saved from a 4x2 mesh, each array is written once
however many devices hold a replica of it, and restores onto any sharding the target has -- another mesh, one
device, the same mesh -- placed as the target's array was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import trainstate  # noqa: E402

VALUES = np.arange(32 * 4, dtype=np.float32).reshape(32, 4)  # 512 bytes


def mesh(rows: int, cols: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: rows * cols]).reshape(rows, cols), ("a", "b"))


def on(sharding: Any, values: np.ndarray = VALUES) -> Any:
    return jax.device_put(values, sharding)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three arrays on a 4x2 mesh: split over both axes, split over one and replicated over the other, and
    replicated on all eight devices."""
    assert jax.device_count() == 8, "tests/conftest.py asks XLA for eight CPU devices"
    m = mesh(4, 2)
    state = {
        "split": on(NamedSharding(m, P("a", "b"))),
        "rows": on(NamedSharding(m, P("a", None))),
        "replicated": on(NamedSharding(m, P())),
    }
    assert len(state["rows"].addressable_shards) == 8 and state["replicated"].is_fully_replicated
    path = tmp_path_factory.mktemp("sharded") / "c"
    trainstate.save(path, state)
    return path


TARGETS = {
    "8x1": lambda: NamedSharding(mesh(8, 1), P("a", "b")),
    "one-device": lambda: SingleDeviceSharding(jax.devices()[5]),
    "4x2": lambda: NamedSharding(mesh(4, 2), P("a", "b")),
    "4x2-other-axis": lambda: NamedSharding(mesh(4, 2), P("b", None)),
    "2x2-of-four": lambda: NamedSharding(mesh(2, 2), P(None, "a")),
}


@pytest.mark.parametrize("where", list(TARGETS))
def test_restore_places_every_array_on_the_targets_sharding(saved: Path, where: str) -> None:
    sharding = TARGETS[where]()
    target = {name: on(sharding, np.zeros_like(VALUES)) for name in ("split", "rows", "replicated")}
    restored = trainstate.load(saved, dict(target))
    for name, array in restored.items():
        assert array is not target[name] and array.sharding == target[name].sharding, name
        assert array.committed, name
        np.testing.assert_array_equal(np.asarray(array), VALUES, err_msg=name)
        for shard in array.addressable_shards:  # each device holds its own slice, not the whole
            np.testing.assert_array_equal(np.asarray(shard.data), VALUES[shard.index], err_msg=name)


def test_a_replicated_array_is_written_once(saved: Path) -> None:
    """Eight replicas of ``replicated`` and two of each row block of ``rows``: the data files hold each array's
    bytes once (3 x 512), not once per device (eight times that for ``replicated``)."""
    with trainstate.open(saved) as ck:
        assert [ck.info(name).nbytes for name in ("split", "rows", "replicated")] == [VALUES.nbytes] * 3
    data = sum(f.stat().st_size for f in saved.iterdir() if f.name != "manifest.json")
    assert 3 * VALUES.nbytes <= data < 4 * VALUES.nbytes  # the rest: safetensors headers


def test_without_a_target_arrays_come_back_whole_on_one_device(saved: Path) -> None:
    loaded = trainstate.load(saved, framework="jax")
    for name, array in loaded.items():
        assert isinstance(array, jax.Array) and len(array.devices()) == 1, name
        np.testing.assert_array_equal(np.asarray(array), VALUES, err_msg=name)


def test_a_restored_array_is_committed_only_where_the_targets_was(tmp_path: Path) -> None:
    """An array JAX placed by default (``jnp.zeros``, a jitted step's output) is not committed to its device;
    restored, it must not be either: a committed argument is another cache key, so every jitted step that
    takes the restored state would compile again, and it would no longer follow other arrays' placement."""
    device = jax.devices()[3]
    key = jax.random.wrap_key_data(jax.device_put(np.array([0, 9], dtype=np.uint32)))
    trainstate.save(tmp_path / "c", {"free": on(None), "pinned": on(None), "key": key})
    with jax.default_device(device):  # uncommitted, on device 3
        free = jax.device_put(np.zeros_like(VALUES))
        free_key = jax.random.wrap_key_data(jax.device_put(np.zeros(2, dtype=np.uint32)))
    target = {"free": free, "pinned": on(device, np.zeros_like(VALUES)), "key": free_key}
    assert not free.committed and not free_key.committed and target["pinned"].committed
    committed = {name: array.committed for name, array in target.items()}
    restored = trainstate.load(tmp_path / "c", target)  # a dict is restored in place: it holds the new arrays
    for name, array in restored.items():
        assert array.committed == committed[name], name
        assert array.devices() == {device}, name
    np.testing.assert_array_equal(np.asarray(restored["free"]), VALUES)
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), [0, 9])
