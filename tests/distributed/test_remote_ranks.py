"""Collective save and load on s3:// with real gloo ranks, against a real S3-compatible server (moto on
127.0.0.1, reached through s3fs exactly as a user reaches AWS; nothing is patched).

On an object store there is no rename: ``begin`` returns the checkpoint's own prefix, every rank uploads its
data files straight into it under names of its own (``data-r00001-<save id>-00000.safetensors``), and rank
0's manifest PUT is the commit; the commit then drops the data files of a checkpoint it replaced. A save that
cannot commit leaves no manifest, so readers see nothing (or the checkpoint it was replacing, whole).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from tools.s3_server import AWS_ISOLATION, MotoServer  # noqa: E402

import dist_workers_consolidate as workers  # noqa: E402
import dist_workers_incremental as incremental  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")
BUCKET = "trainstate-ranks"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    mp = pytest.MonkeyPatch()
    for k, v in AWS_ISOLATION.items():  # the spawned ranks inherit these: boto looks nowhere real
        mp.setenv(k, v)
    try:
        with MotoServer(tmp_path_factory.mktemp("moto") / "server.log") as s:
            s.create_bucket(BUCKET)
            yield s
    finally:
        mp.undo()


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/step_2"


def _objects(server: MotoServer, url: str) -> list[str]:
    """What the store really holds under ``url`` (asked of S3 directly, not through trainstate)."""
    fs = server.filesystem()
    path = url.removeprefix("s3://")
    return sorted(p.rsplit("/", 1)[-1] for p in fs.find(path)) if fs.exists(path) else []


def _manifest(server: MotoServer, url: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(server.filesystem().cat_file(url.removeprefix("s3://") + "/manifest.json"))
    return body


def _storage(server: MotoServer) -> Any:
    return workers.storage_for(server.endpoint)


def test_each_rank_uploads_its_own_files_and_every_rank_loads_its_own_part(server, url):
    saved = ranks.ok(ranks.run(2, workers.save_sharded_to, url, server.endpoint))
    names = _objects(server, url)
    body = _manifest(server, url)
    assert body["world_size"] == 2
    assert sorted(f["path"] for f in body["files"]) + ["manifest.json"] == names  # nothing else in the prefix
    writers = {n.split("-")[1] for n in names if n.startswith("data-")}
    assert writers == {"r00000", "r00001"}  # both ranks uploaded their own shards
    assert {len(t["chunks"]) for t in body["tensors"].values()} == {1, 2}  # sharded: 2 chunks; replicated: 1
    back = ranks.ok(ranks.run(2, workers.load_sharded_from, url, server.endpoint))
    for rank in range(2):
        for k, want in saved[0]["whole"].items():
            assert np.array_equal(back[rank]["whole"][k], want), k
        assert back[rank]["seen"] == saved[rank]["seen"] and back[rank]["step"] == 2
        assert np.array_equal(back[rank]["draw_next"], saved[rank]["draw_next"])  # its own RNG stream
        assert np.array_equal(back[rank]["table"], np.arange(12.0).reshape(3, 4))


def test_consolidate_between_s3_and_a_local_disk(server, url, tmp_path):
    saved = ranks.ok(ranks.run(2, workers.save_sharded_to, url, server.endpoint))
    storage = _storage(server)
    trainstate.consolidate(url, tmp_path / "single", storage=storage)  # S3 -> local
    out = url + "-single"
    trainstate.consolidate(tmp_path / "single", out, dst_storage=storage)  # local -> S3
    with trainstate.open(out, storage) as ck:
        assert ck.world_size == 1 and all(ck.info(n).chunks == 1 for n in ck)
        ck.verify()
    back = trainstate.load(out, storage=storage)
    assert back["step"] == 2 and back["seen"]["samples"] == saved[0]["seen"]  # rank 0's
    assert np.array_equal(back["columns"], saved[0]["whole"]["columns"])
    assert np.array_equal(back["model"]["2.weight"], saved[0]["whole"]["model.2.weight"])
    assert all(n.startswith("data-") or n == "manifest.json" for n in _objects(server, out))


def test_an_overwriting_collective_save_commits_with_the_manifest_and_drops_the_old_files(server, url):
    ranks.ok(ranks.run(2, workers.save_filled, url, server.endpoint, 1.0, False))
    first = _objects(server, url)
    refused = ranks.run(2, workers.save_filled, url, server.endpoint, 2.0, False)
    assert all(isinstance(r, ranks.RankError) and "already exists" in r.message for r in refused), refused
    assert _objects(server, url) == first  # the refused save left nothing behind
    ranks.ok(ranks.run(2, workers.save_filled, url, server.endpoint, 2.0, True))
    now = _objects(server, url)
    assert not set(now) & (set(first) - {"manifest.json"})  # every old data file is gone
    assert sorted(f["path"] for f in _manifest(server, url)["files"]) + ["manifest.json"] == now
    back = trainstate.load(url, storage=_storage(server))
    assert np.array_equal(back["w"], np.full((8, 4), 2.0, np.float32)) and back["mine"] == {"0": 2.0, "1": 3.0}


@pytest.mark.parametrize("where", ["s3", "local"])
def test_a_rank_that_dies_mid_upload_leaves_no_checkpoint_and_no_files_of_the_live_ranks(server, url, tmp_path, where):
    endpoint = server.endpoint if where == "s3" else None
    target = url if where == "s3" else str(tmp_path / "step_2")
    results = ranks.run(2, workers.die_while_uploading, target, endpoint, timeout=120)
    assert results[1] == "exit code 17", results
    assert isinstance(results[0], ranks.RankError) and results[0].kind == "DistributedError", results
    storage = workers.storage_for(endpoint)
    with pytest.raises((trainstate.IncompleteCheckpointError, trainstate.CheckpointNotFoundError)):
        trainstate.open(target, storage)
    if where == "s3":
        # Rank 0 took back its own upload; rank 1's multipart upload never completed, so it is no object.
        assert _objects(server, url) == []
    else:
        assert list(tmp_path.iterdir()) == []  # rank 0 removed the staging directory, rank 1's part included
    ranks.ok(ranks.run(2, workers.save_filled, target, endpoint, 3.0, False))  # the path is usable again
    assert trainstate.load(target, storage=storage)["mine"] == {"0": 3.0, "1": 4.0}


def test_a_rank_whose_upload_is_refused_fails_every_rank_and_leaves_nothing(server, url):
    results = ranks.run(2, workers.fail_while_uploading, url, server.endpoint)
    assert isinstance(results[1], ranks.RankError) and "AccessDenied" in results[1].message, results
    assert isinstance(results[0], ranks.RankError) and results[0].kind == "DistributedError", results
    assert "rank 1" in results[0].message and "AccessDenied" in results[0].message
    assert _objects(server, url) == []


def test_the_path_arguments_of_a_remote_consolidate_are_checked_before_anything_is_written(server, url, tmp_path):
    ranks.ok(ranks.run(2, workers.save_filled, url, server.endpoint, 1.0, False))
    with pytest.raises(trainstate.InvalidArgumentError, match="saved by 2 ranks"):
        trainstate.consolidate(url, url + "-out", rank=2, storage=_storage(server), dst_storage=_storage(server))
    assert _objects(server, url + "-out") == []
    trainstate.consolidate(url, tmp_path / "one", rank=1, storage=_storage(server))
    assert trainstate.load(tmp_path / "one")["mine"] == 2.0  # rank 1's value, as one process stores it


def test_an_incremental_run_of_two_ranks_on_s3_shares_its_pool_and_three_ranks_restore_it(server):
    pytest.importorskip("zstandard")
    run = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    options = {"endpoint": server.endpoint, "compression": "zstd"}
    out = ranks.ok(ranks.run(2, incremental.run, run, options, [0, 1, 2, 3]))
    written = out[0]["written"]
    assert all(written[s] < 0.4 * written[0] for s in (1, 2, 3)), written  # the frozen shards are shared
    fs = server.filesystem()
    root = run.removeprefix("s3://")
    kept = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root) if p.rsplit("/", 1)[-1].startswith("step_"))
    assert kept == ["step_00000002", "step_00000003"]
    named = {
        f["path"]
        for name in kept
        for f in json.loads(fs.cat_file(f"{root}/{name}/manifest.json"))["files"]
        if f.get("pool")
    }
    pool = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/_shared")}
    assert named <= pool and {n.split("-")[1] for n in named} == {"r00000", "r00001"}  # pool-r<rank>-<id>-N
    # what rank 0 wrote and no kept checkpoint names is gone; rank 1's waits out the age rule (an hour)
    assert not {n for n in pool - named if n.split("-")[1] == "r00000"}
    newest = f"{run}/step_00000003"
    for at in (3, 1):
        got = ranks.ok(ranks.run(at, incremental.load, newest, None, server.endpoint))
        assert all(
            all(np.array_equal(g[k], v) for k, v in incremental.whole(3).items()) and g["step"] == 3 for g in got
        ), at
