"""The local tier (``CheckpointManager(..., local=LocalTier(...))``) in one process: a checkpoint every few steps on
a fast local path behind the durable ones; a resume takes the newest of either tier that restores.

The training script is killed for real (SIGKILL) between two durable saves, restarted at once, and must continue
from the newest local step bit-identically; a damaged local copy falls back to the one before it, then to the
durable tier; a kill in the middle of a local save never restores a torn or mixed state."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import trainstate

torch = pytest.importorskip("torch")

RECIPE = Path(__file__).parents[1] / "resume_recipe.py"


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RECIPE), *args], capture_output=True, text=True, timeout=300)


def _assert_same(a: dict, b: dict) -> None:
    for (ka, va), (kb, vb) in zip(sorted(a.items()), sorted(b.items())):
        assert ka == kb
        if isinstance(va, dict):
            _assert_same(va, vb)
        elif hasattr(va, "shape"):
            assert np.array_equal(np.asarray(va), np.asarray(vb)), ka
        else:
            assert va == vb, ka


def _flip_a_byte(checkpoint: Path) -> None:
    data = max((p for p in checkpoint.iterdir() if p.name.startswith("data")), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))


def test_a_job_sigkilled_between_durable_saves_resumes_from_the_newest_local_step_bit_identically(tmp_path):
    flags = ["--loader", "sampler", "--steps", "30", "--every", "10", "--augment", "--workers", "1"]
    ref = _run([str(tmp_path / "ref"), *flags])
    assert ref.returncode == 0, ref.stderr
    local = ["--local", str(tmp_path / "shm" / "run")]
    killed = _run([str(tmp_path / "run"), *flags, *local, "--kill-at", "17"])  # durable saves: steps 0 and 10
    assert killed.returncode == -signal.SIGKILL
    resumed = _run([str(tmp_path / "run"), *flags, *local])
    assert resumed.returncode == 0, resumed.stderr
    start = int(resumed.stdout.split("start ")[1].split()[0])
    # step 17's local save may have been in flight at the kill: the newest committed local step is 16 or 17
    assert start in (17, 18), start
    _assert_same(trainstate.load(tmp_path / "ref" / "final"), trainstate.load(tmp_path / "run" / "final"))


def _manager(tmp_path: Path, **local: object) -> trainstate.CheckpointManager:
    tier = trainstate.LocalTier(tmp_path / "shm", **local)  # type: ignore[arg-type]
    return trainstate.CheckpointManager(tmp_path / "durable", every_steps=5, keep_last=2, local=tier)


def _train(mgr: trainstate.CheckpointManager, state: dict, steps: range) -> None:
    for step in steps:
        state["w"] += 1.0
        state["step"] = step
        mgr.save(step, state)
        mgr._local.inner.wait()  # noqa: SLF001 - each local save committed before the next (no skip)


def test_the_local_tier_saves_between_durable_ones_keeps_its_newest_and_resumes_from_them(tmp_path):
    state = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path, every_steps=2, keep=2) as mgr:
        _train(mgr, state, range(12))
        reasons = {r.step: r.reason for r in mgr.history()}
    assert reasons == {
        **{s: "every 5 steps" for s in (0, 5, 10)},
        **{s: "local tier: every 2 steps" for s in (2, 4, 6, 8)},
    }
    durable = sorted(p.name for p in (tmp_path / "durable").glob("step_*"))
    local = sorted(p.name for p in (tmp_path / "shm" / "w1" / "rank00000").glob("step_*"))
    assert durable == ["step_00000005", "step_00000010"]
    assert local == ["step_00000006", "step_00000008"]  # 10 is durable: not written twice; 0, 2, 4 pruned
    restored = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path, every_steps=2) as mgr:
        assert mgr.restore_latest(restored) == 11  # the durable tier's 10 is the newest
    _train_more = {"w": restored["w"].copy(), "step": 10}
    with _manager(tmp_path, every_steps=2) as mgr:
        _train(mgr, _train_more, range(11, 13))  # 12: local
    with _manager(tmp_path, every_steps=2) as mgr:
        assert mgr.restore_latest(restored) == 13 and restored["step"] == 12
        assert restored["w"][0] == 13.0  # the local checkpoint's values (w counts the steps trained)


def test_a_damaged_local_copy_falls_back_to_the_one_before_then_to_the_durable_tier(tmp_path):
    state = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path, every_steps=1, keep=2) as mgr:
        _train(mgr, state, range(8))  # durable 0, 5; local 6, 7
    shm = tmp_path / "shm" / "w1" / "rank00000"
    _flip_a_byte(shm / "step_00000007")
    restored = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(restored) == 7 and restored["step"] == 6
    _flip_a_byte(shm / "step_00000006")
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(restored) == 6 and restored["step"] == 5
        assert restored["w"][0] == 6.0


def test_a_damaged_newest_durable_checkpoint_is_passed_for_a_local_one_older_than_it(tmp_path):
    state = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path, every_steps=1, keep=3) as mgr:
        _train(mgr, state, range(11))  # durable 0, 5, 10; local 7, 8, 9
    _flip_a_byte(tmp_path / "durable" / "step_00000010")
    restored = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(restored) == 10 and restored["step"] == 9


CHILD = r"""
import sys, numpy as np, trainstate
durable, shm = sys.argv[1], sys.argv[2]
mgr = trainstate.CheckpointManager(durable, every_steps=50, keep_last=1,
                                   local=trainstate.LocalTier(shm, every_steps=1, keep=2))
