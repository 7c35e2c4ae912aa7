"""Restoring into abstract arrays (``jax.ShapeDtypeStruct``, what ``jax.eval_shape`` / ``nnx.eval_shape`` give):
nothing allocated before the restore, new arrays of the target's dtype, sharding and key implementation after."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import trainstate  # noqa: E402


class _Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)


def test_a_tree_of_shape_dtype_structs_restores_into_real_arrays(tmp_path: Path) -> None:
    model = _Model(nnx.Rngs(0, dropout=1))
    trainstate.save(
        tmp_path / "c", {"model": nnx.state(model), "key": jax.random.key(3, impl="rbg"), "w": jnp.arange(8.0)}
    )
    mesh = Mesh(np.array(jax.devices()), ("a",))
    abstract = {
        "model": jax.eval_shape(lambda: nnx.state(_Model(nnx.Rngs(5, dropout=2)))),
        "key": jax.eval_shape(lambda: jax.random.key(0, impl="rbg")),
        "w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("a"))),
    }
    restored = trainstate.load(tmp_path / "c", abstract)
    assert isinstance(restored["model"], nnx.State)
    assert np.array_equal(restored["model"]["lin"]["kernel"][...], model.lin.kernel[...])
    assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(jax.random.key(0, impl="rbg"))
    assert np.array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(jax.random.key(3, impl="rbg")))
    assert restored["w"].sharding == abstract["w"].sharding
    assert np.array_equal(np.asarray(restored["w"]), np.arange(8.0, dtype=np.float32))


def test_an_abstract_nnx_model_is_filled_in_place(tmp_path: Path) -> None:
    model = _Model(nnx.Rngs(0, dropout=1))
    trainstate.save(tmp_path / "c", {"model": model})
    abstract = nnx.eval_shape(lambda: _Model(nnx.Rngs(5, dropout=2)))
    trainstate.load(tmp_path / "c", {"model": abstract})
    assert isinstance(abstract.lin.kernel[...], jax.Array)
    assert np.array_equal(abstract.lin.kernel[...], model.lin.kernel[...])


def test_saving_an_abstract_array_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(trainstate.UnsupportedValueError, match="w: .*no values to save"):
        trainstate.save(tmp_path / "c", {"w": jax.ShapeDtypeStruct((3,), jnp.float32)})
    assert not (tmp_path / "c").exists()


def test_an_abstract_mesh_target_takes_the_mesh_set_around_the_restore(tmp_path: Path) -> None:
    w = np.arange(128.0, dtype=np.float32).reshape(8, 16)
    trainstate.save(tmp_path / "c", {"w": jnp.asarray(w)})
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    with jax.set_mesh(mesh):  # jax.eval_shape under a mesh: the sharding is on an AbstractMesh
        abstract = jax.eval_shape(lambda: jax.sharding.reshard(jnp.zeros((8, 16)), P(None, "model")))
        restored = trainstate.load(tmp_path / "c", {"w": abstract})["w"]
    assert restored.sharding == NamedSharding(mesh, P(None, "model")) and np.array_equal(restored, w)
    with pytest.raises(trainstate.UnsupportedValueError, match=r"w: .*abstract mesh.*jax.set_mesh"):
        trainstate.load(tmp_path / "c", {"w": abstract})  # no mesh set: named, before anything is read


def test_a_sharding_that_does_not_divide_the_shape_is_named(tmp_path: Path) -> None:
    trainstate.save(tmp_path / "c", {"w": jnp.zeros((7, 16))})
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("a",)), P("a"))
    with pytest.raises(trainstate.UnsupportedValueError, match=r"w: its sharding does not fit its shape \[7, 16\]"):
        trainstate.load(tmp_path / "c", {"w": jax.ShapeDtypeStruct((7, 16), jnp.float32, sharding=sharding)})
