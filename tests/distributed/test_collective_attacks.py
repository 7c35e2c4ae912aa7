"""Attacks on collective saves with key= and incremental runs under a process group (gloo, CPU): ranks that
disagree on the key, crafted manifests of a sharded incremental checkpoint, states that change in ways a
dedupe could miss, retention with keep_last=1, single-process and collective saves taking turns in one run,
and a rank killed while it writes its pool files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_attacks as workers  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402
from helpers import reseal_manifest  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")

KEY = "5a" * 32
OTHER = "a5" * 32


def _encrypting() -> dict:
    pytest.importorskip("zstandard")
    pytest.importorskip("cryptography")
    return {"compression": "zstd", "key": KEY}


def _named(run: Path) -> set[str]:
    return {
        f["path"]
        for p in run.iterdir()
        if p.name.startswith("step_")
        for f in json.loads((p / "manifest.json").read_bytes())["files"]
        if f.get("pool")
    }


def _check(run: Path, plan: list[tuple[int, str]], key: str | None) -> None:
    """Every checkpoint of ``plan`` still in ``run`` verifies and holds its variant's values, bit for bit."""
    for step, variant in plan:
        path = run / f"step_{step:08d}"
        if not path.exists():
            continue
        with trainstate.open(str(path), key=key) as ck:
            ck.verify()
            for name, want in workers.whole(variant).items():
                got = np.asarray(ck.read(name))
                assert got.dtype == want.dtype and got.shape == want.shape, (step, variant, name)
                assert got.tobytes() == want.tobytes(), (step, variant, name)


@pytest.mark.parametrize("keys", [(KEY, OTHER), (KEY, None), (None, KEY)], ids=["other-key", "no-key-1", "no-key-0"])
def test_ranks_that_disagree_on_the_key_refuse_to_save_on_every_rank(tmp_path, keys):
    # each rank encrypts its own chunks: rank 0 used to commit rank 1's chunks under another key (a checkpoint
    # no key opens), or rank 1's plaintext chunks in an "encrypted" checkpoint that verified with the key
    pytest.importorskip("cryptography")
    path = tmp_path / "ck"
    errors = ranks.run(2, workers.save_keys, str(path), list(keys), timeout=60)
    assert all(isinstance(e, ranks.RankError) and e.kind == "DistributedError" for e in errors), errors
    assert all("same key" in e.message for e in errors), errors
    assert not path.exists()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_manager_whose_ranks_hold_different_keys_refuses_its_first_save(tmp_path, async_save):
    pytest.importorskip("cryptography")
    run = tmp_path / "run"
    errors = ranks.run(2, workers.manager_keys, str(run), [KEY, OTHER], async_save, timeout=60)
    assert all(isinstance(e, ranks.RankError) and "same key" in e.message for e in errors), errors
    assert not [p for p in run.iterdir() if p.name.startswith("step_")]


@pytest.mark.parametrize("features", ["plain", "zstd+key"])
def test_a_dedupe_never_shares_bytes_that_changed_in_their_last_bytes_dtype_shape_or_sharding(tmp_path, features):
    options = {} if features == "plain" else _encrypting()
    run = tmp_path / "run"
    plan = [(1, "base"), (2, "tail"), (3, "base"), (4, "dtype"), (5, "base"), (6, "shard1"), (7, "shape"), (8, "head")]
    written = ranks.ok(ranks.run(2, workers.saves, str(run), plan, options))[0]
    assert written[3] < 0.6 * written[1] and written[5] < 0.7 * written[1], written  # it does share
    _check(run, plan, options.get("key"))
    # another world size: the 2-rank slabs tile some of the 3-rank boxes, partly overlap the others
    more = [(9, "tail"), (10, "base"), (11, "shard1")]
    ranks.ok(ranks.run(3, workers.saves, str(run), more, options))
    _check(run, more, options.get("key"))
    for at, step, variant in ((2, 10, "base"), (3, 11, "shard1")):
        got = ranks.ok(ranks.run(at, workers.load, str(run / f"step_{step:08d}"), variant, options.get("key")))
        want = workers.whole(variant)
        assert all(g[k].tobytes() == want[k].tobytes() for g in got for k in want), (at, step)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("crafted") / "run"
    ranks.ok(ranks.run(2, workers.saves, str(run), [(1, "base"), (2, "tail")], {}))
    return run


def _rename_first_file(to: str):
    def edit(body: dict) -> None:
        old = body["files"][0]["path"]
        body["files"][0]["path"] = to
        for t in body["tensors"].values():
            for c in t["chunks"]:
                if c["file"] == old:
                    c["file"] = to

    return edit


