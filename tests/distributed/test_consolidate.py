"""``trainstate.consolidate`` / ``trainstate consolidate``: a checkpoint saved by real gloo ranks rewritten as
one a single process saved, then loaded in this plain process (no process group)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_consolidate as workers  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402
from helpers import cli  # noqa: E402
from trainstate._format.run_dir import is_staging_name  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")
WORLD = 4


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """A checkpoint saved by 4 FSDP2 ranks, and what each rank held."""
    path = tmp_path_factory.mktemp("sharded") / "step_2"
    return path, ranks.ok(ranks.run(WORLD, workers.save_sharded, str(path)))


def _plain_target() -> dict[str, Any]:
    model, optim = workers.plain_model()
    return {
        "model": model,
        "optim": optim,
        "step": 0,
        "columns": torch.zeros(6, 9),
        "table": torch.zeros(3, 4),
        "rng": trainstate.RNGState(),
        "seen": trainstate.PerRank({"samples": -1, "buf": torch.zeros(3)}),
    }


def _whole(state: dict[str, Any]) -> dict[str, np.ndarray]:
    model, optim = state["model"], state["optim"]
    out = {f"model.{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out.update(
        {f"optim.{i}.{k}": v.numpy().copy() for i, s in optim.state_dict()["state"].items() for k, v in s.items()}
    )
    out["columns"] = state["columns"].numpy().copy()
    return out


def _load_plain(path: Path, **kwargs: Any) -> dict[str, Any]:
    state = _plain_target()
    trainstate.load(path, state, **kwargs)
    state["draw_next"] = torch.rand(4).numpy()
    return state


def _assert_holds(state: dict[str, Any], saved: list[Any], rank: int) -> None:
    want = saved[0]["whole"]
    got = _whole(state)
    assert got.keys() == want.keys()
    for k in want:
        assert np.array_equal(got[k], want[k]), k  # exact: bytes copied, never recomputed
    assert state["step"] == 2 and np.array_equal(state["table"].numpy(), np.arange(12.0).reshape(3, 4))
    assert state["seen"].value["samples"] == saved[rank]["seen"] == 100 * (rank + 1)
    assert state["seen"].value["buf"].tolist() == [float(rank)] * 3
    assert np.array_equal(state["draw_next"], saved[rank]["draw_next"])  # that rank's RNG stream goes on


def test_the_sharded_checkpoint_records_its_world_size_and_its_boxes(sharded):
    path, _ = sharded
    with trainstate.open(path) as ck:
        assert ck.world_size == WORLD and ck.manifest.format_version == "1.2"
        assert ck.info("model.2.weight").chunks == WORLD  # 10 rows over 4 ranks: 3, 3, 3, 1
        assert [c.shape for c in ck.manifest.tensors["model.2.weight"].chunks] == [(3, 24)] * 3 + [(1, 24)]
        columns = ck.manifest.tensors["columns"].chunks  # 9 columns over 4 ranks: 3, 3, 3 and an empty shard
        assert [(c.offset, c.shape) for c in columns] == [
            ((0, 0), (6, 3)),
            ((0, 3), (6, 3)),
            ((0, 6), (6, 3)),
            ((0, 9), (6, 0)),
        ]
    with pytest.raises(trainstate.StateMismatchError, match="saved by 4 ranks"):  # why consolidate exists
        _load_plain(path)


def test_consolidated_loads_in_one_plain_process_with_rank_0s_per_rank_values(sharded, tmp_path):
    path, saved = sharded
    out = tmp_path / "single"
    result = trainstate.consolidate(path, out)
    assert result.path == str(out) and result.nbytes == sum(f.stat().st_size for f in out.iterdir())
    body = json.loads((out / "manifest.json").read_bytes())
    assert all(len(t["chunks"]) == 1 and set(t["chunks"][0]["offset"]) <= {0} for t in body["tensors"].values())
    assert "world_size" not in body and "trainstate.PerRank" not in json.dumps(body["tree"])
    assert not [f for f in body["files"] if f["path"].startswith("data-r")]  # a single process's file names
    with trainstate.open(out) as ck:
        assert ck.world_size == 1
        ck.verify()  # every checksum written fresh
        assert sorted(ck) == sorted(ck.keys())  # no tensor the tree does not use (other ranks' values dropped)
    _assert_holds(_load_plain(out), saved, rank=0)


def test_the_result_is_what_one_process_would_have_saved(sharded, tmp_path):
    """Same tensor names and tree as a one-process save of the state it restores into."""
    path, _ = sharded
    trainstate.consolidate(path, tmp_path / "single")
    state = _load_plain(tmp_path / "single")
    del state["draw_next"]
    trainstate.save(tmp_path / "resaved", state)
    with trainstate.open(tmp_path / "single") as a, trainstate.open(tmp_path / "resaved") as b:
        assert a.keys() == b.keys()  # e.g. "rng.torch", not rank 0's "rng.0.torch"
        assert [(a.info(k).dtype, a.info(k).shape) for k in a.keys()] == [
            (b.info(k).dtype, b.info(k).shape) for k in b.keys()
        ]


def test_another_ranks_per_rank_values_on_request(sharded, tmp_path):
    path, saved = sharded
    trainstate.consolidate(path, tmp_path / "as_rank_3", rank=3)
    _assert_holds(_load_plain(tmp_path / "as_rank_3"), saved, rank=3)
    with pytest.raises(trainstate.InvalidArgumentError, match="saved by 4 ranks: pick one of 0 to 3"):
        trainstate.consolidate(path, tmp_path / "nope", rank=4)
    assert not (tmp_path / "nope").exists()


def test_an_independent_reader_reads_both_the_same(sharded, tmp_path):
    """docs/format.md alone (tests/format/test_spec_reader.py) reads the sharded and the consolidated
    checkpoint to the same model and optimizer values."""
    from format import test_spec_reader as spec

    path, _ = sharded
    trainstate.consolidate(path, tmp_path / "single")
    before, after = spec.SpecReader(path).load(), spec.SpecReader(tmp_path / "single").load()
    assert list(before["seen"]) == [str(r) for r in range(WORLD)]  # a per-rank node: every rank's value
    spec.assert_exact(before["seen"]["0"], after["seen"], "seen")
    for key in ("model", "optim", "columns", "table", "step", "rng"):
        want = before[key]["0"] if key == "rng" else before[key]
        spec.assert_exact(want, after[key], key)


def test_a_damaged_chunk_is_caught_and_nothing_is_committed(sharded, tmp_path):
    import shutil

    path, _ = sharded
    copy = tmp_path / "damaged"
    shutil.copytree(path, copy)
    with trainstate.open(copy) as ck:
        chunk = ck.manifest.tensors["model.0.weight"].chunks[2]  # rank 2's shard
    with open(copy / chunk.file, "r+b") as f:
        f.seek(chunk.byte_range[0] + 5)
        byte = f.read(1)
        f.seek(chunk.byte_range[0] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(trainstate.CorruptCheckpointError, match="model.0.weight"):
        trainstate.consolidate(copy, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if is_staging_name(p.name)]


def test_the_command_line(sharded, tmp_path):
    path, saved = sharded
    out = tmp_path / "single"
    done = subprocess.run(
        [sys.executable, "-m", "trainstate", "consolidate", str(path), str(out), "--json"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["source_world_size"] == WORLD and report["rank"] == 0 and report["path"] == str(out)
    assert report["tensors"] == len(trainstate.open(out).keys())
    _assert_holds(_load_plain(out), saved, rank=0)
    # the rest through the same main() in this process (the subprocess above ran the entry point)
    again = cli("consolidate", str(path), str(out), code=8)
    assert "already exists" in again.stderr and "--overwrite" in again.stderr
    text = cli("consolidate", str(path), str(out), "--overwrite", "--rank", "1")
    assert "4 ranks" in text.stdout and "rank 1" in text.stdout, text.stdout + text.stderr
    _assert_holds(_load_plain(out), saved, rank=1)


def test_inspect_shows_the_world_size_and_each_tensors_chunks(sharded):
    """Through the CLI's main() in this process (the entry point runs in test_the_command_line)."""
    path, _ = sharded
    doc = json.loads(cli("inspect", str(path), "--json").stdout)
    assert doc["world_size"] == WORLD
    weight = next(t for t in doc["tensors"] if t["name"] == "model.2.weight")
    assert weight["chunks"] == WORLD and "boxes" not in weight  # the count, as before; boxes on request
    doc = json.loads(cli("inspect", str(path), "--json", "--chunks", "--filter", "model.2.weight").stdout)
    (weight,) = doc["tensors"]
    assert [(b["offset"], b["shape"]) for b in weight["boxes"]] == [
        ([0, 0], [3, 24]),
        ([3, 0], [3, 24]),
        ([6, 0], [3, 24]),
        ([9, 0], [1, 24]),
    ]
    assert [b["file"].split("-")[1] for b in weight["boxes"]] == ["r00000", "r00001", "r00002", "r00003"]
    text = cli("inspect", str(path), "--chunks", "--filter", "columns").stdout
    assert re.search(r"saved by +4 ranks", text) and "[0, 9]" in text and "[6, 0]" in text and "r00003" in text


def test_peak_memory_is_about_one_tensor_per_thread(tmp_path):
    """Eight 8 MB tensors sharded over 2 ranks: consolidating on one thread holds about one of them, not the
    checkpoint (the default takes more threads, each holding one tensor: about ``threads`` of them)."""
    path = tmp_path / "big"
    sums = ranks.ok(ranks.run(2, workers.save_big_shards, str(path)))[0]
    tracemalloc.start()
    try:
        trainstate.consolidate(path, tmp_path / "single", threads=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"consolidate peak (tracemalloc): {peak / 2**20:.1f} MiB for 8 x 8 MiB tensors")
    assert peak < 1.5 * workers.MB8, f"{peak / 2**20:.1f} MiB"
    with trainstate.open(tmp_path / "single") as ck:
        for name, want in sums.items():
            assert ck.info(name).chunks == 1
            assert float(ck.read(name).astype(np.float64).sum()) == want
