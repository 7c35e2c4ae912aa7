"""Encrypted collective saves on real gloo process groups: each rank encrypts its own chunks, rank 0
authenticates the one manifest, and no nonce repeats anywhere in the job."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")
pytest.importorskip("cryptography")
pytest.importorskip("zstandard")

import dist_workers_zstd as workers  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")

KEY = "3c" * 32
OTHER = "c3" * 32


def _chunks(path) -> list[dict]:
    body = json.loads((path / "manifest.json").read_bytes())
    return [dict(c, tensor=n) for n, t in body["tensors"].items() for c in t["chunks"]]


def _nonces(path) -> list[str]:
    return [s["nonce"] for c in _chunks(path) for s in c.get("transforms", ()) if s["name"] == "aes-256-gcm"]


def _same(got: dict, want: dict) -> bool:
    return all(np.array_equal(got[k], want[k]) for k in ("rows", "columns", "table", "noise"))


@pytest.mark.parametrize("compression", ["zstd", None])
def test_four_ranks_encrypt_their_own_chunks_under_nonces_unique_job_wide_and_any_world_size_restores(
    tmp_path, compression
):
    first, second = tmp_path / "a", tmp_path / "b"
    ranks.ok(ranks.run(4, workers.save, str(first), compression, KEY))
    ranks.ok(ranks.run(4, workers.save, str(second), compression, KEY))  # the same job saving again
    body = json.loads((first / "manifest.json").read_bytes())
    assert body["world_size"] == 4 and body["encryption"]["algorithm"]
    chunks = _chunks(first)
    # every chunk encrypted (compression first where it paid), and every rank wrote some of them
    assert all(c["transforms"][-1]["name"] == "aes-256-gcm" for c in chunks)
    assert {c["file"].split("-")[1] for c in chunks if c["tensor"] == "rows"} == {f"r{r:05d}" for r in range(4)}
    if compression:
        assert any(len(c["transforms"]) == 2 and c["transforms"][0]["name"] == "zstd" for c in chunks)
    # every rank seeded Python, NumPy and torch alike: the nonces still never repeat, in one save or two
    nonces = _nonces(first) + _nonces(second)
    assert len(nonces) == len(chunks) * 2 > 30
    assert len(set(nonces)) == len(nonces)
    # one salt per manifest
    salts = {json.loads((p / "manifest.json").read_bytes())["encryption"]["salt"] for p in (first, second)}
    assert len(salts) == 2

    want = workers.whole()
    for at in (4, 3, 1):
        got = ranks.ok(ranks.run(at, workers.load, str(first), KEY))
        assert all(_same(g, want) and g["step"] == 3 for g in got), at
    with trainstate.open(str(first), key=KEY) as ck:
        ck.verify()
        assert np.array_equal(ck.read("rows"), want["rows"])
    # the data files hold no plaintext: the replicated table's bytes appear nowhere
    stored = b"".join(p.read_bytes() for p in first.iterdir() if p.name.endswith(".safetensors"))
    assert want["table"][0].tobytes() not in stored


def test_no_key_or_a_wrong_key_is_refused_on_every_rank(tmp_path):
    path = tmp_path / "k"
    ranks.ok(ranks.run(2, workers.save, str(path), "zstd", KEY))
    for key, kind in ((None, "KeyRequiredError"), (OTHER, "WrongKeyError")):
        errors = ranks.run(2, workers.load_error, str(path), key)
        assert all(isinstance(e, tuple) and e[0] == kind for e in errors), (key, errors)


def test_a_chunk_written_by_rank_1_and_altered_fails_authentication_on_load_and_verify(tmp_path):
    path = tmp_path / "t"
    ranks.ok(ranks.run(2, workers.save, str(path), None, KEY))
    victim = next(c for c in _chunks(path) if c["file"].startswith("data-r00001-") and c["tensor"] == "rows")
    data = path / victim["file"]
    raw = bytearray(data.read_bytes())
    begin, end = victim["byte_range"]
    raw[(begin + end) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with trainstate.open(str(path), key=KEY) as ck, pytest.raises(trainstate.CorruptCheckpointError):
        ck.verify()
    errors = ranks.run(2, workers.load_error, str(path), KEY)
    assert any(isinstance(e, tuple) and e[0] in ("TamperedCheckpointError", "CorruptCheckpointError") for e in errors)
    assert all(e is None or (isinstance(e, tuple) and "Checkpoint" in e[0]) for e in errors), errors


@pytest.mark.parametrize(("async_save", "compression"), [(True, "zstd"), (False, None)])
def test_the_manager_saves_encrypted_under_two_ranks_and_restore_latest_resumes(tmp_path, async_save, compression):
    run = tmp_path / "run"
    got = ranks.ok(ranks.run(2, workers.manager, str(run), async_save, compression, KEY))
    want = workers.whole()
    want["table"] = want["table"] + 4
    for g in got:
        assert g["listed"] == [2, 4] and g["start"] == 5
        assert _same(g, want)
    kept = sorted(p for p in run.iterdir() if p.name.startswith("step"))
    nonces = [n for p in kept for n in _nonces(p)]
    assert len(kept) == 2 and len(nonces) > 20 and len(set(nonces)) == len(nonces)
    errors = ranks.run(2, workers.manager_resume_error, str(run), OTHER)
    assert all(isinstance(e, tuple) and e[0] == "WrongKeyError" for e in errors), errors


def test_rank_0_refuses_to_commit_chunks_that_share_a_nonce(tmp_path):
    errors = ranks.run(2, workers.save_broken_nonces, str(tmp_path / "n"))
    assert all(isinstance(e, tuple) and "same nonce" in e[1] for e in errors), errors
    assert not (tmp_path / "n").exists()