def _swap_chunks(body: dict) -> None:  # rank 0's box of w read from rank 1's bytes
    a, b = body["tensors"]["w"]["chunks"][:2]
    a["file"], b["file"], a["byte_range"], b["byte_range"] = b["file"], a["file"], b["byte_range"], a["byte_range"]


CRAFTED = {
    "outside-the-pool": (_rename_first_file("../step_00000001/manifest.json"), "illegal data file"),
    "dots-in-a-pool-name": (_rename_first_file("pool-..-r00000-00000.safetensors"), "missing from the shared pool"),
    "listed-twice-other-size": (
        lambda b: b["files"].append({**b["files"][0], "size": b["files"][0]["size"] + 100}),
        "twice",
    ),
    "listed-twice": (lambda b: b["files"].append(dict(b["files"][0])), "twice"),
    "huge-size": (lambda b: b["files"][0].update(size=2**60), "truncated or altered"),
    "not-pool": (lambda b: [f.pop("pool", None) for f in b["files"]], "missing"),
    "chunk-moved-between-ranks": (_swap_chunks, "checksum mismatch"),
}


@pytest.mark.parametrize("attack", sorted(CRAFTED))
def test_a_crafted_manifest_of_a_sharded_incremental_checkpoint_is_refused_clearly(tmp_path, sharded_run, attack):
    edit, match = CRAFTED[attack]
    run = tmp_path / "run"
    shutil.copytree(sharded_run, run)
    path = run / "step_00000002"
    reseal_manifest(path, edit, layout=True)
    target = {"w": np.zeros((64, 48), np.float32), "r": np.zeros(3000, np.float32)}
    with pytest.raises(trainstate.CorruptCheckpointError, match=match):
        trainstate.load(str(path), target)
    with pytest.raises(trainstate.CorruptCheckpointError, match=match):
        with trainstate.open(str(path)) as ck:
            ck.verify()


@pytest.mark.parametrize("features", ["plain", "zstd+key"])
def test_keep_last_1_with_async_saves_and_a_change_of_world_size_keeps_only_what_the_newest_names(tmp_path, features):
    options = {} if features == "plain" else _encrypting()
    run = tmp_path / "run"
    plan = [(1, "base"), (2, "tail"), (3, "base"), (4, "dtype"), (5, "head"), (6, "base")]
    ranks.ok(ranks.run(2, workers.saves, str(run), plan, {**options, "keep_last": 1, "async_save": True}))
    assert [p.name for p in run.iterdir() if p.name.startswith("step_")] == ["step_00000006"]
    assert {p.name for p in (run / "_shared").iterdir()} == _named(run)
    _check(run, plan, options.get("key"))
    more = [(7, "tail"), (8, "base")]
    ranks.ok(ranks.run(3, workers.saves, str(run), more, {**options, "keep_last": 1, "async_save": True}))
    assert {p.name for p in (run / "_shared").iterdir()} == _named(run)
    _check(run, more, options.get("key"))


@pytest.mark.parametrize("features", ["plain", "zstd"])
def test_single_process_and_two_rank_managers_take_turns_in_one_run(tmp_path, features):
    options = {} if features == "plain" else {"compression": pytest.importorskip("zstandard") and "zstd"}
    run = tmp_path / "run"
    workers.single_saves(str(run), [(1, "base"), (2, "tail")], options)
    ranks.ok(ranks.run(2, workers.saves, str(run), [(3, "tail"), (4, "base")], options))
    workers.single_saves(str(run), [(5, "base"), (6, "head")], options)
    ranks.ok(ranks.run(2, workers.saves, str(run), [(7, "head"), (8, "tail")], {**options, "keep_last": 1}))
    _check(run, [(8, "tail")], None)
    assert {p.name for p in (run / "_shared").iterdir()} == _named(run)


def test_a_rank_killed_after_writing_its_pool_files_commits_nothing_and_the_next_job_collects_them(tmp_path):
    run = tmp_path / "run"
    out = ranks.run(2, workers.killed_writing, str(run), [(1, "base"), (2, "tail"), (3, "head")], {}, timeout=120)
    assert out[1] == "exit code -9" and isinstance(out[0], ranks.RankError), out
    assert out[0].kind == "DistributedError", out
    assert not (run / "step_00000003").exists()
    assert {p.name for p in (run / "_shared").iterdir()} - _named(run)  # the dead save's files, unnamed
    ranks.ok(ranks.run(2, workers.saves, str(run), [(4, "tail"), (5, "base")], {}))
    _check(run, [(1, "base"), (2, "tail"), (4, "tail"), (5, "base")], None)
    assert {p.name for p in (run / "_shared").iterdir()} == _named(run)


