"""incremental=True under a process group (gloo, CPU): each rank shares its own unchanged shards through the
run's one pool, in files named per rank and save; any world size restores and resumes; rank 0 collects."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_incremental as workers  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")

KEY = "6d" * 32
POOL_NAME = re.compile(r"pool-[0-9a-f]{12}-r(\d{5})-\d{5}\.safetensors")


def _features(name: str) -> dict:
    if name == "plain":
        return {}
    pytest.importorskip("zstandard")
    pytest.importorskip("cryptography")
    return {"compression": "zstd", "key": KEY}


def _kept(run) -> list:
    return sorted(p for p in run.iterdir() if p.name.startswith("step_"))


def _body(path) -> dict:
    return json.loads((path / "manifest.json").read_bytes())


def _named(run) -> set[str]:
    return {f["path"] for p in _kept(run) for f in _body(p)["files"] if f.get("pool")}


def _same(got: dict, want: dict) -> bool:
    return all(np.array_equal(got[k], want[k]) for k in workers.NAMES)


@pytest.mark.parametrize("features", ["plain", "zstd+key"])
def test_ranks_share_their_unchanged_shards_through_one_pool_and_any_world_size_restores(tmp_path, features):
    options = _features(features)
    run = tmp_path / "run"
    out = ranks.ok(ranks.run(2, workers.run, str(run), options, [0, 1, 2, 3]))
    written = out[0]["written"]
    assert sorted(written) == [0, 1, 2, 3]
    # after the first save only what changed is written: the frozen base and table are shared
    assert all(written[s] < 0.4 * written[0] for s in (1, 2, 3)), written
    kept = _kept(run)
    assert [p.name for p in kept] == ["step_00000002", "step_00000003"]
    pool = {p.name for p in (run / "_shared").iterdir()}
    assert pool == _named(run)  # rank 0 collected what retention let go, and nothing a kept one names
    writers = {POOL_NAME.fullmatch(n).group(1) for n in pool}  # type: ignore[union-attr]
    assert writers == {"00000", "00001"}  # every rank wrote its own files, named for it
    body = _body(kept[-1])
    assert body["world_size"] == 2 and all(f["pool"] for f in body["files"])
    if options:
        assert body["encryption"]["algorithm"]
        assert all(c["transforms"][-1]["name"] == "aes-256-gcm" for t in body["tensors"].values() for c in t["chunks"])
    # the replicated table is stored once: one writer's files, in the same chunks in both kept checkpoints
    table = [c["file"] for c in body["tensors"]["table"]["chunks"]]
    assert len({POOL_NAME.fullmatch(f).group(1) for f in table}) == 1  # type: ignore[union-attr]
    assert table == [c["file"] for c in _body(kept[0])["tensors"]["table"]["chunks"]]
    # the base's shards too: the newest checkpoint names the files the first save wrote
    assert {c["file"] for c in body["tensors"]["base"]["chunks"]} == {
        c["file"] for c in _body(kept[0])["tensors"]["base"]["chunks"]
    }
    want = workers.whole(3)
    for at in (1, 2, 3):
        got = ranks.ok(ranks.run(at, workers.load, str(kept[-1]), options.get("key")))
        assert all(_same(g, want) and g["step"] == 3 for g in got), at
    for path in kept:
        with trainstate.open(str(path), key=options.get("key")) as ck:
            ck.verify()


def test_a_resume_on_three_ranks_restores_and_shares_pool_files_the_two_ranks_wrote(tmp_path):
    run = tmp_path / "run"
    ranks.ok(ranks.run(2, workers.run, str(run), {}, [0, 1, 2]))
    before = {p.name for p in (run / "_shared").iterdir()}
    out = ranks.ok(ranks.run(3, workers.run, str(run), {}, [3, 4]))
    for got in out:
        assert got["resumed"] == 3 and _same(got["restored"], workers.whole(2))
    newest = _kept(run)[-1]
    assert newest.name == "step_00000004" and _body(newest)["world_size"] == 3
    files = {f["path"] for f in _body(newest)["files"]}
    # the frozen shards the 2-rank job wrote still serve the 3-rank job's boxes where they tile them
    reused = files & before
    assert reused and any(POOL_NAME.fullmatch(n).group(1) == "00001" for n in reused)  # type: ignore[union-attr]
    assert {POOL_NAME.fullmatch(n).group(1) for n in files - before} <= {"00000", "00001", "00002"}  # type: ignore[union-attr]
    for at in (2, 1):
        got = ranks.ok(ranks.run(at, workers.load, str(newest), None))
        assert all(_same(g, workers.whole(4)) and g["step"] == 4 for g in got), at
    back = ranks.ok(ranks.run(2, workers.run, str(run), {}, [5]))  # and back to two
    assert all(g["resumed"] == 5 and _same(g["restored"], workers.whole(4)) for g in back)
    assert {p.name for p in (run / "_shared").iterdir()} == _named(run)


def _writer_of(path, tensor: str, rank: int) -> str:
    return next(
        c["file"]
        for c in _body(path)["tensors"][tensor]["chunks"]
        if POOL_NAME.fullmatch(c["file"]).group(1) == f"{rank:05d}"  # type: ignore[union-attr]
    )


def test_a_damaged_pool_file_written_by_rank_1_is_reported_for_each_checkpoint_using_it_and_resume_falls_back(
    tmp_path,
):
    run = tmp_path / "run"
    ranks.ok(ranks.run(2, workers.run, str(run), {}, [0, 1, 2, 3]))
    older, newest = _kept(run)
    # a file only the newest checkpoint names (rank 1's shard of what changed at step 3)
    victim = run / "_shared" / _writer_of(newest, "moving", 1)
    assert victim.name not in {f["path"] for f in _body(older)["files"]}
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0x10
    victim.write_bytes(bytes(raw))
    with trainstate.open(str(newest)) as ck, pytest.raises(trainstate.CorruptCheckpointError, match=victim.name):
        ck.verify()
    with trainstate.open(str(older)) as ck:
        ck.verify()
    out = ranks.ok(ranks.run(2, workers.run, str(run), {}, [3, 4]))  # restore_latest falls back past step 3
    for got in out:
        assert got["resumed"] == 3 and _same(got["restored"], workers.whole(2))
    fresh = _kept(run)[-1]
    assert victim.name not in {f["path"] for f in _body(fresh)["files"]}
    got = ranks.ok(ranks.run(2, workers.load, str(fresh), None))
    assert all(_same(g, workers.whole(4)) for g in got)

    # a frozen file rank 1 wrote, which every checkpoint of the run names: each one reports it
    frozen = run / "_shared" / _writer_of(fresh, "base", 1)
    assert all(frozen.name in {f["path"] for f in _body(p)["files"]} for p in _kept(run))
    raw = bytearray(frozen.read_bytes())
    raw[-5] ^= 0x01
    frozen.write_bytes(bytes(raw))
    for path in _kept(run):
        with trainstate.open(str(path)) as ck, pytest.raises(trainstate.CorruptCheckpointError, match=frozen.name):
            ck.verify()
    errors = ranks.run(2, workers.resume_only, str(run), {})
    assert all(isinstance(e, ranks.RankError) and "Checkpoint" in e.kind for e in errors), errors


def test_a_kill_during_rank_0s_pool_collection_loses_nothing_a_kept_checkpoint_names(tmp_path):
    run = tmp_path / "run"
    ranks.ok(ranks.run(2, workers.run, str(run), {}, [0, 1]))
    out = ranks.run(2, workers.killed_in_collection, str(run), {}, [2, 3, 4], timeout=120)
    assert out[0] == "exit code -9", out  # rank 0 died inside the collection
    kept = _kept(run)
    assert kept and all((run / "_shared" / f).exists() for f in _named(run))
    newest = int(kept[-1].name.split("_")[1])
    back = ranks.ok(ranks.run(2, workers.run, str(run), {}, [newest + 1, newest + 2]))
    for got in back:
        assert got["resumed"] == newest + 1 and _same(got["restored"], workers.whole(newest))
    for path in _kept(run):
        with trainstate.open(str(path)) as ck:
            ck.verify()
    assert {p.name for p in (run / "_shared").iterdir()} == _named(run)  # the next collection finished the job
