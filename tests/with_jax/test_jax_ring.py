"""JAX arrays through the restore ring (``_restore/ring.py``): each array made anew, with its target's dtype and
sharding, from bytes read into reused host buffers; the next round waits until the transfer is ready.

No accelerator runs here: JAX arrays on the CPU are not restored through the ring (``on_accelerator`` is
False for them), so these tests drive the ring directly with CPU arrays as targets. On the CPU ``device_put``
may share a host buffer's memory, so the adapter copies there; on an accelerator the transfer reads the
buffer, which the ring reuses only after ``block_until_ready``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import trainstate  # noqa: E402
from trainstate._frameworks import jax as jax_adapter  # noqa: E402
from trainstate._restore import ring  # noqa: E402
from trainstate._restore.read import read_views  # noqa: E402

MIB = 1 << 20


def test_jax_targets_are_made_anew_through_a_ring_smaller_than_the_state(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    saved = {f"w{i}": rng.standard_normal(200_000 + i).astype(np.float32) for i in range(10)}  # 8 MB
    saved["big"] = rng.standard_normal(3 * MIB // 4).astype(np.float32)  # 3 MiB: larger than a 2 MiB slot
    saved["half"] = rng.standard_normal(1000).astype(jnp.bfloat16)
    trainstate.save(tmp_path / "c", {k: jnp.asarray(v) for k, v in saved.items()})
    targets = {k: jnp.zeros(v.shape, v.dtype) for k, v in saved.items()}
    got: dict[str, Any] = {}
    staged = [
        ring.Staged(k, jax_adapter, t, None, t.nbytes, jax_adapter.cuttable(t), partial(got.__setitem__, k))
        for k, t in targets.items()
    ]
    with trainstate.open(tmp_path / "c") as ck:
        whole = partial(read_views, ck, verify=True, threads=2)
        allocated = ring.read_to_device(ck, staged, whole, verify=True, threads=2, size=2 * MIB)
    assert got.keys() == saved.keys()
    for k, v in saved.items():
        assert isinstance(got[k], jax.Array) and got[k].dtype == v.dtype and got[k].sharding == targets[k].sharding
        np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)
    assert allocated == ring.SLOTS * 2 * MIB + -(-saved["big"].nbytes // 64) * 64  # the ring, and one of its own


def test_arrays_on_the_host_cpu_are_not_ring_targets() -> None:
    assert not jax_adapter.on_accelerator(jnp.zeros(3))
    assert not jax_adapter.on_accelerator(jax.ShapeDtypeStruct((3,), jnp.float32))
    assert not jax_adapter.on_accelerator(np.zeros(3))
