"""An incremental run that resumed past a damaged checkpoint never shares the damaged bytes again.

Found by a new-user trial: after ``restore_latest`` fell back past a checkpoint whose shared bytes were
damaged, the next saves compared against that newest (damaged) checkpoint; the replayed run reproduced the
same values, so every new checkpoint referred to the damaged chunk, and retention then deleted the last good
one: the run could no longer resume at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import trainstate


@pytest.mark.parametrize("kw", [{}, {"compression": "zstd"}], ids=["plain", "zstd"])
def test_saves_after_a_fallback_do_not_share_the_damaged_bytes(tmp_path: Path, kw) -> None:
    if kw:
        pytest.importorskip("zstandard")
    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    b = a + 1

    def state(t: np.ndarray, w: float) -> dict[str, np.ndarray]:
        return {"T": t.copy(), "W": np.full(100, w, np.float32)}

    with trainstate.CheckpointManager(tmp_path, incremental=True, keep_last=3, **kw) as mgr:
        for step, (t, w) in enumerate([(a, 0.0), (b, 1.0), (b, 2.0)]):
            mgr.save(step, state(t, w))
    chunk = json.loads((tmp_path / "step_00000001" / "manifest.json").read_bytes())["tensors"]["T"]["chunks"][0]
    pool = tmp_path / "_shared" / chunk["file"]
    raw = bytearray(pool.read_bytes())
    raw[chunk["byte_range"][0] + 100] ^= 0x01  # steps 1 and 2 share this chunk
    pool.write_bytes(bytes(raw))

    target = state(np.zeros_like(a), -1.0)
    with trainstate.CheckpointManager(tmp_path, incremental=True, keep_last=3, **kw) as mgr:
        assert mgr.restore_latest(target) == 1  # steps 2 and 1 are damaged: resumed from step 0
        for step in range(1, 5):  # the run replays: T is b again, bit for bit
            mgr.save(step, state(b, float(step)))
    for step in (2, 3, 4):  # every kept checkpoint restores, and holds what was saved
        back = trainstate.load(tmp_path / f"step_{step:08d}")
        assert np.array_equal(back["T"], b) and back["W"][0] == step
    with trainstate.CheckpointManager(tmp_path, incremental=True, keep_last=3, **kw) as mgr:
        assert mgr.restore_latest(target) == 5


def test_a_manifest_copied_over_another_steps_is_not_taken_for_that_step(tmp_path: Path) -> None:
    """In an incremental run a checkpoint directory holds only its manifest: copying step 2's over step 5's
    gave a step_00000005 that verified and loaded step 2's state (new-user trial)."""
    with trainstate.CheckpointManager(tmp_path, incremental=True) as mgr:
        for step in (2, 5):
            mgr.save(step, {"w": np.full(8, step, np.float32)})
    (tmp_path / "step_00000005" / "manifest.json").write_bytes(
        (tmp_path / "step_00000002" / "manifest.json").read_bytes()
    )
    target = {"w": np.zeros(8, np.float32)}
    with trainstate.CheckpointManager(tmp_path, incremental=True) as mgr:
        assert [c.step for c in mgr.list()] == [2]
        assert mgr.restore_latest(target) == 3 and target["w"][0] == 2