state = {"a": np.full((512, 1024), -1, np.float32), "b": np.full(300_000, -1, np.int64), "step": -1}
start = mgr.restore_latest(state) or 0
assert (state["a"] == state["step"]).all() and (state["b"] == state["step"]).all(), "a mixed restore"
print("start", start, flush=True)
for step in range(start, 10**6):
    state["a"][:] = step
    state["b"][:] = step
    state["step"] = step
    mgr.save(step, state)
    print(step, flush=True)
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_in_the_middle_of_local_saves_never_restores_a_torn_or_mixed_state(tmp_path, seed):
    """A child saves a 5 MB state locally at every step and is killed at a random moment, three times; each
    restart restores one step's values throughout, no older than the step before the last one it printed, and
    carries on."""
    rng = random.Random(seed)
    durable, shm = tmp_path / "durable", tmp_path / "shm"
    last_printed = -1
    for _ in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(durable), str(shm)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert child.stdout is not None
        first = child.stdout.readline().decode()
        assert first.startswith("start "), first + child.stderr.read().decode()
        start = int(first.split()[1])
        # step N printed: save(N) returned, after the local save of N - 1 committed (or the durable one of N)
        assert start >= last_printed, (start, last_printed)
        for _ in range(rng.randint(3, 15)):
            line = child.stdout.readline()
            if line:
                last_printed = int(line)
        time.sleep(rng.random() * 0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        child.stderr.close()
    # what is committed loads whole: every local checkpoint holds one step's values
    for checkpoint in (shm / "w1" / "rank00000").glob("step_*"):
        loaded = trainstate.load(checkpoint)
        step = loaded["step"]
        assert checkpoint.name == f"step_{step:08d}"
        assert (loaded["a"] == step).all() and (loaded["b"] == step).all()


def test_a_state_over_the_budget_is_refused_at_the_first_local_save(tmp_path):
    state = {"w": np.zeros(250_000, dtype=np.float32)}  # 1 MB
    with _manager(tmp_path, budget_bytes=2_000_000, keep=2) as mgr:
        with pytest.raises(trainstate.StorageError, match="budget_bytes of 2,000,000"):
            mgr.save(1, state)


def test_a_local_path_another_run_holds_or_inside_the_durable_directory_is_refused(tmp_path):
    with _manager(tmp_path):
        pass
    tier = trainstate.LocalTier(tmp_path / "shm")
    with pytest.raises(trainstate.InvalidArgumentError, match="holds the local checkpoints of the run in"):
        trainstate.CheckpointManager(tmp_path / "other", local=tier)
    inside = trainstate.LocalTier(tmp_path / "durable" / "local")
    with pytest.raises(trainstate.InvalidArgumentError, match="inside one another"):
        trainstate.CheckpointManager(tmp_path / "durable", local=inside)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"path": "s3://bucket/x"}, "local directory"),
        ({"path": "x", "every_steps": 0}, "every_steps"),
        ({"path": "x", "keep": 0}, "keep"),
        ({"path": "x", "replicas": -1}, "replicas"),
        ({"path": "x", "budget_bytes": 0}, "budget_bytes"),
    ],
)
def test_wrong_local_tier_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(trainstate.InvalidArgumentError, match=match):
        trainstate.LocalTier(**kwargs)


