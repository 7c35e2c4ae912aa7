"""An incremental run on S3 (a real moto server over HTTP): the pool is a prefix, files are uploaded once,
and collection follows the object-store rule (no lock: only files this process wrote, or hour-old ones)."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

import trainstate
from helpers import assert_same

from .conftest import BUCKET, MotoServer

pytest.importorskip("s3fs")
from trainstate._storage.fsspec import FsspecStorage  # noqa: E402 - only once fsspec is known to exist

BASE = np.random.default_rng(1).standard_normal((256, 1024)).astype(np.float32)  # 1 MiB, frozen


def _state(step: int) -> dict:
    return {"base": BASE, "adapter": np.full(32, step, dtype=np.float32), "step": step}


def _pool(fs, root: str) -> set[str]:
    path = f"{root}/_shared"
    return {p.rsplit("/", 1)[-1] for p in fs.ls(path, refresh=True)} if fs.exists(path) else set()


def _named(fs, root: str) -> set[str]:
    out: set[str] = set()
    for entry in fs.ls(root, refresh=True):
        manifest = f"{entry}/manifest.json"
        if fs.exists(manifest):
            out |= {f["path"] for f in json.loads(fs.cat_file(manifest))["files"] if f.get("pool")}
    return out


def test_an_incremental_run_on_s3(moto_server: MotoServer) -> None:
    fs = moto_server.filesystem(skip_instance_cache=True)
    storage = FsspecStorage(fs)
    url = f"s3://{BUCKET}/incr-{uuid.uuid4().hex[:8]}"
    root = storage.strip(url)
    kwargs = {
        "every_steps": 1,
        "keep_last": 2,
        "capture_rng": False,
        "incremental": True,
        "storage": storage,
        "collective": False,
    }
    with trainstate.CheckpointManager(url, **kwargs) as mgr:
        for step in range(1, 4):
            mgr.save(step, _state(step))
        assert [r.nbytes > BASE.nbytes for r in mgr.history()] == [True, False, False]
    assert len(_pool(fs, root)) == 3 and _pool(fs, root) == _named(fs, root)  # own garbage went at once
    with trainstate.CheckpointManager(url, **kwargs) as mgr:  # a restart dedupes against the newest
        mgr.save(4, _state(4))
        assert mgr.history()[-1].nbytes < 10_000
        assert [c.step for c in mgr.list()] == [3, 4]
    for step in (3, 4):
        assert_same(_state(step), trainstate.load(f"{url}/step_{step:08d}", storage=storage))
        with trainstate.open(f"{url}/step_{step:08d}", storage=storage) as ck:
            ck.verify()
    # a pool file nobody names that another writer may still be uploading: young, so left alone
    stray = f"{root}/_shared/pool-0123456789ab-00000.safetensors"
    fs.pipe_file(stray, b"x" * 64)
    with trainstate.CheckpointManager(url, **kwargs) as mgr:
        assert "_shared/pool-0123456789ab-00000.safetensors" not in mgr.swept
    assert fs.exists(stray)
