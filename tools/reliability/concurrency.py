"""Concurrency: a second manager on a directory is refused; readers never see a partial checkpoint.

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

from .common import Row, check_numpy_state, print_rows, spawn

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
    proc = _writer(work / "locked", 400, "sync")
    try:
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
    row = Row(f"reader listing and restoring during {mode} saves with retention", 0, 0,
              "reads saw a whole checkpoint")
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
    row.notes.insert(0, f"{deleted} reads found their checkpoint already deleted by retention (a clean "
                        "CheckpointNotFoundError)")
    return row


def run(saves: int = 300) -> list[Row]:
    work = Path(tempfile.mkdtemp(prefix="trainstate-concurrency-"))
    try:
        return [second_manager_refused(work), readers_during_saves(work, "sync", saves),
                readers_during_saves(work, "async", saves)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=300)
    args = ap.parse_args()
    print_rows(run(args.saves))


if __name__ == "__main__":
    main()
