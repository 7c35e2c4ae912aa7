"""Regression tests for the ways users lost work with the manager: clocks, newer writers, damage everywhere,
failed saves, pins racing retention, habits with NumPy and torch scalars, reserved keys, bad arguments."""

from __future__ import annotations

import errno
import math
import os
import time

import numpy as np
import pytest

import trainstate
from helpers import reseal_manifest
from trainstate._format.run_dir import is_staging_name
from trainstate._storage.faulty import FaultyStorage

torch = pytest.importorskip("torch")


def small_state(fill: float = 0.0):
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.fill_(fill)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters()), "step": 0}


def weight(state) -> float:
    return float(state["model"].weight.detach()[0, 0])


# -- 1. newest comes from a commit counter, not a clock ---------------------------------------------


def test_a_host_whose_clock_is_behind_keeps_its_new_saves(tmp_path, monkeypatch):
    with trainstate.CheckpointManager(tmp_path, every_steps=10, keep_last=2) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, small_state(step))
    behind = time.time() - 10 * 86400  # the next host's clock is ten days behind
    monkeypatch.setattr(time, "time", lambda: behind)
    with trainstate.CheckpointManager(tmp_path, every_steps=10, keep_last=2) as mgr:
        state = small_state()
        assert mgr.restore_latest(state) == 31
        for step in (40, 50):
            mgr.save(step, small_state(step))
            assert (tmp_path / f"step_{step:08d}" / "manifest.json").exists()
        assert [c.step for c in mgr.list()] == [40, 50]
    with trainstate.CheckpointManager(tmp_path) as mgr:
        state = small_state()
        assert mgr.restore_latest(state) == 51 and weight(state) == 50


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_created_time_is_refused(tmp_path, bad):
    trainstate.save(tmp_path / "c", {"x": np.arange(3)})
    reseal_manifest(tmp_path / "c", lambda b: b.update(created=bad))
    with pytest.raises(trainstate.CorruptCheckpointError, match="created"):
        trainstate.load(tmp_path / "c")


# -- 2. a newer writer's checkpoint is not damage -----------------------------------------------------


def test_a_checkpoint_from_a_newer_trainstate_stops_the_manager(tmp_path):
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(1, small_state(1))
        mgr.save(2, small_state(2))
    reseal_manifest(tmp_path / "step_00000002", lambda b: b.update(format_version="2.0"))
    with pytest.raises(trainstate.FormatVersionError, match="upgrade trainstate"):
        trainstate.CheckpointManager(tmp_path, every_steps=1)
    # the refused manager left no lock behind, and a read-only look still lists the rest
    with trainstate.CheckpointManager(tmp_path, read_only=True) as ro:
        assert [c.step for c in ro.list()] == [1]
    assert (tmp_path / "step_00000002" / "manifest.json").exists()


# -- 3. damage: fall back past anything, never "nothing to resume" ------------------------------------


def _two_checkpoints(tmp_path):
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(1, small_state(1))
        mgr.save(2, small_state(2))


HOSTILE = {
    "dict items not a list": lambda b: b.update(tree={"t": "dict", "v": 5}),
    "unhashable key": lambda b: b.update(tree={"t": "dict", "v": [[{"t": "list", "v": []}, 1]]}),
    "stateful without v": lambda b: b["tree"]["v"][0][1].pop("v"),
    "tensor entry not a dict": lambda b: b["tensors"].update({k: 7 for k in b["tensors"]}),
    "metadata holds a tensor": lambda b: b.update(metadata={"t": "tensor", "name": "model.weight"}),
    "bare NaN in the tree": lambda b: b["tree"]["v"].append(["x", math.nan]),
}


@pytest.mark.parametrize("edit", HOSTILE.values(), ids=HOSTILE.keys())
def test_restore_latest_falls_back_past_a_resealed_hostile_manifest(tmp_path, edit):
    _two_checkpoints(tmp_path)
    reseal_manifest(tmp_path / "step_00000002", edit)
    with trainstate.CheckpointManager(tmp_path) as mgr:
        state = small_state(-1)
        assert mgr.restore_latest(state) == 2
        assert weight(state) == 1


