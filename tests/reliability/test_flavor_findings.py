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


KEY = bytes(range(32))  # the public test key of docs/format.md §12.4


def _damage(manifest: Path, member: str) -> None:
    """Change one hex digit of the manifest's encryption.<member>: what one flipped byte there does."""
    raw = manifest.read_bytes()
    at = raw.index(f'"{member}":"'.encode()) + len(member) + 4
    manifest.write_bytes(raw[:at] + (b"0" if raw[at : at + 1] != b"0" else b"1") + raw[at + 1 :])


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
@pytest.mark.parametrize("member", ["salt", "key_check"])
def test_a_damaged_salt_or_key_check_is_damage_when_the_key_decrypts_the_checkpoint(tmp_path, member, incremental):
    """corruption [encrypted]: one flipped byte in the salt or key check of one manifest made it read as
    written with another key (WrongKeyError), so the manager refused to start: "pass the key the checkpoint
    was saved with", while the key was right and every other checkpoint of the run authenticated with it.
    A chunk of the checkpoint that decrypts with the key (the chunk key needs no salt) proves the key
    right: the manifest was damaged, and restore_latest falls back past it like any damage."""
    run = tmp_path / "run"
    _run(run, 3, key=KEY, incremental=incremental)
    newest = run / "step_00000003"
    _damage(newest / "manifest.json", member)
    with pytest.raises(trainstate.TamperedCheckpointError, match="decrypts with"):
        trainstate.open(newest, key=KEY)
    with trainstate.CheckpointManager(run, key=KEY, incremental=incremental) as mgr:
        assert [c.step for c in mgr.list()] == [1, 2]
        state = {"w": np.zeros(10, np.float32), "step": 0}
        assert mgr.restore_latest(state) == 3  # step 2's, + 1
    assert state["step"] == 2 and state["w"][0] == 2


def test_a_checkpoint_of_another_key_still_stops_the_manager(tmp_path):
    """What the rule above must not change: no chunk decrypts with the key given, so it is another key's."""
    run = tmp_path / "run"
    _run(run, 2, key=KEY)
    trainstate.save(run / "step_00000003", {"w": np.full(10, 3, np.float32), "step": 3}, key=trainstate.generate_key())
    with pytest.raises(trainstate.WrongKeyError, match="step_00000003"):
        trainstate.CheckpointManager(run, key=KEY)
    with pytest.raises(trainstate.WrongKeyError):
        trainstate.open(run / "step_00000002", key=trainstate.generate_key())