def test_local_takes_a_local_tier(tmp_path):
    with pytest.raises(trainstate.InvalidArgumentError, match="takes a trainstate.LocalTier"):
        trainstate.CheckpointManager(tmp_path / "d", local=str(tmp_path / "shm"))  # type: ignore[arg-type]


def test_trainstate_ls_of_the_local_path_shows_its_checkpoints_and_the_filesystem_they_fill(tmp_path):
    import json

    from helpers import cli

    state = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path, every_steps=1, keep=2) as mgr:
        _train(mgr, state, range(4))  # local 2, 3
    shown = cli("ls", str(tmp_path / "shm")).stdout
    assert "local tier in" in shown and "step_00000003" in shown and "free of" in shown, shown
    listed = json.loads(cli("ls", "--json", str(tmp_path / "shm")).stdout)
    assert listed["kind"] == "local tier" and listed["durable"] == str((tmp_path / "durable").absolute())
    steps = [r["step"] for r in listed["folders"]["w1/rank00000"]]
    assert steps == [2, 3] and listed["held_nbytes"] > 8000 and listed["filesystem"]["free_nbytes"] > 0


def _torch_run(tmp_path: Path, copy_behind: bool, steps: int = 6) -> tuple[dict, list[dict]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim}
    tier = trainstate.LocalTier(tmp_path / "shm", every_steps=1, keep=steps, copy_behind=copy_behind)
    seen = []
    with trainstate.CheckpointManager(tmp_path / "durable", every_steps=100, local=tier) as mgr:
        for step in range(1, steps + 1):
            model(torch.randn(8, 64)).square().mean().backward()
            optim.step()
            optim.zero_grad()
            mgr.save(step, state)  # the next step changes the weights while (with copy_behind) they are copied
            assert (mgr._local.inner._writer.behind is not None) == copy_behind  # noqa: SLF001 - it did
            seen.append({k: v.clone() for k, v in model.state_dict().items()})
    return state, seen


def test_copy_behind_training_saves_each_step_s_weights_not_the_next_one_s(tmp_path):
    _, seen = _torch_run(tmp_path, copy_behind=True)
    for step, weights in enumerate(seen, start=1):
        saved = trainstate.load(tmp_path / "shm" / "w1" / "rank00000" / f"step_{step:08d}", framework="torch")
        for name, value in weights.items():
            assert torch.equal(saved["model"][name], value), (step, name)


def test_copy_behind_drops_a_save_whose_weights_changed_in_place_during_the_copy(tmp_path, monkeypatch):
    from trainstate._save import staging

    slow = staging._copy_lane

    def copy_late(jobs):  # the copy behind training runs on its own thread: make it slow enough to be caught
        import threading

        if threading.current_thread().name.startswith("trainstate-stage"):
            time.sleep(0.3)
        slow(jobs)

    monkeypatch.setattr(staging, "_copy_lane", copy_late)
    model = torch.nn.Linear(16, 16)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    tier = trainstate.LocalTier(tmp_path / "shm", every_steps=1, copy_behind=True)
    with trainstate.CheckpointManager(tmp_path / "durable", every_steps=100, local=tier) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
        with torch.no_grad():
            model.weight.add_(1.0)  # in place, outside the optimizer's step, while the copy is under way
        with pytest.raises(trainstate.CheckpointError, match="changed in place after save"):
            mgr.save(2, {"model": model, "optim": optim})
            mgr.wait()
    assert not (tmp_path / "shm" / "w1" / "rank00000" / "step_00000001").exists()


