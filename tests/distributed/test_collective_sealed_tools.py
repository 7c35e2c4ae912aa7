"""Issue 28 (must-have 3): consolidate, export, verify, inspect, diff and average on checkpoints 2 gloo ranks
saved encrypted (zstd + key, sharded) and on the newest checkpoints of an incremental 2-rank run (plain, and
zstd + key; their data in the run's pool), all run in this one plain process (no process group), the key and
the pool found as they are for a checkpoint one process saved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")
pytest.importorskip("zstandard")
pytest.importorskip("cryptography")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import dist_workers_incremental as incremental  # noqa: E402
import dist_workers_zstd as sharded  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402
from helpers import cli  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")
WORLD = 2
KEY = "5e" * 32
ENV = "TRAINSTATE_TEST_SEALED_KEY"
SEALED = {"compression": "zstd", "key": KEY}


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An encrypted, compressed checkpoint 2 ranks saved: rows / columns sharded, the rest replicated."""
    path = tmp_path_factory.mktemp("sealed") / "ckpt"
    ranks.ok(ranks.run(WORLD, sharded.save, str(path), "zstd", KEY))
    body = _body(path)
    assert body["world_size"] == WORLD and body["encryption"]
    assert len(body["tensors"]["rows"]["chunks"]) > WORLD
    return path