def test_when_every_checkpoint_is_damaged_restore_latest_says_so(tmp_path):
    _two_checkpoints(tmp_path)
    for step in (1, 2):
        reseal_manifest(tmp_path / f"step_{step:08d}", lambda b: b.update(tree={"t": "dict", "v": 5}))
    with trainstate.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(trainstate.CorruptCheckpointError) as info:
            mgr.restore_latest(small_state())
    assert "step_00000001" in str(info.value) and "step_00000002" in str(info.value)


def test_a_checkpoint_failing_mid_read_is_followed_by_a_complete_restore(tmp_path):
    state = small_state(1.0)
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(1, state)
        with torch.no_grad():
            state["model"].weight.fill_(2.0)
            state["model"].bias.fill_(2.0)
        mgr.save(2, state)
    # damage the bytes of the tensor restored last, so earlier ones land first
    with trainstate.open(tmp_path / "step_00000002") as ck:
        names = ck.keys()
        last = ck.manifest.tensors[names[-1]].chunks[0]
    data = tmp_path / "step_00000002" / last.file
    raw = bytearray(data.read_bytes())
    raw[last.byte_range[0]] ^= 0xFF
    data.write_bytes(bytes(raw))
    target = small_state(-5.0)
    with trainstate.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest(target) == 2
    assert torch.all(target["model"].weight == 1.0) and torch.all(target["model"].bias == state_bias(tmp_path))


def state_bias(tmp_path):
    with trainstate.open(tmp_path / "step_00000001") as ck:
        return torch.from_numpy(np.array(ck.read("model.bias")))


