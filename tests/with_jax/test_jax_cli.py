"""The ``trainstate`` command on checkpoints a JAX program wrote (in this process, through the same ``main()``
the console script calls): ls, inspect and verify see JAX arrays as the arrays they are -- sharded ones whole,
typed PRNG keys as their key data, bfloat16 as BF16 -- and name a damaged one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax_helpers import BATCH, nnx_run, nnx_step, put, raw_key  # noqa: E402

import trainstate  # noqa: E402
from helpers import cli  # noqa: E402


def cli_json(*args: str, code: int = 0) -> Any:
    return json.loads(cli(*args, "--json", code=code).stdout)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A manager's directory of a Flax NNX run (steps 1 and 2) with a sharded array, a typed key and bfloat16."""
    model, optimizer = nnx_run(raw_key(0))
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    extra = {
        "table": jax.device_put(np.arange(64, dtype=np.float32).reshape(16, 4), NamedSharding(mesh, P("a", "b"))),
        "key": jax.random.wrap_key_data(put(np.array([0, 3], dtype=np.uint32))),
        "half": put(np.linspace(0, 1, 4).astype(jnp.bfloat16)),
    }
    directory = tmp_path_factory.mktemp("cli") / "run"
    mgr = trainstate.CheckpointManager(directory, save_on_preemption=False, capture_rng=False)
    for step in (1, 2):
        loss = nnx_step(model, optimizer, *BATCH)
        mgr.save(step, {"model": model, "optim": optimizer, "extra": extra}, metrics={"loss": float(loss)})
    mgr.close()
    return directory


def test_ls_lists_the_runs_checkpoints(run_dir: Path) -> None:
    rows = {row["name"]: row for row in cli_json("ls", str(run_dir))["checkpoints"]}
    assert [(rows[n]["step"], rows[n]["status"]) for n in sorted(rows)] == [(1, "complete"), (2, "complete")]
    assert set(rows["step_00000002"]["metrics"]) == {"loss"}
    assert "step_00000001" in cli("ls", str(run_dir)).stdout


def test_inspect_names_jax_arrays_by_path_with_their_dtypes_and_shapes(run_dir: Path) -> None:
    doc = cli_json("inspect", str(run_dir / "step_00000002"))
    tensors = {t["name"]: (t["dtype"], t["shape"]) for t in doc["tensors"]}
    assert tensors["extra.table"] == ("F32", [16, 4])  # the whole array, not one device's shard
    assert tensors["extra.key"] == ("U32", [2])  # a typed key: its key data
    assert tensors["extra.half"] == ("BF16", [4])
    assert tensors["model.l1.kernel"] == ("F32", [3, 4]) and tensors["optim.opt_state.0.mu.l1.kernel"] == (
        "F32",
        [3, 4],
    )
    assert tensors["model.drop.rngs.key"] == ("U32", [2]) and tensors["optim.step"] == ("U32", [])
    text = cli("inspect", str(run_dir / "step_00000002"), "--filter", "extra.*").stdout
    assert "extra.table" in text and "BF16" in text and "model.l1.kernel" not in text


def test_verify_passes_then_names_a_damaged_sharded_array(run_dir: Path, tmp_path: Path) -> None:
    good = run_dir / "step_00000001"
    assert "OK" in cli("verify", str(good)).stdout
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    with trainstate.open(damaged) as ck:
        chunk = ck.manifest.tensors["extra.table"].chunks[0]
    data = bytearray((damaged / chunk.file).read_bytes())
    data[chunk.byte_range[0] + 5] ^= 0xFF
    (damaged / chunk.file).write_bytes(data)
    doc = cli_json("verify", str(damaged), code=5)
    assert doc["ok"] is False and [e["tensor"] for e in doc["errors"]] == ["extra.table"]
