"""Concurrency: a second manager on a directory is refused; readers never see a partial checkpoint;
pins taken beside a pruning job are never deleted; a restart right after a SIGKILL is not refused.

A writer process saves continuously with retention deleting old checkpoints while this process lists,
opens and restores whatever it finds. The only acceptable failure for a reader is
CheckpointNotFoundError for a checkpoint that retention deleted between listing and opening it;
anything partial, incomplete or wrong is a violation.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import trainstate

from .common import REPO, Row, check_numpy_state, print_rows, spawn

WRITER = r"""
import sys
import trainstate
from tools.reliability.common import numpy_state

root, saves, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with trainstate.CheckpointManager(root, every_steps=1, keep_last=2, async_save=(mode == "async")) as mgr:
    print("ready", flush=True)
    for step in range(saves):
        mgr.save(step, numpy_state(step, size=1 << 18))
"""


def _writer(root: Path, saves: int, mode: str) -> subprocess.Popen[str]:
    proc, first = spawn(WRITER, str(root), str(saves), mode)
    return proc


def second_manager_refused(work: Path) -> Row:
    row = Row("a second manager on a directory in use (another process)", 1, 0, "refused")
    proc, first = spawn(WRITER, str(work / "locked"), "400", "sync")
    try:
        if first != "ready\n":  # the writer never held the directory: say why, not "a second manager was allowed"
            proc.kill()
            row.notes.append(f"the writer did not start: {first!r} {proc.communicate()[1][-2000:]}")
            return row
        trainstate.CheckpointManager(work / "locked").close()
        row.notes.append("a second manager was allowed while another process held the directory")
    except trainstate.CheckpointError as e:
        if "another CheckpointManager" in str(e):
            row.passed = 1
        else:
            row.notes.append(f"refused with an unclear error: {e}")
    finally:
        proc.kill()
        proc.wait()
    return row


def readers_during_saves(work: Path, mode: str, saves: int) -> Row:
    root = work / f"readers-{mode}"
    row = Row(f"reader listing and restoring during {mode} saves with retention", 0, 0, "reads saw a whole checkpoint")
    proc = _writer(root, saves, mode)
    deleted = 0
    try:
        while proc.poll() is None:
            reader = trainstate.CheckpointManager(root, read_only=True)
            for info in reversed(reader.list()):
                row.trials += 1
                try:
                    check_numpy_state(trainstate.load(root / info.name), info.step)
                    row.passed += 1
                except trainstate.CheckpointNotFoundError:
                    row.passed += 1  # retention removed it after we listed it: a clean miss
                    deleted += 1
                except Exception as e:  # noqa: BLE001 - any other failure is a violation
                    row.notes.append(f"{info.name}: {e!r}")
            time.sleep(0.001)
    finally:
        proc.wait()
    if proc.returncode != 0:
        row.notes.append(f"writer failed: {proc.stderr.read()[-500:] if proc.stderr else ''}")
    row.notes.insert(
        0, f"{deleted} reads found their checkpoint already deleted by retention (a clean CheckpointNotFoundError)"
    )
    return row


def pins_beside_retention(work: Path, saves: int) -> Row:
    """Another process pins the newest checkpoint over and over while the job prunes with keep_last=2."""
    root = work / "pins"
    row = Row("pins taken beside a job pruning with keep_last=2", 0, 0, "reported pins kept")
    proc = _writer(root, saves, "sync")
    reader = trainstate.CheckpointManager(root, read_only=True)
    reported, refused = [], 0
    try:
        while proc.poll() is None:
            latest = reader.latest()
            if latest is None:
                continue
            try:
                if reader.pin(latest.step, "campaign"):
                    reported.append(latest.step)
            except trainstate.CheckpointNotFoundError:
                refused += 1  # deleted before the pin took, and reported as such
    finally:
        proc.wait()
    for step in reported:
        row.trials += 1
        if (root / f"step_{step:08d}" / "manifest.json").exists():
            row.passed += 1
        else:
            row.notes.append(f"step {step}: pin reported, checkpoint deleted")
    row.notes.insert(0, f"{refused} pins were refused because retention deleted the checkpoint first")
    return row


RESTARTER = r"""
import sys, time, torch, trainstate
from torch.utils.data import DataLoader
mgr = trainstate.CheckpointManager(sys.argv[1], every_steps=1)
loader = DataLoader(list(range(64)), batch_size=4, num_workers=2, persistent_workers=True)
it = iter(loader); next(it)
mgr.save(int(sys.argv[2]), {"w": torch.ones(3)})
print("ready", flush=True)
time.sleep(60)
"""


def restart_after_sigkill(work: Path, trials: int) -> Row:
    """SIGKILL a trainer whose DataLoader workers live on, then start a manager at once."""
    import os
    import signal
    import sys

    import torch

    row = Row("restart at once after SIGKILL, DataLoader workers still alive", 0, 0, "restarts accepted")
    root = work / "restart"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for trial in range(trials):
        proc = subprocess.Popen(
            [sys.executable, "-c", RESTARTER, str(root), str(trial)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        row.trials += 1
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            os.kill(proc.pid, signal.SIGKILL)  # the workers are orphaned, not killed
            proc.wait()
            with trainstate.CheckpointManager(root) as mgr:
                if mgr.restore_latest({"w": torch.zeros(3)}) == trial + 1:
                    row.passed += 1
        except trainstate.CheckpointError as e:
            row.notes.append(f"trial {trial}: {e}")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return row


def run(saves: int = 300, restarts: int = 10) -> list[Row]:
    work = Path(tempfile.mkdtemp(prefix="trainstate-concurrency-"))
    try:
        return [
            second_manager_refused(work),
            readers_during_saves(work, "sync", saves),
            readers_during_saves(work, "async", saves),
            pins_beside_retention(work, saves * 3),
            restart_after_sigkill(work, restarts),
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=300)
    args = ap.parse_args()
    print_rows(run(args.saves))


if __name__ == "__main__":
    main()
