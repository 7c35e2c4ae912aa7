"""One checkpoint, any framework: written from PyTorch it reads into NumPy and JAX, written from JAX it reads
into PyTorch, with every byte the same (bfloat16 and float8 included) and tensors named by their path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax_helpers import put  # noqa: E402

import trainstate  # noqa: E402

LOW_PRECISION = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def bits(value: Any) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, bytes) of a torch, NumPy or JAX array: equal only where every bit is."""
    if isinstance(value, torch.Tensor):
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return str(value.dtype).removeprefix("torch."), tuple(value.shape), raw
    host = np.asarray(value)
    return str(host.dtype), host.shape, np.ascontiguousarray(host).tobytes()


@pytest.fixture(scope="module")
def torch_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A checkpoint written from PyTorch: a small model, AdamW after a step, low-precision tensors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 3)).pow(2).mean().backward()
    optim.step()
    # every bit pattern of a float8 (NaNs and infinities included) and a spread of bfloat16 values
    low = {
        "bf16": torch.randn(6).to(torch.bfloat16),
        "e4m3": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "e5m2": torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2),
    }
    path = tmp_path_factory.mktemp("torch") / "ckpt"
    trainstate.save(path, {"model": model, "optim": optim, "low": low})
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for name, moments in optim.state_dict()["state"].items():
        param = f"model.{list(model.state_dict())[name]}"
        flat.update({f"optim.state.{param}.{k}": v for k, v in moments.items()})
    flat.update({f"low.{k}": v for k, v in low.items()})
    return path, flat


def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict's arrays by dotted path."""
    if isinstance(tree, dict):
        return {p: v for k, sub in tree.items() for p, v in leaves(sub, f"{prefix}{k}.").items()}
    if isinstance(tree, list):
        return {p: v for i, sub in enumerate(tree) for p, v in leaves(sub, f"{prefix}{i}.").items()}
    return {prefix[:-1]: tree} if hasattr(tree, "dtype") else {}


def test_a_torch_checkpoint_reads_into_numpy_bit_for_bit(torch_checkpoint: tuple[Path, dict[str, Any]]) -> None:
    path, saved = torch_checkpoint
    loaded = leaves(trainstate.load(path))
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert isinstance(loaded[key], np.ndarray), key
        assert bits(loaded[key]) == bits(value), key
    assert str(loaded["low.e4m3"].dtype) == "float8_e4m3fn" and str(loaded["low.e5m2"].dtype) == "float8_e5m2"


def test_a_torch_checkpoint_reads_as_jax_arrays_bit_for_bit(torch_checkpoint: tuple[Path, dict[str, Any]]) -> None:
    path, saved = torch_checkpoint
    loaded = leaves(trainstate.load(path, framework="jax"))
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert isinstance(loaded[key], jax.Array), key
        assert bits(loaded[key]) == bits(value), key
    assert loaded["low.bf16"].dtype == jnp.bfloat16 and loaded["low.e5m2"].dtype == jnp.float8_e5m2


