"""Compressed collective saves (zstd) on real gloo process groups: each rank compresses its own chunks."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")
pytest.importorskip("zstandard")

import dist_workers_zstd as workers  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402
from trainstate._format import manifest  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")


def _same(got: dict, want: dict) -> bool:
    return all(np.array_equal(got[k], v) for k, v in want.items())


def _manifest(path) -> dict:
    raw = (path / "manifest.json").read_bytes()
    return json.loads(raw)


def _stored(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(".safetensors"))


def _read_one_process(path) -> dict:
    with trainstate.open(str(path)) as ck:
        return {k: ck.read(k) for k in workers.whole()}


@pytest.mark.parametrize("world", [2, 4])
def test_a_compressed_collective_save_restores_bit_identically_at_its_world_size_on_one_rank_and_on_three(
    tmp_path, world
):
    path, plain = tmp_path / "zstd", tmp_path / "plain"
    ranks.ok(ranks.run(world, workers.save, str(path), "zstd"))
    ranks.ok(ranks.run(world, workers.save, str(plain), None))
    body = _manifest(path)
    assert body["world_size"] == world and body["format_version"] == "1.3"
    chunks = [dict(c, tensor=n) for n, t in body["tensors"].items() for c in t["chunks"]]
    zstd = [c for c in chunks if c.get("transforms")]
    assert {c["transforms"][0]["name"] for c in zstd} == {"zstd"}
    # every rank compressed its own shards' chunks; a shard is several chunks (CHUNK raw bytes each)
    assert {c["file"].split("-")[1] for c in zstd if c["tensor"] == "rows"} == {f"r{r:05d}" for r in range(world)}
    assert len(body["tensors"]["rows"]["chunks"]) > world
    assert all(not c.get("transforms") for c in chunks if c["tensor"] == "noise")  # did not pay: stored raw
    # one tensor per line (docs/format.md §3.1), as a single process writes it
    lines = (path / "manifest.json").read_bytes().split(b"\n")
    assert sum(line.startswith(b'"rows":{"chunks":') for line in lines) == 1
    assert sum(line.startswith(b'"columns":{"chunks":') for line in lines) == 1
    assert _stored(path) < _stored(plain) * 0.7, (_stored(path), _stored(plain))
    # rank 0's columns wrote the bytes the single-process writer makes of the same entries
    raw = (path / "manifest.json").read_bytes()
    parsed = manifest.parse(raw)
    assert any(c.transforms for t in parsed.tensors.values() for c in t.chunks)
    assert dataclasses.replace(parsed, tensors=dict(parsed.tensors)).to_json_bytes() == raw

    want = workers.whole()
    for at in (world, 3):
        got = ranks.ok(ranks.run(at, workers.load, str(path)))
        assert all(_same(g, want) and g["step"] == 3 for g in got)
    assert _same(_read_one_process(path), want)
    with trainstate.open(str(path)) as ck:
        ck.verify()
        assert ck.world_size == world


def test_a_damaged_compressed_chunk_written_by_rank_1_is_reported_on_load_and_by_verify(tmp_path):
    path = tmp_path / "c"
    ranks.ok(ranks.run(2, workers.save, str(path), "zstd"))
    body = _manifest(path)
    victim = next(
        c
        for n, t in body["tensors"].items()
        for c in t["chunks"]
        if c.get("transforms") and c["file"].startswith("data-r00001-") and n == "rows"
    )
    data = path / victim["file"]
    raw = bytearray(data.read_bytes())
    begin, end = victim["byte_range"]
    raw[(begin + end) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with trainstate.open(str(path)) as ck, pytest.raises(trainstate.CorruptCheckpointError):
        ck.verify()
    with pytest.raises(trainstate.CorruptCheckpointError):
        _read_one_process(path)
    errors = ranks.run(2, workers.load_error, str(path))
    assert any(isinstance(e, tuple) and e[0] == "CorruptCheckpointError" for e in errors), errors
    assert all(e is None or (isinstance(e, tuple) and "Checkpoint" in e[0]) for e in errors), errors


@pytest.mark.parametrize("async_save", [False, True])
def test_the_manager_saves_compressed_under_two_ranks_and_restore_latest_resumes(tmp_path, async_save):
    got = ranks.ok(ranks.run(2, workers.manager, str(tmp_path / "run"), async_save))
    want = workers.whole()
    want["table"] = want["table"] + 4
    for g in got:
        assert g["listed"] == [2, 4] and g["start"] == 5
        assert all(np.array_equal(g[k], want[k]) for k in ("rows", "columns", "table", "noise"))
    newest = tmp_path / "run" / sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step"))[-1]
    assert any(c.get("transforms") for t in _manifest(newest)["tensors"].values() for c in t["chunks"])


def test_ranks_with_nothing_to_write_take_part_in_a_compressed_save(tmp_path):
    got = ranks.ok(ranks.run(4, workers.save_few, str(tmp_path / "c")))
    assert all(np.array_equal(g["a"], np.zeros(4096)) and np.array_equal(g["b"], np.arange(3.0)) for g in got)
    files = {c["file"] for t in _manifest(tmp_path / "c")["tensors"].values() for c in t["chunks"]}
    assert len(files) == 2  # two boxes, two writers: the other two ranks wrote nothing
    assert _manifest(tmp_path / "c")["tensors"]["a"]["chunks"][0]["transforms"][0]["name"] == "zstd"
