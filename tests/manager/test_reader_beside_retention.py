"""A read-only reader beside a running job never takes retention's deletes for damage or for an empty run.

The writer saves as fast as it can with keep_last=1, so each checkpoint is deleted moments after the next
one commits; the reader restores the newest in a loop. A checkpoint that vanishes between the listing and
the reading (its manifest, a data file, the whole directory) is moved past: the reader lists again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import trainstate

WRITER = """
import sys, time, numpy as np, trainstate
directory, seconds = sys.argv[1], float(sys.argv[2])
with trainstate.CheckpointManager(directory, keep_last=1) as mgr:
    step, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        step += 1
        mgr.save(step, {f"w{i}": np.full(16384, step, dtype=np.float32) for i in range(8)}, force=True)
        if step == 1:
            print("saved", flush=True)
"""
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")]),
}


def test_a_reader_beside_keep_last_1_never_reports_damage_or_nothing(tmp_path):
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), "12"], stdout=subprocess.PIPE, text=True, env=ENV
    )
    assert writer.stdout is not None and writer.stdout.readline() == "saved\n"
    reads, false_reports, last = 0, [], 0
    try:
        end = time.monotonic() + 8
        with trainstate.CheckpointManager(tmp_path, read_only=True) as reader:
            while time.monotonic() < end and writer.poll() is None:
                state = {f"w{i}": np.zeros(16384, dtype=np.float32) for i in range(8)}
                try:
                    resumed = reader.restore_latest(state)
                except trainstate.CheckpointError as e:
                    false_reports.append(f"{type(e).__name__}: {str(e)[:300]}")
                    continue
                finally:
                    reads += 1
                if resumed is None:
                    false_reports.append("None: nothing to resume")
                    continue
                step = resumed - 1
                assert all((state[f"w{i}"] == step).all() for i in range(8)), "a mix of two checkpoints"
                assert step >= last
                last = step
    finally:
        writer.kill()
        writer.wait()
    assert reads >= 100, reads
    assert false_reports == [], f"{len(false_reports)} false reports in {reads} reads: {false_reports[:3]}"
