"""trainstate.history(dir): every save of a run, from the records the manager leaves in _history/ and the
manifests, through retention, restarts, rollbacks, failures, kills, torn records and object stores."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trainstate
from trainstate._storage.faulty import FaultyStorage


def state(value: float = 0.0) -> dict[str, object]:
    return {"w": np.full(256, value, np.float32), "step": int(value)}


def manager(directory: object, **kwargs: object) -> trainstate.CheckpointManager:
    return trainstate.CheckpointManager(directory, save_on_preemption=False, capture_rng=False, **kwargs)


def records(run: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted((run / "_history").iterdir())]


def test_retention_restart_rollback_and_pins_as_the_history_tells_them(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with manager(run, every_steps=10, keep_last=2, async_save=True) as mgr:
        for step in range(0, 50, 10):
            # NumPy scalars and NaN, as a training loop hands them over
            mgr.save(step, state(step), metrics={"loss": np.float32(1 / (step + 1)), "acc": np.float64(step / 100)})
        mgr.save(50, state(50), metrics={"loss": float("nan")}, epoch=np.int64(2))
    first = trainstate.history(run)
    assert [(e.step, e.status) for e in first] == [
        (0, "deleted"),
        (10, "deleted"),
        (20, "deleted"),
        (30, "deleted"),
        (40, "kept"),
        (50, "kept"),
    ]
    assert [e.note for e in first[:4]] == [f"retention after step {s}" for s in (20, 30, 40, 50)]
    assert [e.seq for e in first] == [1, 2, 3, 4, 5, 6]
    for e in first:
        assert e.background is True and e.error is None and e.reason == "every 10 steps"
        assert e.blocking_seconds >= 0 and e.write_seconds > 0 and e.commit_seconds >= 0
        assert e.nbytes > 1024  # the 1 kB array and its manifest
        assert e.time is not None and e.name == f"step_{e.step:08d}"
    assert first[1].metrics == {"loss": pytest.approx(1 / 11), "acc": 0.1}
    assert type(first[1].metrics["loss"]) is float
    assert math.isnan(first[-1].metrics["loss"]) and first[-1].epoch == 2
    assert len({e.session for e in first}) == 1

    # a new process resumes, rolls back to step 40 and trains again: step 50 is saved a second time
    with manager(run, every_steps=10, keep_last=2) as mgr:
        back = state(-1)
        assert mgr.restore_latest(back) == 51
        mgr.restore(40, back)
        mgr.save(50, state(50.5), metrics={"loss": 0.2}, force=True)
        mgr.pin(40, "best so far")
    second = trainstate.history(run)
    assert [(e.step, e.status) for e in second] == [
        *[(e.step, e.status) for e in first[:5]],
        (50, "replaced"),
        (50, "kept"),
    ]
    assert second[-1].note == "new process" and second[-1].reason == "forced" and second[-1].seq == 7
    assert second[-1].background is False
    assert second[-1].session != second[0].session
    assert second[4].pinned and not second[-1].pinned
    assert len(records(run)) == 7  # one record per save, none rewritten


def test_a_failed_save_is_in_the_history_and_its_retry_too(tmp_path: Path) -> None:
    disk = FaultyStorage("rename", at=2, error=errno.ENOSPC)  # the second save's commit finds the disk full
    with manager(tmp_path / "run", storage=disk) as mgr:
        mgr.save(0, state(0), metrics={"loss": 1.0})
        with pytest.raises(trainstate.StorageError, match="No space left"):
            mgr.save(1, state(1), metrics={"loss": 0.5})
        mgr.save(1, state(1), metrics={"loss": 0.5})  # the step is not saved: writing it again works
    entries = trainstate.history(tmp_path / "run")
    assert [(e.step, e.status) for e in entries] == [(0, "kept"), (1, "failed"), (1, "kept")]
    failed = entries[1]
    assert "No space left" in failed.error and failed.blocking_seconds > 0
    assert failed.write_seconds is None and failed.nbytes is None
    assert trainstate.plot_history(entries) is not None  # a failed save among them draws too


WORKER = """
import os, signal, sys
import numpy as np
import trainstate
mgr = trainstate.CheckpointManager(sys.argv[1], keep_last=2, save_on_preemption=False)
for step in range(4):
    mgr.save(step, {"w": np.full(256, step, np.float32), "step": step}, metrics={"loss": 1.0 / (step + 1)})
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_run_keeps_its_history_and_a_restart_appends_to_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", WORKER, str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [(e.step, e.status) for e in trainstate.history(run)] == [
        (0, "deleted"),
        (1, "deleted"),
        (2, "kept"),
        (3, "kept"),
    ]

    # what kills leave in _history/: a record torn mid-write, and a save killed between its commit and its record
    (run / "_history" / "0000000009-0123456789ab.json").write_bytes(b'{"trainstate_history":1,"session":"01234')
    (step_3,) = (run / "_history").glob("0000000004-*.json")
    step_3.unlink()
    with manager(run, keep_last=2) as mgr:
        assert mgr.restore_latest(state(-1)) == 4
        mgr.save(4, state(4))
    with caplog.at_level(logging.WARNING, logger="trainstate"):
        entries = trainstate.history(run)
    assert "skipped 1 unreadable history record" in caplog.text and "0000000009-0123456789ab.json" in caplog.text
    assert [(e.step, e.status) for e in entries] == [
        (0, "deleted"),
        (1, "deleted"),
        (2, "deleted"),
        (3, "kept"),
        (4, "kept"),
    ]
    lost = entries[3]
    assert lost.note == "no timing record" and lost.blocking_seconds is None and lost.seq == 4
    assert lost.metrics == {"loss": 0.25}  # from its manifest
    assert entries[4].note == "new process"


