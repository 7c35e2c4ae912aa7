"""SIGKILL during the retention and pool collection of an incremental run: no kept checkpoint loses a byte.

A real training process saves every step with ``keep_last=2``; each save deletes a checkpoint and then the
pool files nothing names any more. The process kills itself (SIGKILL, nothing runs after it) just before
its k-th delete, k drawn at random, so the kill lands between hiding a checkpoint and removing it, or
between two pool deletions. Then every checkpoint left must load and verify, a new manager must sweep the
leftovers without taking a byte a checkpoint uses, and the run must go on deduplicating.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

import trainstate
from trainstate._format.run_dir import is_staging_name

CHILD = r"""
import os, signal, sys
import numpy as np, trainstate
from trainstate._storage.local import LocalStorage

root, kill_at = sys.argv[1], int(sys.argv[2])
deletes = 0
real_delete = LocalStorage.delete

def delete(self, path):
    global deletes
    deletes += 1
    if deletes == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    real_delete(self, path)

LocalStorage.delete = delete
base = np.arange(300_000, dtype=np.float32)
mgr = trainstate.CheckpointManager(  # collective=False: no torch import, a quick start
    root, every_steps=1, keep_last=2, fsync=False, capture_rng=False, incremental=True, collective=False
)
for step in range(1, 1000):
    base_now = base if step < 4 else base + 1  # the base changes once: its first copy becomes garbage
    mgr.save(step, {"base": base_now, "adapter": np.full(64, step, dtype=np.float32), "step": step})
"""


def _expected_base(step: int) -> np.ndarray:
    base = np.arange(300_000, dtype=np.float32)
    return base if step < 4 else base + 1


def _check(root: Path) -> list[int]:
    """Every committed checkpoint loads alone with its step's values and verifies; returns the steps."""
    steps = []
    for path in sorted(root.glob("step_*")):
        if not (path / "manifest.json").exists():
            continue
        got = trainstate.load(path)
        step = got["step"]
        assert path.name == f"step_{step:08d}"
        assert np.array_equal(got["base"], _expected_base(step)) and (got["adapter"] == step).all()
        with trainstate.open(path) as ck:
            ck.verify()
        steps.append(step)
    return steps


def _named(root: Path) -> set[str]:
    out: set[str] = set()
    for m in root.glob("*/manifest.json"):
        out |= {f["path"] for f in json.loads(m.read_bytes())["files"] if f.get("pool")}
    return out


def test_sigkill_during_retention_and_pool_collection_keeps_every_kept_checkpoint_whole(tmp_path):
    rnd = random.Random(12)
    roots = [tmp_path / f"run{i}" for i in range(3)]
    kills = [rnd.randint(1, 16) for _ in roots]  # retention and collection each delete about once a save
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(k)]) for r, k in zip(roots, kills)]
    for proc in procs:  # three runs at once: their interpreters start while the others save
        assert proc.wait(timeout=120) == -signal.SIGKILL
    for root in roots:
        assert _check(root)
        with trainstate.CheckpointManager(root, every_steps=1, keep_last=2, capture_rng=False, incremental=True) as mgr:
            assert not [
                n for n in os.listdir(root) if is_staging_name(n)
            ]  # the sweep removed (or put back) what the kill left
            assert {p.name for p in (root / "_shared").iterdir()} == _named(root)  # and the orphaned pool files
            steps = _check(root)
            step = max(steps) + 1
            mgr.save(step, {"base": _expected_base(step), "adapter": np.full(64, step, np.float32), "step": step})
            assert mgr.history()[-1].nbytes < 10_000  # the base is still shared after the restart
        assert _check(root)[-1] == step
