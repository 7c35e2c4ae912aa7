"""Incremental runs with compression and encryption: unchanged tensors are shared through their raw checksums
(recorded by zstd, kept in memory for encrypted chunks), every checkpoint still loads on its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import trainstate

pytest.importorskip("zstandard")
pytest.importorskip("cryptography")

KEY = bytes(range(32))  # a test key


def _pool(root: Path) -> int:
    return sum(f.stat().st_size for f in (root / "_shared").iterdir())


def _base() -> np.ndarray:
    # 8 MiB (two 4 MiB chunks once transformed) of weights that compress a little, as trained ones do
    return np.random.default_rng(0).standard_normal((1024, 2048), dtype=np.float32)


@pytest.mark.parametrize(
    "kw", [{"compression": "zstd"}, {"key": KEY}, {"compression": "zstd", "key": KEY}], ids=["zstd", "key", "both"]
)
def test_unchanged_transformed_tensors_are_shared_and_restart_behaves_as_documented(tmp_path: Path, kw) -> None:
    base, sizes = _base(), []
    for process in range(2):  # a restart between the two: the second manager starts from the manifests
        with trainstate.CheckpointManager(tmp_path, incremental=True, keep_last=2, **kw) as mgr:
            for step in range(3 * process, 3 * process + 3):
                mgr.save(step, {"base": base, "adapter": np.full(16, step, np.float32)})
                sizes.append(_pool(tmp_path))
    grew = [b - a for a, b in zip(sizes, sizes[1:])]
    big = base.nbytes // 100  # more than any adapter, less than any copy of the base
    assert all(g < big for g in grew[:2]) and all(g < big for g in grew[3:])  # within a process: shared
    if "key" in kw:
        assert grew[2] > big  # encrypted: no raw checksum on disk, so written once more after the restart
    else:
        assert grew[2] < big  # compressed: the recorded raw checksum shares it across the restart
    for step in (4, 5):  # each kept checkpoint loads and verifies on its own
        path = tmp_path / f"step_{step:08d}"
        back = trainstate.load(path, key=kw.get("key"))
        assert np.array_equal(back["base"], base) and back["adapter"][0] == step
        with trainstate.open(path, key=kw.get("key")) as ck:
            ck.verify()
    if "key" in kw:
        with pytest.raises(trainstate.KeyRequiredError):
            trainstate.load(tmp_path / "step_00000005")
