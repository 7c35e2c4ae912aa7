"""Attacks on the local tier in one process (each a strict xfail: a defect found, not fixed here)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import trainstate

torch = pytest.importorskip("torch")


def _manager(tmp_path: Path, **local: object) -> trainstate.CheckpointManager:
    tier = trainstate.LocalTier(tmp_path / "shm", **local)  # type: ignore[arg-type]
    return trainstate.CheckpointManager(tmp_path / "durable", every_steps=5, keep_last=2, local=tier)


def _train(mgr: trainstate.CheckpointManager, state: dict, steps: range, timeline: int, inc: float) -> None:
    for step in steps:
        state["w"] += inc
        state["timeline"] = timeline
        mgr.save(step, state)
        mgr.wait()


def test_after_a_rollback_a_resume_does_not_return_to_the_abandoned_timelines_local_steps(tmp_path):
    state = {"w": np.zeros(4, np.float32), "timeline": 0}
    with _manager(tmp_path, every_steps=1, keep=2) as mgr:
        _train(mgr, state, range(14), timeline=1, inc=1.0)  # durable 5, 10; local 12, 13
        mgr.restore(10, state)  # a loss spike: roll back to step 10 and train on from there
        assert state["timeline"] == 1 and state["w"][0] == 11.0
        _train(mgr, state, range(11, 12), timeline=2, inc=100.0)  # the new timeline's step 11, saved locally
    # the job is killed here; the resume must continue the new timeline (step 11), not the abandoned one
    restored = {"w": np.zeros(4, np.float32), "timeline": 0}
    with _manager(tmp_path, every_steps=1, keep=2) as mgr:
        start = mgr.restore_latest(restored)
    assert restored["timeline"] == 2, (start, restored)
    assert start == 12


def test_a_fresh_run_in_a_recreated_durable_directory_does_not_resume_the_old_runs_local_checkpoints(tmp_path):
    state = {"w": np.zeros(4, np.float32), "timeline": 0}
    with _manager(tmp_path, every_steps=1, keep=2) as mgr:
        _train(mgr, state, range(14), timeline=1, inc=1.0)
    shutil.rmtree(tmp_path / "durable")  # the run is thrown away; a new one starts in the same directory
    fresh = {"w": np.zeros(4, np.float32), "timeline": 0}
    with _manager(tmp_path, every_steps=1, keep=2) as mgr:
        start = mgr.restore_latest(fresh)
    assert start is None and fresh["timeline"] == 0, (start, fresh)


def test_copy_behind_never_commits_a_parameter_torn_by_an_in_place_change_after_save(tmp_path):
    torch.set_num_threads(1)
    outcomes = []
    for trial in range(8):
        run = tmp_path / f"t{trial}"
        w = torch.nn.Parameter(torch.rand(20_000_000) + 1.0)
        opt = torch.optim.SGD([w], lr=0.1)
        state = {"w": w, "optim": opt}
        tier = trainstate.LocalTier(run / "shm", every_steps=1, keep=3, copy_behind=True)
        mgr = trainstate.CheckpointManager(run / "durable", every_steps=100, local=tier)
        try:
            w.grad = torch.ones_like(w)
            opt.step()
            mgr.save(1, state)  # the staging buffer is made and touched
            mgr.wait()
            w.grad = torch.ones_like(w)
            opt.step()
            before = w.detach().clone()
            mgr.save(2, state)
            with torch.no_grad():
                torch.sin_(w)  # an in-place change outside optimizer.step(): must be caught, or not in step 2
            try:
                mgr.wait()
                w.grad = torch.ones_like(w)
                opt.step()
                mgr.save(3, state)
                mgr.wait()
            except trainstate.CheckpointError:
                pass  # caught: the save of step 2 dropped
            steps = [c.step for c in mgr._local.inner.list()]  # noqa: SLF001
        finally:
            try:
                mgr.close()
            except trainstate.CheckpointError:
                pass
        if 2 in steps:
            saved = torch.as_tensor(trainstate.load(run / "shm" / "w1" / "rank00000" / "step_00000002")["w"])
            outcomes.append(int((saved != before).sum()))
        del w, opt, state, before
        shutil.rmtree(run)
    assert all(changed == 0 for changed in outcomes), outcomes  # elements of step 2 not as at save()


def test_copying_a_local_checkpoint_to_two_peers_does_not_hold_several_copies_of_it_in_memory(tmp_path):
    import tracemalloc

    from trainstate._manager import tier_peers

    trainstate.save(tmp_path / "rank00000" / "step_00000005", {"w": np.random.rand(40_000_000 // 8)})
    size = sum(p.stat().st_size for p in (tmp_path / "rank00000" / "step_00000005").iterdir())

    class _Wire:  # a coordinator whose sends complete at once
        def exchange(self, sends: list, receives: list, what: str) -> None:
            pass

    tracemalloc.start()
    try:
        packed = tier_peers.pack(tmp_path / "rank00000", 5)
        tier_peers.send_and_receive(_Wire(), {1: packed, 2: packed}, [], "copies")  # type: ignore[arg-type]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * size, f"{peak / size:.1f}x the checkpoint's {size:,} bytes"


def test_a_local_path_that_is_a_symlink_to_the_durable_directory_is_refused(tmp_path):
    import os

    (tmp_path / "durable").mkdir()
    os.symlink(tmp_path / "durable", tmp_path / "shm")
    with pytest.raises(trainstate.InvalidArgumentError):
        with trainstate.CheckpointManager(
            tmp_path / "durable", every_steps=5, local=trainstate.LocalTier(tmp_path / "shm", every_steps=1)
        ) as mgr:
            for step in range(1, 8):
                mgr.save(step, {"w": np.zeros(10, np.float32)})


def test_the_same_durable_directory_through_a_symlink_is_the_same_run(tmp_path):
    import os

    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    state = {"w": np.zeros(10, np.float32)}
    for durable in (tmp_path / "link", tmp_path / "real"):
        tier = trainstate.LocalTier(tmp_path / "shm", every_steps=1)
        with trainstate.CheckpointManager(durable, every_steps=5, local=tier) as mgr:
            mgr.save(1, state)


def test_a_local_path_that_is_a_file_is_an_invalid_argument(tmp_path):
    (tmp_path / "shm").write_text("not a directory")
    with pytest.raises(trainstate.InvalidArgumentError):
        trainstate.CheckpointManager(tmp_path / "durable", local=trainstate.LocalTier(tmp_path / "shm")).close()
