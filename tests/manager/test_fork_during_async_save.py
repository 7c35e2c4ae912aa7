"""DataLoader workers forked while an async save is in flight exit like any other worker.

The async save queue's interpreter-exit hook lets the parent's saves finish before it exits. A forked
worker inherits the hook and the queue's jobs but not the thread writing them: it waited forever for a save
that only the parent was writing. At the end of an epoch the loader gave up on each worker after 5 s and
killed it; after a SIGKILL of the trainer (whose death the workers notice) they lived on, holding its stdout,
so a reader of that pipe never saw the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).parent.parent / "loader_during_async_save.py"
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")]),
}


def test_workers_forked_during_an_async_save_exit_normally(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "run"), "shutdown"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert (tmp_path / "run" / "step_00000001" / "manifest.json").exists()  # the parent's save was written
    # A stuck worker costs torch's 5 s join timeout at shutdown (then it is terminated): 10 s for two.
    for loader in ("per_epoch", "persistent"):
        assert result[loader]["exitcodes"] == [0, 0], result
        assert result[loader]["seconds"] < 5, result


def test_a_sigkilled_trainers_workers_let_go_of_its_stdout(tmp_path):
    trainer = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path / "run"), "kill"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=ENV,
    )
    assert trainer.stdout is not None
    workers = json.loads(trainer.stdout.readline())["workers"]
    assert trainer.wait(timeout=30) == -signal.SIGKILL
    killed = time.monotonic()
    try:
        os.set_blocking(trainer.stdout.fileno(), False)
        eof = False
        # a worker notices its parent died within torch's 5 s status interval, then exits: the pipe closes
        while not eof and time.monotonic() - killed < 12:
            try:
                eof = os.read(trainer.stdout.fileno(), 4096) == b""
            except BlockingIOError:
                time.sleep(0.1)
        alive = [pid for pid in workers if _alive(pid)]
        assert eof, f"no EOF {time.monotonic() - killed:.1f} s after the trainer's SIGKILL; workers alive: {alive}"
        assert alive == []
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        trainer.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