def zeros(shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
    return put(np.zeros(shape, dtype))


def _jax_target(nested: bool) -> dict[str, Any]:
    """What a JAX program holds for the torch run's state: its own arrays (zeros, one sharded over the mesh),
    keyed by the checkpoint's paths, as nested dicts or with torch's dotted names."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    shapes = {"0.weight": (4, 3), "0.bias": (4,), "2.weight": (2, 4), "2.bias": (2,)}
    arrays = {name: zeros(shape) for name, shape in shapes.items()}
    arrays["0.weight"] = jax.device_put(arrays["0.weight"], NamedSharding(mesh, P("a", None)))

    def moments(shape: tuple[int, ...]) -> dict[str, Any]:
        return {"exp_avg": zeros(shape), "exp_avg_sq": zeros(shape), "step": zeros(())}

    if nested:
        model = {"0": {"weight": arrays["0.weight"], "bias": arrays["0.bias"]}, "2": {"weight": arrays["2.weight"]}}
        model["2"]["bias"] = arrays["2.bias"]
        state = {"model": {k: {n: moments(shapes[f"{k}.{n}"]) for n in ("weight", "bias")} for k in ("0", "2")}}
    else:
        model = arrays
        state = {f"model.{name}": moments(shape) for name, shape in shapes.items()}
    low = {
        "bf16": zeros((6,), jnp.bfloat16),
        "e4m3": zeros((256,), jnp.float8_e4m3fn),
        "e5m2": zeros((256,), jnp.float8_e5m2),
    }
    return {"model": model, "optim": {"state": state}, "low": low}


@pytest.mark.parametrize("nested", [True, False], ids=["nested-dicts", "dotted-keys"])
def test_a_torch_checkpoint_restores_into_a_jax_pytree_named_by_path(
    torch_checkpoint: tuple[Path, dict[str, Any]], nested: bool
) -> None:
    """The torch model's and optimizer's state restore into plain JAX dicts whose paths are the checkpoint's
    names, nested the way a JAX program nests them or keyed with torch's dotted names; the optimizer's
    param_groups (torch's hyperparameters) are left out with ``include``."""
    path, saved = torch_checkpoint
    target = _jax_target(nested)
    sharding = (target["model"]["0"]["weight"] if nested else target["model"]["0.weight"]).sharding
    restored = trainstate.load(path, target, include=["model", "optim.state", "low"])
    loaded = leaves(restored)
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert isinstance(loaded[key], jax.Array), key
        assert bits(loaded[key]) == bits(value), key
    assert loaded["model.0.weight"].sharding == sharding  # placed as the target's array was


def test_a_torch_checkpoint_names_what_a_jax_pytree_lacks(torch_checkpoint: tuple[Path, dict[str, Any]]) -> None:
    path, _ = torch_checkpoint
    target = _jax_target(nested=True)
    del target["model"]["2"]["bias"]
    target["model"]["0"]["scale"] = zeros((4,))
    with pytest.raises(trainstate.StateMismatchError) as e:
        trainstate.load(path, target, include=["model", "optim.state", "low"])
    assert e.value.missing == ["model.0.scale"] and e.value.unexpected == ["model.2.bias"]
    assert not np.asarray(target["model"]["0"]["weight"]).any()  # nothing was read


@pytest.fixture(scope="module")
def jax_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A checkpoint written from JAX: a linear layer's parameters (one sharded), low-precision arrays, keys."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    key = jax.random.wrap_key_data(put(np.array([0, 7], dtype=np.uint32)))
    every_byte = np.arange(256, dtype=np.uint8)
    state = {
        "model": {
            "weight": jax.device_put(
                np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4), NamedSharding(mesh, P(None, "b"))
            ),
            "bias": put(np.arange(2, dtype=np.float32)),
        },
        "low": {
            "bf16": put(np.linspace(-3, 3, 6).astype(jnp.bfloat16)),
            "e4m3": put(every_byte.view(jnp.float8_e4m3fn)),
            "e5m2": put(every_byte.view(jnp.float8_e5m2)),
        },
        "rng": {"typed": key, "raw": put(np.array([0, 3], dtype=np.uint32))},
    }
    path = tmp_path_factory.mktemp("jax") / "ckpt"
    trainstate.save(path, state)
    return path, leaves(state)


def test_a_jax_checkpoint_reads_into_torch_bit_for_bit(jax_checkpoint: tuple[Path, dict[str, Any]]) -> None:
    path, saved = jax_checkpoint
    loaded = leaves(trainstate.load(path, framework="torch"))
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert isinstance(loaded[key], torch.Tensor), key
        if key == "rng.typed":  # a typed key is stored as its key data
            value = jax.random.key_data(value)
        assert bits(loaded[key]) == bits(value), key
    for name, dtype in LOW_PRECISION.items():
        assert loaded[f"low.{name}"].dtype == dtype
    assert loaded["rng.typed"].dtype == torch.uint32 and loaded["rng.raw"].dtype == torch.uint32


def test_a_jax_checkpoint_restores_into_a_torch_module_named_by_path(
    jax_checkpoint: tuple[Path, dict[str, Any]],
) -> None:
    """JAX's nested ``model.weight`` restores into the torch module whose state_dict names it so, in place."""
    path, saved = jax_checkpoint
    model = torch.nn.Linear(4, 2)
    weight = model.weight
    trainstate.load(path, {"model": model}, include="model")
    assert model.weight is weight
    assert bits(model.weight) == bits(saved["model.weight"]) and bits(model.bias) == bits(saved["model.bias"])
