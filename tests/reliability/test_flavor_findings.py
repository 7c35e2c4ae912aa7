"""What the flavored campaigns (tests/reliability/test_flavors.py) found, one regression test each, written
the way a user meets it: a run directory, a manager, and a damaged or forged checkpoint in it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tools.reliability import fuzz  # the repository root is on sys.path (pyproject: pythonpath)

import trainstate


def _run(run: Path, steps: int, **kwargs) -> None:
    with trainstate.CheckpointManager(run, every_steps=1, capture_rng=False, **kwargs) as mgr:
        for step in range(1, steps + 1):
            mgr.save(step, {"w": np.full(10, step, np.float32), "step": step})


def test_a_plain_manifest_claiming_an_encrypted_chunk_is_damage_not_a_missing_key(tmp_path):
    """fuzz [zstd] structure:340: a chunk of a plain checkpoint said to be aes-256-gcm raised
    KeyRequiredError ("pass key="), which stops restore_latest as a user error instead of falling back.
    Without an authenticated manifest nothing is encrypted: the manifest was forged or damaged."""
    run = tmp_path / "run"
    _run(run, 2)
    newest = run / "step_00000002" / "manifest.json"
    body = json.loads(newest.read_bytes())
    body["tensors"]["w"]["chunks"][0]["transforms"] = [{"name": "aes-256-gcm", "nonce": "0" * 24}]
    newest.write_bytes(fuzz.seal(body))  # a plain manifest's checksum is anyone's to recompute
    with trainstate.open(newest.parent) as ck, pytest.raises(trainstate.CorruptCheckpointError, match="not encrypted"):
        ck.read("w")
    with pytest.raises(trainstate.CorruptCheckpointError, match="not encrypted"):
        trainstate.load(newest.parent)
    state = {"w": np.zeros(10, np.float32), "step": 0}
    assert trainstate.CheckpointManager(run).restore_latest(state) == 2  # step 1's, + 1
    assert state["step"] == 1 and state["w"][0] == 1
