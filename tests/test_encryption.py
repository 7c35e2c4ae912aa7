"""Encrypted checkpoints the way a user runs them: a training run's manager, the converters and every CLI
command, with the key in an environment variable. (The per-chunk cipher is tested on its own in
tests/transforms/test_aes_gcm.py, the manifest's MAC in tests/format/test_manifest_mac.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import trainstate
from helpers import cli

KEY = bytes(range(200, 232)).hex()  # a TEST key: public in this repository, never for real data
VAR = "TRAINSTATE_TEST_KEY"


@pytest.fixture
def key_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(VAR, KEY)
    return VAR


def _state(step: int = 0) -> dict[str, object]:
    return {
        "model": {"w": np.arange(12, dtype=np.float32).reshape(3, 4) + step, "b": np.zeros(3)},
        "step": step,
        "cfg": {"lr": 0.1},
    }


@pytest.mark.parametrize("async_save", [False, True])
def test_an_encrypted_run_saves_and_resumes_with_its_key_only(tmp_path: Path, key_env: str, async_save: bool) -> None:
    run = tmp_path / "run"
    mgr = trainstate.CheckpointManager(run, every_steps=1, keep_last=2, key_env=key_env, async_save=async_save)
    for step in range(3):
        mgr.save(step, _state(step))
    mgr.close()
    assert [c.step for c in trainstate.CheckpointManager(run, read_only=True, key=KEY).list()] == [1, 2]
    for step_dir in run.glob("step_*"):
        assert json.loads((step_dir / "manifest.json").read_bytes())["encryption"]["algorithm"] == "aes-256-gcm"
    state = _state(99)
    assert trainstate.CheckpointManager(run, key=KEY).restore_latest(state) == 3
    np.testing.assert_array_equal(state["model"]["w"], _state(2)["model"]["w"])  # type: ignore[index]
    with pytest.raises(trainstate.KeyRequiredError):
        trainstate.CheckpointManager(run, read_only=True).list()
    with pytest.raises(trainstate.WrongKeyError):
        trainstate.CheckpointManager(run, key=trainstate.generate_key())


def test_a_key_that_does_not_fit_stops_the_manager_instead_of_skipping(tmp_path: Path) -> None:
    """A plain checkpoint in an encrypted run (or the reverse) is not damage to skip over: resuming from
    an older checkpoint, or from nothing, would silently lose the run. The manager refuses to start."""
    run = tmp_path / "run"
    with trainstate.CheckpointManager(run, key=KEY) as mgr:
        mgr.save(1, _state(1), force=True)
    trainstate.save(run / "step_00000002", _state(2))  # someone saved a plain one there
    with pytest.raises(trainstate.NotEncryptedError, match="step_00000002"):
        trainstate.CheckpointManager(run, key=KEY)
    with pytest.raises(trainstate.KeyRequiredError, match="step_00000001"):
        trainstate.CheckpointManager(run)


def test_a_tampered_manifest_is_skipped_like_damage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    with trainstate.CheckpointManager(run, key=KEY) as mgr:
        mgr.save(1, _state(1), force=True)
        mgr.save(2, _state(2), force=True)
    newest = run / "step_00000002" / "manifest.json"
    newest.write_bytes(newest.read_bytes().replace(b'["lr",0.1]', b'["lr",0.9]'))
    state = _state(0)
    with caplog.at_level(logging.WARNING, logger="trainstate"):
        assert trainstate.CheckpointManager(run, key=KEY).restore_latest(state) == 2  # step 1's, + 1
    assert state["cfg"] == {"lr": 0.1} and "failed authentication" in caplog.text


def test_converters_read_and_write_with_the_key(tmp_path: Path, key_env: str) -> None:
    for step in (1, 2):
        trainstate.save(tmp_path / f"c{step}", _state(step), key=KEY)
    trainstate.average([tmp_path / "c1", tmp_path / "c2"], tmp_path / "avg", key_env=key_env)
    trainstate.consolidate(tmp_path / "c1", tmp_path / "one", key=KEY)
    blob = trainstate.pack(tmp_path / "c1", key=KEY)
    for out in (tmp_path / "avg", tmp_path / "one", blob):
        with pytest.raises(trainstate.KeyRequiredError):
            trainstate.open(out)
        with trainstate.open(out, key=KEY) as ck:
            assert ck.encrypted
    mean = trainstate.load(tmp_path / "avg", key=KEY)["model"]["w"]
    np.testing.assert_allclose(mean, (_state(1)["model"]["w"] + _state(2)["model"]["w"]) / 2)  # type: ignore[index]
    with pytest.raises(trainstate.KeyRequiredError):
        trainstate.average([tmp_path / "c1", tmp_path / "c2"], tmp_path / "avg2")


def test_every_command_that_opens_or_writes_a_checkpoint_takes_key_env() -> None:
    from trainstate._cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices  # type: ignore[union-attr]
    for name, sub in commands.items():
        flags = {s for a in sub._actions for s in a.option_strings}
        if name in ("keygen", "demo"):
            assert "--key-env" not in flags, name
        else:
            assert "--key-env" in flags, name


def test_cli_on_an_encrypted_checkpoint(tmp_path: Path, key_env: str) -> None:
    ck, run = tmp_path / "ck", tmp_path / "run"
    trainstate.save(ck, _state(1), metadata={"run": "exp"}, key=KEY)
    with trainstate.CheckpointManager(run, key=KEY, capture_rng=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step), force=True)

    refused = cli("inspect", str(ck), code=2)  # exit 2: an argument to fix, not damage
    assert "encrypted" in refused.stderr and "--key-env" in refused.stderr
    listed = cli("ls", str(run), code=2).stderr
    assert "encrypted checkpoint" in listed and "--key-env" in listed and listed.count("\n") == 1
    shown = json.loads(cli("inspect", str(ck), "--key-env", key_env, "--json").stdout)
    assert shown["encrypted"] is True and shown["format_version"] == "1.3"
    assert "encrypted   yes: AES-256-GCM" in cli("inspect", str(ck), "--key-env", key_env).stdout
    assert json.loads(cli("verify", str(ck), "--key-env", key_env, "--json").stdout)["ok"] is True
    assert len(json.loads(cli("ls", str(run), "--key-env", key_env, "--json").stdout)["checkpoints"]) == 3
    cli("diff", str(run / "step_00000001"), str(run / "step_00000002"), "--key-env", key_env, code=1)  # differ
    cli("pack", str(ck), str(tmp_path / "ck.tsar"), "--key-env", key_env)
    cli("consolidate", str(ck), str(tmp_path / "one"), "--key-env", key_env)
    cli(
        "average",
        str(run / "step_00000001"),
        str(run / "step_00000002"),
        "-o",
        str(tmp_path / "avg"),
        "--key-env",
        key_env,
    )
    cli("prune", str(run), "--keep-last", "2", "--key-env", key_env)
    cli("pin", str(run), "3", "--key-env", key_env)
    for out in (tmp_path / "ck.tsar", tmp_path / "one", tmp_path / "avg"):
        cli("inspect", str(out), code=2)
        cli("verify", str(out), "--key-env", key_env)
    assert [c.step for c in trainstate.CheckpointManager(run, read_only=True, key=KEY).list()] == [2, 3]

    wrong = cli("verify", str(ck), "--key-env", "NO_SUCH_VARIABLE_SET", code=2)
    assert "NO_SUCH_VARIABLE_SET is not set" in wrong.stderr


def test_cli_keygen_prints_a_key_that_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = cli("keygen").stdout.strip()
    assert len(key) == 64 and bytes.fromhex(key)
    assert json.loads(cli("keygen", "--json").stdout)["key"] != key
    monkeypatch.setenv("FRESH_KEY", key)
    trainstate.save(tmp_path / "c", _state(), key_env="FRESH_KEY")
    cli("verify", str(tmp_path / "c"), "--key-env", "FRESH_KEY")
    monkeypatch.setenv("FRESH_KEY", trainstate.generate_key())
    assert "another key" in cli("verify", str(tmp_path / "c"), "--key-env", "FRESH_KEY", code=2).stderr


def test_import_writes_encrypted_and_export_writes_plain(tmp_path: Path, key_env: str) -> None:
    src = tmp_path / "w.safetensors"
    save_file({"w": np.arange(4, dtype=np.float32)}, str(src))
    cli("import", str(src), str(tmp_path / "imp"), "--prefix", "model", "--key-env", key_env)
    cli("inspect", str(tmp_path / "imp"), code=2)
    trainstate.export(tmp_path / "imp", tmp_path / "out.safetensors", format="safetensors", key=KEY)
    # inference tools read plain files: export's output is not encrypted (docs/encryption.md)
    assert list(load_file(str(tmp_path / "out.safetensors"))) == ["w"]


def test_consolidate_rotates_the_key_and_the_result_restores_into_live_objects(
    tmp_path: Path, key_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    new = trainstate.generate_key()
    model = torch.nn.Linear(4, 3)
    with trainstate.CheckpointManager(tmp_path / "run", key=KEY) as mgr:
        mgr.save(7, {"model": model}, metrics={"loss": 0.5})
    trainstate.consolidate(tmp_path / "run" / "step_00000007", tmp_path / "rotated", key=KEY, new_key=new)
    fresh = torch.nn.Linear(4, 3)
    trainstate.load(tmp_path / "rotated", {"model": fresh}, key=new)  # still a model's state, not plain dicts
    assert torch.equal(fresh.weight, model.weight)
    with trainstate.open(tmp_path / "rotated", key=new) as ck:
        assert ck.metadata["trainstate"]["step"] == 7 and ck.metadata["trainstate"]["metrics"] == {"loss": 0.5}
    with pytest.raises(trainstate.WrongKeyError):
        trainstate.open(tmp_path / "rotated", key=KEY)
    monkeypatch.setenv("NEW_TEST_KEY", new)  # the command line, keys by variable name
    cli(
        "consolidate",
        str(tmp_path / "rotated"),
        str(tmp_path / "back"),
        "--key-env",
        "NEW_TEST_KEY",
        "--new-key-env",
        VAR,
    )
    trainstate.load(tmp_path / "back", {"model": fresh}, key=KEY)