def test_after_a_rollback_the_local_tier_s_newer_timeline_wins_over_the_abandoned_durable_steps(tmp_path):
    """Trained to 11 (durable 0, 5, 10; local 11), rolled back to 5 and trained 6-8 locally: a restart resumes
    after 8, not after the abandoned run's durable 10 (the tiers are ordered by commits, as 'newest' is)."""
    state = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path, every_steps=1) as mgr:
        _train(mgr, state, range(12))
    with _manager(tmp_path, every_steps=1) as mgr:
        mgr.restore(5, state)
        _train(mgr, state, range(6, 9))  # local 6, 7, 8: a new timeline from step 5
    restored = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path) as mgr:
        assert mgr.restore_latest(restored) == 9 and restored["step"] == 8


def test_a_durable_directory_deleted_to_start_afresh_does_not_resume_the_old_local_checkpoints(tmp_path, caplog):
    import shutil

    state = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path, every_steps=1) as mgr:
        _train(mgr, state, range(8))
    shutil.rmtree(tmp_path / "durable")
    fresh = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with caplog.at_level("WARNING", logger="trainstate"), _manager(tmp_path) as mgr:
        assert mgr.restore_latest(fresh) is None and fresh["step"] == -1
    assert "no longer holds" in caplog.text


def test_a_read_only_manager_beside_the_job_restores_from_the_local_tier_too(tmp_path):
    state = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path, every_steps=1) as mgr:
        _train(mgr, state, range(8))  # durable 0, 5; local 6, 7
    tier = trainstate.LocalTier(tmp_path / "shm")
    restored = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with trainstate.CheckpointManager(tmp_path / "durable", read_only=True, local=tier) as mgr:
        assert mgr.restore_latest(restored) == 8 and restored["step"] == 7


def test_the_budget_is_checked_again_when_a_checkpoint_grows(tmp_path):
    """The first save fit; the state then grew (as AdamW's moments appear after the first step)."""
    state = {"w": np.zeros(10_000, dtype=np.float32)}  # 40 kB
    tier = trainstate.LocalTier(tmp_path / "shm", every_steps=1, keep=2, budget_bytes=400_000)
    with trainstate.CheckpointManager(tmp_path / "durable", every_steps=100, local=tier) as mgr:
        mgr.save(1, state)
        mgr._local.inner.wait()  # noqa: SLF001 - committed: its size is known
        state["moments"] = np.zeros(100_000, dtype=np.float32)  # 400 kB more
        with pytest.raises(trainstate.StorageError, match="budget_bytes of 400,000"):
            for step in (2, 3):  # by the next save whose checkpoint would not fit
                mgr.save(step, state)
                mgr._local.inner.wait()  # noqa: SLF001


def test_a_local_path_through_a_symlink_into_the_durable_directory_is_refused(tmp_path):
    (tmp_path / "durable").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "durable")
    with pytest.raises(trainstate.InvalidArgumentError, match="inside one another"):
        trainstate.CheckpointManager(tmp_path / "durable", local=trainstate.LocalTier(tmp_path / "link" / "local"))


def test_trainstate_history_of_the_local_path_shows_each_folder_s_saves(tmp_path):
    import json

    from helpers import cli

    state = {"w": np.zeros(1000, dtype=np.float32), "step": -1}
    with _manager(tmp_path, every_steps=1, keep=2) as mgr:
        _train(mgr, state, range(4))  # local 1, 2, 3 (0 is durable)
    shown = cli("history", str(tmp_path / "shm")).stdout
    assert "saves in" in shown and "rank00000" in shown, shown
    listed = json.loads(cli("history", "--json", str(tmp_path / "shm")).stdout)
    assert listed["kind"] == "local tier" and [e["step"] for e in listed["folders"]["w1/rank00000"]] == [1, 2, 3]
    tier = json.loads(cli("ls", "--json", str(tmp_path / "shm")).stdout)
    assert tier["copies"] == []  # one process: its own folder only
