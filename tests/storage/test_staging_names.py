"""The hidden names of staging directories and of checkpoints moved aside (replaced, being deleted).

They must never look like the checkpoint they stand for to a tool that scans a directory by name (Lightning's
SLURM auto-resume reads the digits after ``hpc_ckpt_`` in every name), yet still name it for the code that
puts a replaced or pinned checkpoint back and sweeps the rest.
"""

from __future__ import annotations

import os

import pytest

import trainstate
from trainstate._convert.output import sweep_leftovers
from trainstate._format.run_dir import is_staging_name, staged_target, staging_name


@pytest.mark.parametrize("name", ["hpc_ckpt_2.ckpt", "step_00000040", "last.ckpt", "模型", "a.tmp-b"])
@pytest.mark.parametrize("tag", ["tmp", "old", "del"])
def test_a_staging_name_hides_its_target_and_names_it(name, tag):
    staged = staging_name(name, tag)
    assert staged.startswith(".trainstate-") and name not in staged and "ckpt" not in staged
    assert staged_target(staged) == (name, tag) and is_staging_name(staged)
    assert staging_name(name, tag) != staged  # a fresh random part each time


def test_names_of_older_versions_and_too_long_names_are_still_understood():
    assert staged_target(".step_00000040.tmp-0123abcd") == ("step_00000040", "tmp")
    assert staged_target(".c.old-123") == ("c", "old")
    long = "x" * 200  # too long to spell in hex within one path component
    staged = staging_name(long, "del")
    assert len(staged) <= 255 and staged_target(staged) == (long, "del")
    for other in ("step_00000040", ".trainstate-probe-0123", ".hidden", ".trainstate-tmp-zz-0123"):
        assert staged_target(other) is None and not is_staging_name(other)
    with pytest.raises(ValueError):
        staging_name("c", "new")


def test_a_killed_save_and_a_killed_delete_are_swept_and_a_pinned_one_put_back(tmp_path):
    storage = trainstate.LocalStorage()
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"v": step})
        mgr.pin(3, "keep")
    staging = storage.begin(str(tmp_path / "step_00000004"), overwrite=False)  # a save killed before its commit
    deleted = storage.hide(str(tmp_path / "step_00000001"))  # a delete killed after moving it aside
    storage.hide(str(tmp_path / "step_00000003"))  # a retention that found the pin, killed before putting it back
    with trainstate.CheckpointManager(tmp_path) as mgr:
        assert [i.step for i in mgr.list()] == [2, 3] and mgr.list()[1].pinned
        assert sorted(mgr.swept) == sorted(os.path.basename(p) for p in (staging, deleted or ""))
    assert not [n for n in os.listdir(tmp_path) if is_staging_name(n)]


def test_an_export_killed_mid_replace_is_put_back(tmp_path):
    out = tmp_path / "model"
    aside = tmp_path / staging_name("model", "old")
    aside.mkdir()
    (aside / "model.safetensors").write_bytes(b"x")
    (tmp_path / staging_name("model", "tmp")).mkdir()  # a killed export's staging, held by nobody
    (tmp_path / staging_name("other", "tmp")).mkdir()  # another output's: not ours to touch
    assert len(sweep_leftovers(out)) == 2
    assert (out / "model.safetensors").read_bytes() == b"x"
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == [
        n for n in os.listdir(tmp_path) if staged_target(n) == ("other", "tmp")
    ]
