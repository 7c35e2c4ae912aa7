"""Issue 28 (must-have 3): consolidate, export, verify, inspect, diff and average on checkpoints that 2 gloo
ranks saved zstd-compressed, sharded (DTensor shards cut into several compressed chunks) and replicated,
all run in this one plain process (no process group)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")
pytest.importorskip("zstandard")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import dist_workers_zstd as workers  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402
from helpers import cli  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")
WORLD = 2


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compressed checkpoint 2 ranks saved: rows / columns sharded, the rest replicated."""
    path = tmp_path_factory.mktemp("ztools") / "zstd"
    ranks.ok(ranks.run(WORLD, workers.save, str(path), "zstd"))
    body = json.loads((path / "manifest.json").read_bytes())
    assert body["world_size"] == WORLD
    rows = body["tensors"]["rows"]["chunks"]
    assert len(rows) > WORLD and all(c.get("transforms") for c in rows)  # several compressed chunks a shard
    return path


def _read(path: Path) -> dict[str, np.ndarray]:
    with trainstate.open(str(path)) as ck:
        return {k: np.asarray(ck.read(k)) for k in workers.whole()}


def _same(got: dict, want: dict) -> None:
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_consolidate_a_compressed_sharded_checkpoint_restores_bit_identically(src, tmp_path, compression):
    dst = tmp_path / "one"
    trainstate.consolidate(src, dst, compression=compression)
    body = json.loads((dst / "manifest.json").read_bytes())
    assert body.get("world_size", 1) == 1
    assert all(len(t["chunks"]) >= 1 for t in body["tensors"].values())
    if compression is None:
        assert not any(c.get("transforms") for t in body["tensors"].values() for c in t["chunks"])
    else:
        assert any(c.get("transforms") for t in body["tensors"].values() for c in t["chunks"])
    _same(_read(dst), workers.whole())
    back = trainstate.load(str(dst))
    assert back["step"] == 3
    for k, v in workers.whole().items():
        assert np.asarray(back[k]).tobytes() == v.tobytes(), k
    with trainstate.open(str(dst)) as ck:
        ck.verify()
    cli("verify", str(dst))
    # the consolidated copy and the sharded original hold the same values
    cli("diff", str(src), str(dst))


def test_verify_and_inspect_on_the_command_line(src):
    cli("verify", str(src))
    doc = json.loads(cli("verify", str(src), "--json").stdout)
    assert doc
    text = cli("inspect", str(src)).stdout
    assert "rows" in text and "columns" in text
    doc = json.loads(cli("inspect", str(src), "--json").stdout)
    assert doc["world_size"] == WORLD
    names = {t["key"] if "key" in t else t.get("name") for t in doc["tensors"]}
    assert {"rows", "columns", "table", "noise"} <= names, doc["tensors"]
    doc = json.loads(cli("inspect", str(src), "--chunks", "--json").stdout)
    rows = next(t for t in doc["tensors"] if "rows" in (t.get("key"), t.get("name")))
    assert len(rows["boxes"]) > WORLD


def test_diff_of_the_sharded_checkpoint_with_itself_and_with_another(src, tmp_path):
    cli("diff", str(src), str(src))
    other = tmp_path / "other"
    ranks.ok(ranks.run(WORLD, workers.save_scaled, str(other), 2.0))
    doc = json.loads(cli("diff", str(src), str(other), "--json", code=1).stdout)
    said = json.dumps(doc)
    assert "rows" in said and "columns" in said and "table" in said
    assert "noise" not in said and "small" not in said


@pytest.mark.parametrize("command_line", [False, True])
def test_export_to_safetensors_holds_the_saved_tensors(src, tmp_path, command_line):
    out = tmp_path / "model.safetensors"
    if command_line:
        cli("export", str(src), str(out), "--format", "safetensors", "--select", "*")
    else:
        trainstate.export(src, out, format="safetensors", select="*")
    got = safetensors_numpy.load_file(str(out))
    want = workers.whole()
    assert set(got) == set(want)
    _same(got, want)


def test_average_of_two_compressed_sharded_checkpoints_is_their_mean(tmp_path):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "mean"
    ranks.ok(ranks.run(WORLD, workers.save_scaled, str(a), 1.0))
    ranks.ok(ranks.run(WORLD, workers.save_scaled, str(b), 3.0))
    trainstate.average([a, b], out)
    cli("average", str(a), str(b), "-o", str(tmp_path / "cli"))
    for path in (out, tmp_path / "cli"):
        got = _read(path)
        want = workers.whole()
        for k in ("rows", "columns", "table"):
            assert got[k].tobytes() == (want[k] * 2.0).tobytes(), k
        for k in ("noise", "small"):
            assert got[k].tobytes() == want[k].tobytes(), k
        back = trainstate.load(str(path))  # one process: rank 0's per-rank values, averaged where floating
        assert back["mine"]["rank"] == 0 and back["step"] == 3
        assert np.asarray(back["mine"]["moment"]).tolist() == [2.0] * 4
        cli("verify", str(path))