def test_load_and_restore_latest_check_data_file_headers_alike(tmp_path):
    _two_checkpoints(tmp_path)
    data = next((tmp_path / "step_00000002").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0x01  # inside the safetensors header, which no tensor read touches
    data.write_bytes(bytes(raw))
    with pytest.raises(trainstate.CorruptCheckpointError, match="header"):
        trainstate.load(tmp_path / "step_00000002", small_state())
    with trainstate.CheckpointManager(tmp_path) as mgr:
        state = small_state(-1)
        assert mgr.restore_latest(state) == 2 and weight(state) == 1


# -- 5. a failed save leaves its step unsaved ----------------------------------------------------------


def test_after_a_full_disk_the_same_step_saves_again(tmp_path):
    full = FaultyStorage("write", at=1, error=errno.ENOSPC)
    mgr = trainstate.CheckpointManager(tmp_path, every_steps=10, storage=full)
    with pytest.raises(trainstate.StorageError):
        mgr.save(10, small_state(10))
    assert mgr.save(10, small_state(10)) is True  # the disk has room again: step 10 is written
    assert (tmp_path / "step_00000010" / "manifest.json").exists()
    mgr.close()


def test_close_writes_the_final_step_after_a_failed_save_of_it(tmp_path):
    full = FaultyStorage("write", at=1, error=errno.ENOSPC)
    mgr = trainstate.CheckpointManager(tmp_path, every_steps=10, storage=full)
    with pytest.raises(trainstate.StorageError):
        mgr.save(10, small_state(10))
    mgr.close(10, small_state(10))
    assert (tmp_path / "step_00000010" / "manifest.json").exists()


def test_a_stale_async_error_does_not_stop_the_preemption_save(tmp_path):
    full = FaultyStorage("write", at=1, error=errno.ENOSPC)
    mgr = trainstate.CheckpointManager(tmp_path, every_steps=10, async_save=True, storage=full)
    mgr.save(10, small_state(10))  # fails in the background
    mgr._writer.collect(block=True)
    mgr._preemption.signal_name = "SIGTERM"  # as the signal handler does
    with pytest.raises(trainstate.StorageError):
        mgr.save(11, small_state(11))  # writes the preemption checkpoint first, then reports the old error
    assert (tmp_path / "step_00000011" / "manifest.json").exists()
    assert mgr.preempted
    mgr.close()


def test_a_failed_async_save_of_a_step_can_be_saved_again(tmp_path):
    full = FaultyStorage("write", at=1, error=errno.ENOSPC)
    mgr = trainstate.CheckpointManager(tmp_path, every_steps=10, async_save=True, storage=full)
    mgr.save(10, small_state(10))
    with pytest.raises(trainstate.StorageError):
        mgr.wait()
    assert mgr.save(10, small_state(10)) is True
    mgr.close()
    assert (tmp_path / "step_00000010" / "manifest.json").exists()


# -- 6. a reported pin is never deleted -------------------------------------------------------------------


@pytest.fixture(params=["local", "memory"])
def any_storage(request, tmp_path):
    """A local directory (deletes by rename) or an fsspec memory store (no rename: deletes by un-commit)."""
    if request.param == "local":
        return str(tmp_path), None
    fsspec = pytest.importorskip("fsspec")
    from trainstate._storage.fsspec import FsspecStorage

    fs = fsspec.filesystem("memory")
    fs.store.clear()
    return "memory://run", FsspecStorage(fs)


def test_a_pin_taken_after_the_retention_plan_wins(any_storage):
    root, storage = any_storage
    mgr = trainstate.CheckpointManager(root, every_steps=1, keep_last=1, storage=storage)
    mgr.save(1, small_state(1))
    backend = mgr.catalog.storage
    pinned = []

    def pin_now():  # another process pins step 1 just as retention starts taking it away
        if not pinned:
            pinned.append(trainstate.CheckpointManager(root, read_only=True, storage=storage).pin(1, "keep"))

    real_hide, real_delete = backend.hide, backend.delete
    backend.hide = lambda path: (pin_now(), real_hide(path))[1]  # type: ignore[method-assign]
    backend.delete = lambda path: (path.endswith("manifest.json") and pin_now(), real_delete(path))[1]  # type: ignore[method-assign]
    mgr.save(2, small_state(2))
    mgr.close()
    assert pinned == [True]
    with trainstate.CheckpointManager(root, read_only=True, storage=storage) as ro:
        assert [c.step for c in ro.list()] == [1, 2] and ro.list()[0].pinned


def test_pins_beside_a_pruning_job_are_never_lost(tmp_path):
    import subprocess
    import sys

    script = (
        "import sys, trainstate, numpy as np\n"
        "m = trainstate.CheckpointManager(sys.argv[1], every_steps=1, keep_last=1, fsync=False)\n"
        "for s in range(1, 150): m.save(s, {'x': np.full(64, s)})\n"
        "m.close()\n"
    )
    job = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])
    reader = trainstate.CheckpointManager(tmp_path, read_only=True)
    reported = []
    while job.poll() is None:
        latest = reader.latest()
        if latest is None:
            continue
        try:
            if reader.pin(latest.step, "watch"):
                reported.append(latest.step)
        except trainstate.CheckpointNotFoundError:
            pass  # deleted before the pin took: reported as such, not as a success
    assert job.wait() == 0
    assert reported, "the race never happened"
    lost = [s for s in reported if not (tmp_path / f"step_{s:08d}" / "manifest.json").exists()]
    assert lost == []


def test_pin_reason_shows_and_a_second_pin_says_it_changed_nothing(tmp_path):
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(1, small_state(1))
        assert mgr.pin(1, "best so far") is True
        assert mgr.pin(1, "another reason") is False
        info = mgr.list()[0]
    assert info.pinned and info.pin_reason == "best so far"


# -- 12, 16, 21: what users pass by habit ----------------------------------------------------------------


