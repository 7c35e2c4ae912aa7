"""A restored JAX array lands where the target's was, committed to its devices only when the target was.

JAX moves an uncommitted array (one made without naming a device) to wherever a computation needs it; a
committed one stays and refuses to mix with arrays on other devices, and jitted functions compile again for
it. A restore that committed every array changed what the user's code does after a resume.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
import jax  # noqa: E402 - after the skip
import jax.numpy as jnp  # noqa: E402

import trainstate  # noqa: E402


def test_an_uncommitted_target_stays_uncommitted_on_its_device(tmp_path):
    trainstate.save(tmp_path / "c", {"w": np.arange(6, dtype=np.float32), "key": jax.random.key(7)})
    device = jax.devices()[-1]
    with jax.default_device(device):  # the state was built with another default device than restore's
        target = {"w": jnp.zeros(6), "key": jax.random.key(0)}
    trainstate.load(tmp_path / "c", target)
    for name, value in target.items():
        assert not value.committed and value.devices() == {device}, name
    assert np.array_equal(target["w"], np.arange(6))
    assert np.array_equal(jax.random.key_data(target["key"]), jax.random.key_data(jax.random.key(7)))
    other = jax.device_put(jnp.ones(6), jax.devices()[0])  # committed elsewhere: the restored array follows it
    assert (target["w"] + other).devices() == {jax.devices()[0]}


def test_a_committed_target_stays_committed_to_its_sharding(tmp_path):
    trainstate.save(tmp_path / "c", {"w": np.arange(6, dtype=np.float32), "key": jax.random.key(7)})
    device = jax.devices()[-1]
    target = {"w": jax.device_put(jnp.zeros(6), device), "key": jax.device_put(jax.random.key(0), device)}
    trainstate.load(tmp_path / "c", target)
    for name, value in target.items():
        assert value.committed and value.devices() == {device}, name