def test_order_is_by_commit_never_by_a_clock_that_stepped_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with manager(run) as mgr:
        for step in range(3):
            mgr.save(step, state(step))
    for n, path in enumerate(sorted((run / "_history").iterdir())):  # as a clock stepping back would write them
        doc = json.loads(path.read_text())
        doc["time"] = 2_000_000_000.0 - 3600 * n
        path.write_text(json.dumps(doc))
    entries = trainstate.history(run)
    assert [e.step for e in entries] == [0, 1, 2]
    assert [e.time for e in entries] == [2_000_000_000.0, 1_999_996_400.0, 1_999_992_800.0]


def test_on_an_object_store_records_are_objects_of_their_own(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    url = f"memory://history-{os.getpid()}-{tmp_path.name}/run"
    with manager(url, keep_last=1) as mgr:
        for step in range(3):
            mgr.save(step, state(step), metrics={"loss": float(3 - step)})
    entries = trainstate.history(url)
    assert [(e.step, e.status, e.metrics["loss"]) for e in entries] == [
        (0, "deleted", 3.0),
        (1, "deleted", 2.0),
        (2, "kept", 1.0),
    ]
    assert all(e.write_seconds is not None for e in entries)


def test_checkpoints_without_records_and_directories_that_are_no_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with manager(run) as mgr:
        mgr.save(5, state(5), metrics={"loss": 0.5})
    for path in (run / "_history").iterdir():  # a run saved before the history existed
        path.unlink()
    (only,) = trainstate.history(run)
    assert (only.step, only.status, only.note, only.metrics) == (5, "kept", "no timing record", {"loss": 0.5})
    assert only.blocking_seconds is None and only.nbytes > 1024

    with pytest.raises(trainstate.InvalidArgumentError, match="is a checkpoint, not a run directory"):
        trainstate.history(run / "step_00000005")
    with pytest.raises(trainstate.CheckpointNotFoundError, match="no such run directory"):
        trainstate.history(tmp_path / "missing")
    with pytest.raises(trainstate.InvalidArgumentError):
        trainstate.history(5)  # type: ignore[arg-type]
    other = tmp_path / "other"  # another tool's directory: nothing of ours in it
    (other / "_history").mkdir(parents=True)
    (other / "_history" / "notes.json").write_text('{"hello": "world"}')
    (other / "model.bin").write_bytes(b"\0" * 10)
    assert trainstate.history(other) == []


def test_an_encrypted_run_needs_its_key(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    key = trainstate.generate_key()
    with manager(tmp_path / "run", key=key) as mgr:
        mgr.save(0, state(0), metrics={"loss": 1.0})
    with pytest.raises(trainstate.KeyRequiredError):
        trainstate.history(tmp_path / "run")
    (entry,) = trainstate.history(tmp_path / "run", key=key)
    assert (entry.status, entry.metrics) == ("kept", {"loss": 1.0})


def test_plot_history_refuses_what_it_cannot_draw(tmp_path: Path) -> None:
    with manager(tmp_path / "run") as mgr:
        mgr.save(0, state(0), metrics={"loss": 1.0})
    with pytest.raises(trainstate.InvalidArgumentError, match=r"metric\(s\) accuracy \(recorded: loss\)"):
        trainstate.plot_history(tmp_path / "run", metrics=["accuracy"])
    with pytest.raises(trainstate.InvalidArgumentError, match="run directory or trainstate.history"):
        trainstate.plot_history([1, 2])  # type: ignore[list-item]
    (tmp_path / "empty").mkdir()
    with pytest.raises(trainstate.CheckpointNotFoundError, match="no saves to plot"):
        trainstate.plot_history(tmp_path / "empty", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
