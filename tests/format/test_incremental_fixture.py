"""The v1.4 fixture: a run directory of two incremental checkpoints that share a pool file (docs/format.md §11).

``tests/fixtures/v1.4-incremental`` is itself the run directory: ``step_00000001`` wrote the base and the
adapter into one pool file, ``step_00000002`` wrote only its new adapter and refers to the first file for
the base. Regenerate with ``python tests/format/test_incremental_fixture.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

import trainstate
from helpers import assert_same

FIXTURE = Path(__file__).parent.parent / "fixtures" / "v1.4-incremental"


def fixture_state(step: int) -> dict:
    """The state of each step: a frozen base and an adapter that changes."""
    return {
        "base": np.arange(12, dtype=np.float32).reshape(3, 4),
        "adapter": np.array([step, -step], dtype=np.float32),
        "step": step,
    }


def make(root: Path) -> None:
    with trainstate.CheckpointManager(
        root, every_steps=1, capture_rng=False, incremental=True, collective=False, threads=1
    ) as mgr:
        for step in (1, 2):
            mgr.save(step, fixture_state(step))
    (root / ".trainstate.lock").unlink()


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_bytes())


def _comparable(root: Path, step: int) -> dict:
    """A manifest without what changes from one save to the next (times, checksum, pool file names)."""
    body = _manifest(root / f"step_{step:08d}")
    for volatile in ("created", "writer", "checksum", "metadata"):
        body.pop(volatile)
    order = {f["path"]: f"pool-{i}" for i, f in enumerate(sorted(body["files"], key=lambda f: f["size"]))}
    text = json.dumps(body, sort_keys=True)
    for name, alias in order.items():
        text = text.replace(name, alias)
    return json.loads(text)


def test_the_two_checkpoints_share_a_pool_file():
    one, two = _manifest(FIXTURE / "step_00000001"), _manifest(FIXTURE / "step_00000002")
    assert one["format_version"] == two["format_version"] == "1.4"
    assert [f.get("new") for f in one["files"]] == [True]
    shared = [f for f in two["files"] if not f.get("new")]
    assert len(shared) == 1 and shared[0] == {k: v for k, v in one["files"][0].items() if k != "new"}
    assert all(f["pool"] is True for f in two["files"])
    assert two["tensors"]["base"] == one["tensors"]["base"]
    assert sorted(p.name for p in FIXTURE.iterdir()) == ["_shared", "step_00000001", "step_00000002"]
    assert [p.name for p in (FIXTURE / "step_00000002").iterdir()] == ["manifest.json"]


def test_each_checkpoint_of_the_fixture_loads_and_verifies_alone():
    for step in (1, 2):
        path = FIXTURE / f"step_{step:08d}"
        assert_same(fixture_state(step), trainstate.load(path))
        with trainstate.open(path) as ck:
            ck.verify()


def test_a_fresh_run_writes_the_fixture_again(tmp_path):
    make(tmp_path / "run")
    for step in (1, 2):
        assert _comparable(tmp_path / "run", step) == _comparable(FIXTURE, step)
    fresh = sorted(p.read_bytes() for p in (tmp_path / "run" / "_shared").iterdir())
    assert fresh == sorted(p.read_bytes() for p in (FIXTURE / "_shared").iterdir())


if __name__ == "__main__":
    shutil.rmtree(FIXTURE, ignore_errors=True)
    make(FIXTURE)
    print("wrote", FIXTURE)
