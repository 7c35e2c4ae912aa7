"""CheckpointManager against a real directory: cadence, retention, crashes, async, preemption, history."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

import trainstate
import trainstate._manager.committer
from trainstate._save import staging

torch = pytest.importorskip("torch")


@pytest.fixture
def allocations(monkeypatch):
    """Every staging-buffer allocation of host memory, by size."""
    seen = []
    real = staging._host_memory

    def counting(nbytes):
        seen.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(staging, "_host_memory", counting)
    return seen


def small_state():
    model = torch.nn.Linear(32, 16)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters()), "step": 0}


def bump(state, step):
    with torch.no_grad():
        state["model"].weight.fill_(float(step))
    state["step"] = step


def test_saves_on_schedule_and_resumes_after_the_latest(tmp_path):
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=3) as mgr:
        saved = []
        for step in range(10):
            bump(state, step)
            if mgr.save(step, state):
                saved.append(step)
    assert saved == [0, 3, 6, 9]
    assert [c.name for c in mgr.list()] == ["step_00000000", "step_00000003", "step_00000006", "step_00000009"]
    fresh = small_state()
    with trainstate.CheckpointManager(tmp_path) as mgr2:
        assert mgr2.restore_latest(fresh) == 10  # the step to continue from
        assert mgr2.latest().step == 9
    assert fresh["step"] == 9 and float(fresh["model"].weight[0, 0].detach()) == 9.0


def test_restore_latest_on_an_empty_directory(tmp_path):
    with trainstate.CheckpointManager(tmp_path / "new") as mgr:
        assert mgr.restore_latest(small_state()) is None and mgr.latest() is None


def test_force_metrics_epoch_and_best(tmp_path):
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=100, keep_best=("val", "min", 2)) as mgr:
        assert not mgr.save(1, state, metrics={"val": 1.0})  # not a step the policy saves
        for step, val in [(1, 0.9), (2, 0.3), (3, 0.5), (4, 0.8)]:
            assert mgr.save(step, state, metrics={"val": val}, epoch=step // 2, force=True)
        mgr.save(5, state, force=True)  # no metric: keep_best never deletes it
    infos = {c.step: c for c in mgr.list()}
    assert sorted(infos) == [2, 3, 5]
    assert infos[2].metrics == {"val": 0.3} and infos[3].epoch == 1
    assert mgr.best().step == 2
    with trainstate.open(mgr.path_for(2)) as ck:
        assert ck.metadata["trainstate"]["reason"] == "forced"


def test_a_listed_checkpoint_says_where_it_is(tmp_path):
    """latest() and best() can be opened, exported or evaluated as they are: each carries its path."""
    with trainstate.CheckpointManager(tmp_path / "run", every_steps=1) as mgr:
        mgr.save(0, small_state(), metrics={"val": 0.5})
        mgr.save(1, small_state(), metrics={"val": 0.2})
    latest = mgr.latest()
    assert latest is not None and latest.path == mgr.path_for(1) == os.path.join(tmp_path, "run", "step_00000001")
    assert [c.path for c in mgr.list()] == [mgr.path_for(0), mgr.path_for(1)]
    with trainstate.open(mgr.best("val", "min").path) as ck:
        assert ck.metadata["trainstate"]["step"] == 1
    pytest.importorskip("fsspec")
    with trainstate.CheckpointManager(f"memory://{tmp_path.name}/run", every_steps=1) as remote:
        remote.save(3, {"x": np.arange(3)})
    latest = remote.latest()
    assert latest is not None and latest.path == remote.path_for(3)  # the storage's form: no memory:// scheme
    with trainstate.open(latest.path, storage=remote.storage) as ck:
        assert ck.metadata["trainstate"]["step"] == 3


def test_only_names_of_the_scheme_are_touched_and_pins_survive(tmp_path):
    (tmp_path / "notes").mkdir()
    trainstate.save(tmp_path / "my_export", {"x": 1})
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=1, keep_last=1) as mgr:
        mgr.save(0, state)
        mgr.pin(0, "baseline")
        for step in range(1, 5):
            mgr.save(step, state)
        assert [c.step for c in mgr.list()] == [0, 4]
        assert mgr.list()[0].pinned
        mgr.unpin(0)
        mgr.save(5, state)
        assert [c.step for c in mgr.list()] == [5]
    assert (tmp_path / "notes").is_dir() and (tmp_path / "my_export" / "manifest.json").exists()


def test_crash_leftovers_are_invisible_and_swept(tmp_path):
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(0, state)
    (tmp_path / ".step_00000001.tmp-abc").mkdir()  # a save killed before its commit
    (tmp_path / ".step_00000001.tmp-abc" / "data-00000.safetensors").write_bytes(b"partial")
    (tmp_path / "step_00000002").mkdir()  # a named directory without a manifest
    with trainstate.CheckpointManager(tmp_path) as mgr:
        assert [c.step for c in mgr.list()] == [0]
        assert sorted(mgr.swept) == [".step_00000001.tmp-abc", "step_00000002"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in (".trainstate.lock", "_history")) == [
        "step_00000000"
    ]


def test_a_second_manager_on_the_directory_is_refused(tmp_path):
    with trainstate.CheckpointManager(tmp_path):
        with pytest.raises(trainstate.CheckpointError, match="another CheckpointManager"):
            trainstate.CheckpointManager(tmp_path)
    trainstate.CheckpointManager(tmp_path).close()  # free again after close


def test_async_snapshot_is_isolated_from_later_mutation(tmp_path):
    state = {"w": torch.zeros(1 << 20)}  # 4 MB
    gate = threading.Event()
    original = trainstate._manager.committer.write_checkpoint

    def slow_write(*args, **kwargs):
        gate.wait(5)  # hold the background write until the loop has mutated the tensor
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainstate._manager.committer, "write_checkpoint", slow_write)
        with trainstate.CheckpointManager(tmp_path, every_steps=1, async_save=True) as mgr:
            mgr.save(0, state)
            state["w"].fill_(7.0)  # the loop goes on and changes the tensor in place
            gate.set()
            mgr.wait()
    assert float(trainstate.load(tmp_path / "step_00000000")["w"].max()) == 0.0


def test_async_reuses_one_staging_buffer(tmp_path, allocations):
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=1, async_save=True) as mgr:
        for step in range(5):
            bump(state, step)
            mgr.save(step, state)
    assert len(allocations) == 1
    assert all(r.background and r.error is None for r in mgr.history())
    assert float(trainstate.load(tmp_path / "step_00000004")["model"]["weight"][0, 0]) == 4.0


def test_a_failed_background_save_raises_on_the_next_call(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise trainstate.StorageError(28, "No space left on device")

    state = small_state()
    mgr = trainstate.CheckpointManager(tmp_path, every_steps=1, async_save=True)
    mgr.save(0, state)
    mgr.wait()
    monkeypatch.setattr(trainstate._manager.committer, "write_checkpoint", broken)
    mgr.save(1, state)
    with pytest.raises(trainstate.StorageError, match="No space"):
        mgr.wait()
    mgr.save(2, state)
    with pytest.raises(trainstate.StorageError):
        mgr.save(3, state)
    monkeypatch.undo()
    mgr.close()
    assert [c.step for c in mgr.list()] == [0]  # the good one is intact
    assert trainstate.load(tmp_path / "step_00000000")


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_preemption_signal_saves_at_the_next_call(tmp_path):
    state = small_state()
    before = signal.getsignal(signal.SIGUSR1)  # SIG_DFL, or a manager's of an earlier test not yet collected
    with trainstate.CheckpointManager(tmp_path, every_steps=100, async_save=True) as mgr:
        assert not mgr.save(1, state)
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler only sets a flag
        assert not (tmp_path / "step_00000002").exists()
        assert mgr.save(2, state) and mgr.preempted
        assert (tmp_path / "step_00000002" / "manifest.json").exists()  # saved synchronously
        with trainstate.open(tmp_path / "step_00000002") as ck:
            assert ck.metadata["trainstate"]["reason"] == "preemption (SIGUSR1)"
    assert signal.getsignal(signal.SIGUSR1) is before  # handlers put back on close


def test_close_saves_a_final_checkpoint_and_history_has_timings(tmp_path):
    state = small_state()
    mgr = trainstate.CheckpointManager(tmp_path, every_steps=5, async_save=True)
    for step in range(7):
        mgr.save(step, state)
    mgr.close(7, state)
    assert [c.step for c in mgr.list()] == [0, 5, 7]
    history = mgr.history()
    assert [r.step for r in history] == [0, 5, 7] and history[-1].reason == "at close"
    for r in history:
        assert r.blocking_seconds > 0 and r.write_seconds > 0 and r.commit_seconds >= 0 and r.nbytes > 0
    with pytest.raises(trainstate.CheckpointError, match="closed"):
        mgr.save(8, state, force=True)


def test_damaged_latest_falls_back_to_the_one_before(tmp_path):
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        for step in range(3):
            bump(state, step)
            mgr.save(step, state)
    data = sorted((tmp_path / "step_00000002").glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    fresh = small_state()
    with trainstate.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest(fresh) == 2
    assert fresh["step"] == 1


def test_rng_is_captured_by_default_when_the_state_has_none(tmp_path):
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(0, state)
        expected = torch.rand(3)
    with trainstate.open(tmp_path / "step_00000000") as ck:
        assert "_rng.torch" in ck.keys()
    torch.rand(10)
    fresh = small_state()
    with trainstate.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest(fresh) == 1
    assert torch.equal(torch.rand(3), expected)
    assert "_rng" not in fresh  # the user's dict keeps its own keys


def test_a_state_over_the_staging_budget_is_saved_synchronously(tmp_path):
    state = {"w": torch.zeros(1 << 16)}  # 256 KB
    with trainstate.CheckpointManager(tmp_path, every_steps=1, async_save=True, staging_budget_bytes=1 << 10) as mgr:
        mgr.save(0, state)
        assert (tmp_path / "step_00000000" / "manifest.json").exists()  # already committed on return
    assert not mgr.history()[0].background


def test_prune_applies_retention_without_saving(tmp_path):
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        for step in range(5):
            mgr.save(step, state)
    with trainstate.CheckpointManager(tmp_path, keep_last=2) as mgr:
        plan = mgr.prune(dry_run=True)
        assert sorted(plan.delete) == ["step_00000000", "step_00000001", "step_00000002"]
        assert [c.step for c in mgr.list()] == [0, 1, 2, 3, 4]  # a dry run deletes nothing
        mgr.prune()
        assert [c.step for c in mgr.list()] == [3, 4]
    with trainstate.CheckpointManager(tmp_path, read_only=True) as reader:
        assert [c.step for c in reader.list()] == [3, 4]
        with pytest.raises(trainstate.CheckpointError, match="read-only"):
            reader.prune()


def test_a_manager_checkpoint_loads_with_plain_load_into_the_users_state(tmp_path):
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(0, state)
    fresh = small_state()
    trainstate.load(mgr.path_for(0), fresh)  # the manager's own "_rng" is not "unexpected"
    assert torch.equal(fresh["model"].weight, state["model"].weight)


def test_a_failed_background_save_keeps_its_step_in_history(tmp_path, monkeypatch):
    real = trainstate._manager.committer.write_checkpoint

    def flaky(final, snapshot, **kwargs):
        if str(final).endswith("3"):
            raise trainstate.StorageError(28, "No space left on device")
        return real(final, snapshot, **kwargs)

    monkeypatch.setattr(trainstate._manager.committer, "write_checkpoint", flaky)
    mgr = trainstate.CheckpointManager(tmp_path, every_steps=1, async_save=True)
    mgr.save(3, small_state())
    with pytest.raises(trainstate.StorageError):
        mgr.wait()
    mgr.close()
    failed = [r for r in mgr.history() if r.error]
    assert [(r.step, r.reason) for r in failed] == [(3, "every 1 steps")] and "No space" in failed[0].error


def _damage(ckpt):
    for data in ckpt.glob("*.safetensors"):
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))


def test_after_resuming_past_a_damaged_checkpoint_new_saves_are_kept(tmp_path):
    """Retention orders by commit, not step: a damaged (or rolled-back) higher step never evicts new work."""
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=10, keep_last=1) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state)
    _damage(tmp_path / "step_00000030")
    with trainstate.CheckpointManager(tmp_path, every_steps=10, keep_last=1) as mgr:
        with pytest.raises(trainstate.CorruptCheckpointError, match="step_00000030"):
            mgr.restore_latest(small_state())  # keep_last=1 left only the damaged one: never "nothing to resume"
        for step in (0, 10, 20):
            mgr.save(step, state)
            assert (tmp_path / f"step_{step:08d}" / "manifest.json").exists()
        assert mgr.latest().step == 20
    with trainstate.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest(small_state()) == 21  # the new timeline, not the stale step 30


def test_a_pinned_step_is_never_saved_over(tmp_path):
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(10, state)
        mgr.pin(10, "baseline")
        with pytest.raises(trainstate.CheckpointExistsError, match="pinned"):
            mgr.save(10, state, force=True)
        assert mgr.list()[0].pinned


def test_best_ignores_nan_metrics(tmp_path):
    state = small_state()
    with trainstate.CheckpointManager(tmp_path, keep_best=("val", "min", 1)) as mgr:
        for step, val in [(1, float("nan")), (2, 0.5), (3, 0.9)]:
            mgr.save(step, state, metrics={"val": val}, force=True)
        assert mgr.best().step == 2


def test_prepare_reserves_the_staging_buffer_before_the_first_save(tmp_path, allocations):
    import time

    state = small_state()
    with trainstate.CheckpointManager(tmp_path, every_steps=1, async_save=True) as mgr:
        assert mgr.restore_latest(state) is None  # nothing to resume, but the buffer gets ready
        deadline = time.monotonic() + 10
        while not mgr._writer.queue.buffers[0].capacity and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(allocations) == 1  # reserved on a helper thread
        mgr.save(0, state)
    assert len(allocations) == 1  # the first save reused it


def test_without_a_save_policy_every_save_call_saves(tmp_path):
    """A manager made with retention only (as in a notebook) used to save nothing, silently."""
    with trainstate.CheckpointManager(tmp_path, keep_last=2) as mgr:
        assert all(mgr.save(step, small_state()) for step in (1, 2, 3))
    assert [c.step for c in mgr.list()] == [2, 3]
    with trainstate.CheckpointManager(tmp_path, at_steps=[5]) as mgr:  # a schedule given: only it saves
        assert not mgr.save(4, small_state()) and mgr.save(5, small_state())
