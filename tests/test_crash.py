"""SIGKILL during save: whatever was committed loads complete and correct; nothing partial is visible."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trainstate
from trainstate._format.run_dir import staged_target, staging_name

CHILD = r"""
import sys, numpy as np, trainstate
root = sys.argv[1]
step = 0
while True:
    state = {"w": np.full((256, 1024), step, dtype=np.float32), "b": np.full(4096, step, dtype=np.int64),
             "step": step}
    trainstate.save(f"{root}/step_{step:06d}", state)
    trainstate.save(f"{root}/latest", state, overwrite=True)
    print(step, flush=True)
    step += 1
"""


def _check_visible(root: Path) -> int:
    """Every visible checkpoint is complete and holds its step's values; returns how many there are."""
    visible = [p for p in root.iterdir() if not p.name.startswith(".")]
    for p in visible:
        state = trainstate.load(p)
        step = state["step"]
        if p.name != "latest":
            assert p.name == f"step_{step:06d}"
        assert (state["w"] == step).all() and (state["b"] == step).all()
        with trainstate.open(p) as ck:
            ck.verify()
    return len(visible)


@pytest.mark.parametrize("seed", range(6))
def test_sigkill_mid_save_leaves_only_complete_checkpoints(tmp_path, seed):
    rnd = random.Random(seed)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # one save pair committed
        time.sleep(rnd.uniform(0.0, 0.3))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert _check_visible(tmp_path) >= 2
    assert (tmp_path / "latest").is_dir()  # the overwritten checkpoint is never missing
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert all((staged_target(n) or ("", ""))[1] == "tmp" for n in leftovers), leftovers


def test_overwrite_without_rename_exchange_and_recovery(tmp_path, monkeypatch):
    """Where RENAME_EXCHANGE is missing, overwrite takes two renames; a crash between them is recoverable."""
    from trainstate._storage.local import LocalStorage

    monkeypatch.setattr(LocalStorage, "_exchange", lambda self, a, b: False)
    trainstate.save(tmp_path / "c", {"v": 0})
    trainstate.save(tmp_path / "c", {"v": 1}, overwrite=True)
    assert trainstate.load(tmp_path / "c") == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    for aside in (staging_name("c", "old"), ".c.old-123"):  # ours, and what earlier versions named it
        os.rename(tmp_path / "c", tmp_path / aside)  # as if killed between the two renames
        assert trainstate.load(tmp_path / "c") == {"v": 1}  # a reader puts it back
        assert [p.name for p in tmp_path.iterdir()] == ["c"]


_STARTED: list[str] = []  # processes started while a test below listens (the audit hook stays, inert, after it)
_LISTENING: list[bool] = []
_HOOKED: list[bool] = []


def _record_process_starts(event: str, args: tuple[object, ...]) -> None:
    if _LISTENING and event in ("subprocess.Popen", "os.fork", "os.posix_spawn", "os.exec"):
        _STARTED.append(f"{event} {args!r:.80}")


def test_overwrite_starts_no_process(tmp_path):
    """Saving over a checkpoint starts no other process. It used to run ``ldconfig -p`` (ctypes.util.find_library)
    at every overwrite to find renameat2: on a background save thread (Lightning's async save overwrites
    last.ckpt) that raced the DataLoader forking its workers, a worker inherited the pipe that subprocess waits
    on, and the save, and then training, hung for good."""
    if not _HOOKED:  # an audit hook cannot be removed: one per process, listening only inside this test
        sys.addaudithook(_record_process_starts)
        _HOOKED.append(True)
    trainstate.save(tmp_path / "c", {"v": 0})
    _STARTED.clear()
    _LISTENING.append(True)
    try:
        trainstate.save(tmp_path / "c", {"v": 1}, overwrite=True)
    finally:
        _LISTENING.clear()
    assert _STARTED == []
    assert trainstate.load(tmp_path / "c") == {"v": 1}