def test_numpy_and_torch_scalars_are_accepted_for_step_epoch_and_metrics(tmp_path):
    with trainstate.CheckpointManager(tmp_path, every_steps=1, keep_best=("loss", "min", 1)) as mgr:
        loss = torch.tensor(0.25).detach()
        assert mgr.save(
            np.int64(3),
            small_state(3),
            epoch=np.int32(1),
            metrics={"loss": loss, "acc": np.float32(0.5), "n": np.int64(7)},
        )
        assert mgr.save(torch.tensor(4), small_state(4), metrics={"loss": np.float64(0.5)})
        info = mgr.list()[0]
        assert info.step == 3 and info.epoch == 1 and info.metrics == {"loss": 0.25, "acc": 0.5, "n": 7.0}
        assert type(info.metrics["loss"]) is float
        assert mgr.best().step == 3


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"metrics": {"loss": "low"}}, "loss"),
        ({"metrics": {"loss": torch.ones(3)}}, "loss"),
        ({"epoch": 1.5}, "epoch"),
        ({"epoch": -1}, "epoch"),
    ],
)
def test_bad_save_arguments_name_their_key(tmp_path, kwargs, key):
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        with pytest.raises(trainstate.InvalidArgumentError, match=key):
            mgr.save(1, small_state(), **kwargs)


@pytest.mark.parametrize("step", ["10", 1.0, True, -3, None])
def test_a_bad_step_is_a_checkpoint_error(tmp_path, step):
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        with pytest.raises(trainstate.CheckpointError, match="step"):
            mgr.save(step, small_state())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every_steps": 0},
        {"keep_last": 0},
        {"every_seconds": -1},
        {"every_seconds": math.nan},
        {"keep_best": ("loss", "lowest", 2)},
        {"keep_best": "loss"},
        {"max_in_flight": 0},
        {"threads": 0},
    ],
)
def test_bad_manager_arguments_are_checkpoint_errors_and_take_nothing(tmp_path, kwargs):
    with pytest.raises(trainstate.InvalidArgumentError):
        trainstate.CheckpointManager(tmp_path, **kwargs)
    with trainstate.CheckpointManager(tmp_path):  # no lock was left behind
        pass


def test_configuration_is_fixed_after_construction(tmp_path):
    with trainstate.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(trainstate.CheckpointError, match="async_save"):
            mgr.async_save = True
        assert mgr.async_save is False


def test_a_user_key_named_rng_is_never_overwritten(tmp_path):
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        with pytest.raises(trainstate.InvalidArgumentError, match="_rng"):
            mgr.save(1, {**small_state(), "_rng": {"mine": 1}})
    with trainstate.CheckpointManager(tmp_path, every_steps=1, capture_rng=False) as mgr:
        mgr.save(1, {**small_state(), "_rng": {"mine": 1}})
    assert trainstate.load(tmp_path / "step_00000001", include="_rng.*") == {"_rng": {"mine": 1}}


def test_a_pinned_checkpoint_left_hidden_by_a_crash_mid_retention_is_put_back(tmp_path):
    # Retention hides a checkpoint (one rename), then finds a pin and renames it back. A process killed
    # between the two leaves the pinned checkpoint under its hidden name: the next manager must put it
    # back, never sweep it away as a leftover.
    with trainstate.CheckpointManager(tmp_path, every_steps=1, fsync=False) as mgr:
        mgr.save(1, {"x": np.arange(4)})
        mgr.save(2, {"x": np.arange(4) + 1})
        assert mgr.pin(1, "best so far")
    (tmp_path / "step_00000001").rename(tmp_path / ".step_00000001.del-0123456789ab")
    (tmp_path / ".trainstate-probe-0123456789ab").write_bytes(b"left by a killed check_storage")
    with trainstate.CheckpointManager(tmp_path, every_steps=1, fsync=False) as mgr:
        assert [c.step for c in mgr.list()] == [1, 2]
        assert mgr.list()[0].pin_reason == "best so far"
        assert list(trainstate.load(tmp_path / "step_00000001")["x"]) == [0, 1, 2, 3]
    assert not (tmp_path / ".trainstate-probe-0123456789ab").exists()
    assert not [n for n in os.listdir(tmp_path) if is_staging_name(n)]