def test_a_resume_on_three_ranks_right_after_a_damaged_pool_file_falls_back_and_never_names_it(tmp_path):
    import dist_workers_incremental as incremental

    run = tmp_path / "run"
    ranks.ok(ranks.run(2, incremental.run, str(run), {}, [0, 1, 2, 3]))
    newest = sorted(p for p in run.iterdir() if p.name.startswith("step_"))[-1]
    body = json.loads((newest / "manifest.json").read_bytes())
    victim = run / "_shared" / next(c["file"] for c in body["tensors"]["moving"]["chunks"] if "-r00001-" in c["file"])
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0x10
    victim.write_bytes(bytes(raw))
    out = ranks.ok(ranks.run(3, incremental.run, str(run), {}, [3, 4]))
    for got in out:
        assert got["resumed"] == 3 and all(
            np.array_equal(got["restored"][k], v) for k, v in incremental.whole(2).items()
        )
    fresh = sorted(p for p in run.iterdir() if p.name.startswith("step_"))[-1]
    assert victim.name not in {f["path"] for f in json.loads((fresh / "manifest.json").read_bytes())["files"]}
    got = ranks.ok(ranks.run(2, incremental.load, str(fresh), None))
    assert all(np.array_equal(g[k], v) for g in got for k, v in incremental.whole(4).items())


def test_a_pool_file_swapped_in_from_another_run_under_the_same_key_is_refused(tmp_path):
    options = _encrypting()
    first, second = tmp_path / "a", tmp_path / "b"
    for run in (first, second):  # two runs of the same state under the same key
        ranks.ok(ranks.run(2, workers.saves, str(run), [(1, "base")], options))
    mine = sorted((first / "_shared").iterdir())
    theirs = sorted((second / "_shared").iterdir())
    victim = next(p for p in mine if "-r00001-" in p.name)
    donor = next(p for p in theirs if "-r00001-" in p.name and p.stat().st_size == victim.stat().st_size)
    shutil.copyfile(donor, victim)
    path = first / "step_00000001"
    target = {"w": np.zeros((64, 48), np.float32), "r": np.zeros(3000, np.float32)}
    with pytest.raises(trainstate.CorruptCheckpointError, match=victim.name):
        trainstate.load(str(path), target, key=KEY)
    with pytest.raises(trainstate.CorruptCheckpointError), trainstate.open(str(path), key=KEY) as ck:
        ck.verify()
    errors = ranks.run(2, workers.load, str(path), "base", KEY)
    assert all(isinstance(e, ranks.RankError) and "Checkpoint" in e.kind for e in errors), errors


def test_a_reader_refuses_plaintext_chunks_in_an_encrypted_checkpoint(tmp_path):
    pytest.importorskip("cryptography")
    path = tmp_path / "ck"
    ranks.ok(ranks.run(2, workers.save_keys_unchecked, str(path), [KEY, None]))
    body = json.loads((path / "manifest.json").read_bytes())
    assert body["encryption"] and any(not c.get("transforms") for c in body["tensors"]["w"]["chunks"])
    # written by a writer without the key comparison (this one before it): refused, never read as plaintext
    with (
        pytest.raises(trainstate.CorruptCheckpointError, match="not encrypted"),
        trainstate.open(str(path), key=KEY) as ck,
    ):
        ck.verify()
    target = {"w": np.zeros((64, 48), np.float32), "r": np.zeros(3000, np.float32)}
    with pytest.raises(trainstate.CorruptCheckpointError, match="not encrypted"):
        trainstate.load(str(path), target, key=KEY)


@pytest.mark.parametrize("features", ["plain", "zstd+key"])
def test_pool_files_deleted_by_hand_between_two_saves_of_a_running_job_are_written_again(tmp_path, features):
    options = {} if features == "plain" else _encrypting()
    run = tmp_path / "run"
    gone = ranks.ok(ranks.run(2, workers.deleted_between_saves, str(run), options))[0]
    assert gone
    for step in (2, 3):
        files = {f["path"] for f in json.loads((run / f"step_{step:08d}" / "manifest.json").read_bytes())["files"]}
        assert not files & set(gone), step
    _check(run, [(2, "base"), (3, "tail")], options.get("key"))
    with (
        pytest.raises(trainstate.CorruptCheckpointError),
        trainstate.open(str(run / "step_00000001"), key=options.get("key")) as ck,
    ):
        ck.verify()