@pytest.fixture(scope="module", params=["plain", "zstd+key"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """An incremental run 2 ranks saved at steps 0..3 (keeping steps 2 and 3), and its options."""
    options = {} if request.param == "plain" else SEALED
    path = tmp_path_factory.mktemp("incremental") / "run"
    ranks.ok(ranks.run(WORLD, incremental.run, str(path), options, [0, 1, 2, 3]))
    assert [p.name for p in _kept(path)] == ["step_00000002", "step_00000003"]
    assert all(f["pool"] for p in _kept(path) for f in _body(p)["files"])
    return path, options


@pytest.fixture
def key_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(ENV, KEY)
    return ENV


def _body(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_bytes())


def _kept(run: Path) -> list[Path]:
    return sorted(p for p in run.iterdir() if p.name.startswith("step_"))


def _read(path: Path, names: Any, key: str | None) -> dict[str, np.ndarray]:
    with trainstate.open(str(path), key=key) as ck:
        return {k: np.asarray(ck.read(k)) for k in names}


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k


def _encrypted(path: Path) -> bool:
    body = _body(path)
    chunks = [c for t in body["tensors"].values() for c in t["chunks"]]
    sealed = [c.get("transforms") and c["transforms"][-1]["name"] == "aes-256-gcm" for c in chunks]
    assert all(sealed) or not any(sealed), sealed
    return bool(body.get("encryption")) and all(sealed)


def _key_args(options: dict[str, Any], env: str) -> list[str]:
    return ["--key-env", env] if options.get("key") else []


def _no_key(*args: str) -> None:
    """``trainstate ARGS`` on an encrypted checkpoint without the key: exit 2 and a line that says so."""
    proc = cli(*args, code=2)  # cli() asserts there is no traceback
    assert "key" in proc.stderr.lower(), proc.stderr
    assert KEY not in proc.stderr + proc.stdout


# consolidate


@pytest.mark.parametrize("command_line", [False, True])
def test_consolidate_an_encrypted_sharded_checkpoint_writes_one_encrypted_with_the_same_key(
    sealed, tmp_path, key_env, command_line
):
    dst = tmp_path / "one"
    if command_line:
        cli("consolidate", str(sealed), str(dst), "--key-env", key_env, "--compression", "zstd")
    else:
        trainstate.consolidate(sealed, dst, key=KEY, compression="zstd")
    assert _body(dst).get("world_size", 1) == 1
    assert _encrypted(dst)  # docs/encryption.md: consolidate with a key writes encrypted output, same key
    with pytest.raises(trainstate.KeyRequiredError):
        trainstate.load(str(dst))
    with pytest.raises(trainstate.WrongKeyError):
        trainstate.load(str(dst), key="a1" * 32)
    _same(_read(dst, sharded.whole(), KEY), sharded.whole())
    back = trainstate.load(str(dst), key=KEY)
    assert back["step"] == 3
    for k, v in sharded.whole().items():
        assert np.asarray(back[k]).tobytes() == v.tobytes(), k
    cli("verify", str(dst), "--key-env", key_env)
    cli("diff", str(sealed), str(dst), "--key-env", key_env)  # the same values as the sharded original


def test_consolidate_without_the_key_is_a_clear_error(sealed, tmp_path):
    with pytest.raises(trainstate.KeyRequiredError):
        trainstate.consolidate(sealed, tmp_path / "api")
    _no_key("consolidate", str(sealed), str(tmp_path / "cli"))
    assert not (tmp_path / "api" / "manifest.json").exists() and not (tmp_path / "cli" / "manifest.json").exists()


@pytest.mark.parametrize("command_line", [False, True])
def test_consolidate_the_newest_incremental_checkpoint_writes_one_that_stands_alone(
    run, tmp_path, key_env, command_line
):
    path, options = run
    newest = _kept(path)[-1]
    dst = tmp_path / "one"
    key = options.get("key")
    if command_line:  # and rank 1's per-rank values (the RNG states the manager captured on each rank)
        cli("consolidate", str(newest), str(dst), "--rank", "1", *_key_args(options, key_env))
    else:
        trainstate.consolidate(newest, dst, key=key)
    with trainstate.open(str(newest), key=key) as ck, trainstate.open(str(dst), key=key) as one:
        rng = np.asarray(one.read("_rng.torch"))
        assert rng.tobytes() == np.asarray(ck.read(f"_rng.{int(command_line)}.torch")).tobytes()
    cli("diff", str(newest), str(dst), "--exclude", "_rng", *_key_args(options, key_env))
    body = _body(dst)
    assert body.get("world_size", 1) == 1
    assert not any(f.get("pool") for f in body.get("files", [])), body.get("files")
    assert _encrypted(dst) == bool(key)
    # away from the run (no pool beside it), it reads on its own
    away = tmp_path / "elsewhere" / "copy"
    shutil.copytree(dst, away)
    assert not (away.parent / "_shared").exists()
    want = incremental.whole(3)
    _same(_read(away, incremental.NAMES, key), want)
    back = trainstate.load(str(away), key=key)
    assert back["step"] == 3
    for k, v in want.items():
        assert np.asarray(back[k]).tobytes() == v.tobytes(), k
    with trainstate.open(str(away), key=key) as ck:
        ck.verify()
    cli("verify", str(away), *_key_args(options, key_env))


# export


def _sources(sealed: Path, run: tuple[Path, dict[str, Any]]) -> list[tuple[Path, str | None, dict[str, np.ndarray]]]:
    path, options = run
    return [(sealed, KEY, sharded.whole()), (_kept(path)[-1], options.get("key"), incremental.whole(3))]


@pytest.mark.parametrize("command_line", [False, True])
def test_export_to_safetensors_holds_the_saved_tensors(sealed, run, tmp_path, key_env, command_line):
    for i, (src, key, want) in enumerate(_sources(sealed, run)):
        out = tmp_path / f"model{i}.safetensors"
        if command_line:
            keys = ["--key-env", key_env] if key else []
            cli("export", str(src), str(out), "--format", "safetensors", "--select", "*", *keys)
        else:
            trainstate.export(src, out, format="safetensors", select="*", key=key)
        got = safetensors_numpy.load_file(str(out))  # plain: safetensors has no encryption
        # and the RNG states the manager captured on each rank (numeric arrays too)
        assert set(want) <= set(got) and all(k.startswith("_rng.") for k in set(got) - set(want)), set(got)
        _same(got, want)
        if key:
            _no_key("export", str(src), str(tmp_path / f"nokey{i}.safetensors"), "--format", "safetensors")


# verify, inspect


def test_verify_and_inspect_on_the_command_line(sealed, run, key_env, monkeypatch):
    monkeypatch.setenv("TRAINSTATE_TEST_OTHER_KEY", "a1" * 32)
    for src, key, want in _sources(sealed, run):
        keys = ["--key-env", key_env] if key else []
        cli("verify", str(src), *keys)
        assert json.loads(cli("verify", str(src), "--json", *keys).stdout)
        text = cli("inspect", str(src), *keys).stdout
        assert f"{WORLD} ranks" in text and all(k in text for k in want)
        doc = json.loads(cli("inspect", str(src), "--json", *keys).stdout)
        assert doc["world_size"] == WORLD
        names = {t["key"] if "key" in t else t.get("name") for t in doc["tensors"]}
        assert set(want) <= names, doc["tensors"]
        if key:
            _no_key("verify", str(src))
            _no_key("inspect", str(src))
            proc = cli("verify", str(src), "--key-env", "TRAINSTATE_TEST_OTHER_KEY", code=2)
            assert "another key" in proc.stderr, proc.stderr


# diff


def test_diff_of_two_steps_of_an_incremental_run_names_the_tensors_that_changed(run, key_env):
    path, options = run
    old, new = (str(p) for p in _kept(path))
    keys = _key_args(options, key_env)
    cli("diff", new, new, *keys)
    doc = json.loads(cli("diff", old, new, "--json", *keys, code=1).stdout)
    said = json.dumps(doc)
    assert "moving" in said and "bias" in said and "step" in said
    assert "base" not in said and "table" not in said, said  # frozen: shared through the pool
    if options.get("key"):
        _no_key("diff", old, new)


# average


def test_average_of_two_encrypted_sharded_checkpoints_is_their_mean(tmp_path, key_env):
    a, b = tmp_path / "a", tmp_path / "b"
    ranks.ok(ranks.run(WORLD, sharded.save_scaled, str(a), 1.0, KEY))
    ranks.ok(ranks.run(WORLD, sharded.save_scaled, str(b), 3.0, KEY))
    trainstate.average([a, b], tmp_path / "api", key=KEY)
    cli("average", str(a), str(b), "-o", str(tmp_path / "cli"), "--key-env", key_env)
    _no_key("average", str(a), str(b), "-o", str(tmp_path / "nokey"))
    want = sharded.whole()
    for out in (tmp_path / "api", tmp_path / "cli"):
        assert _encrypted(out)
        got = _read(out, want, KEY)
        for k in ("rows", "columns", "table"):
            assert got[k].tobytes() == (want[k] * 2.0).tobytes(), k
        for k in ("noise", "small"):
            assert got[k].tobytes() == want[k].tobytes(), k
        back = trainstate.load(str(out), key=KEY)  # one process: rank 0's per-rank values, averaged where floating
        assert back["mine"]["rank"] == 0 and back["step"] == 3
        assert np.asarray(back["mine"]["moment"]).tolist() == [2.0] * 4
        cli("verify", str(out), "--key-env", key_env)


def test_average_of_two_steps_of_an_incremental_run_is_their_mean(run, tmp_path, key_env):
    path, options = run
    old, new = _kept(path)
    trainstate.average([old, new], tmp_path / "api", key=options.get("key"))
    cli("average", str(old), str(new), "-o", str(tmp_path / "cli"), *_key_args(options, key_env))
    mean = {
        k: ((incremental.whole(2)[k] + incremental.whole(3)[k]) / 2).astype(v.dtype)
        for k, v in incremental.whole(3).items()
    }
    assert mean["moving"][0, 0] == 2.5 and mean["bias"][0] == 2.5
    for out in (tmp_path / "api", tmp_path / "cli"):
        assert not any(f.get("pool") for f in _body(out).get("files", []))
        assert _encrypted(out) == bool(options.get("key"))
        _same(_read(out, incremental.NAMES, options.get("key")), mean)
        assert trainstate.load(str(out), key=options.get("key"))["step"] == 3
        cli("verify", str(out), *_key_args(options, key_env))
