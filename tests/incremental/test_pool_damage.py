"""A pool file damaged or deleted while a run goes on is never shared by a later save.

An incremental save copies the chunk entries of unchanged tensors from the previous manifest: if the pool
file under them lost bytes or was altered meanwhile, the new checkpoint would name bytes that no longer
match its checksums, and every later save would too. A save checks what it shares (its size and
modification time, and its bytes where those changed or are not known yet) and writes the tensor again
where the shared bytes are gone or wrong.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import trainstate
from trainstate._storage import LocalStorage

BASE = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)  # never changes


def state(step: int) -> dict[str, np.ndarray]:
    return {"base": BASE.copy(), "w": np.full(100, step, np.float32)}


def manager(root: Path) -> trainstate.CheckpointManager:
    return trainstate.CheckpointManager(root, every_steps=1, incremental=True, capture_rng=False, keep_last=3)


def base_chunk(root: Path, step: int) -> tuple[Path, int]:
    """The pool file holding ``base`` in the checkpoint of ``step``, and where its bytes begin."""
    chunk = json.loads((root / f"step_{step:08d}" / "manifest.json").read_bytes())["tensors"]["base"]["chunks"][0]
    return root / "_shared" / chunk["file"], chunk["byte_range"][0]


def damage(root: Path, step: int, how: str) -> None:
    path, begin = base_chunk(root, step)
    if how == "delete":
        path.unlink()
        return
    if how == "append":  # the chunks are intact, but a reader refuses a file of another size than listed
        with path.open("ab") as f:
            f.write(b"\0")
        return
    raw = bytearray(path.read_bytes())
    if how == "header":  # the tensor bytes intact, the header's dtype F32 -> F16 (a reader checks the header)
        at = raw.index(b'"F32"', 0, begin)
        raw[at + 2 : at + 4] = b"16"
    else:
        raw[begin + 1000] ^= 0x04
    path.write_bytes(bytes(raw))


def assert_restores(root: Path, step: int) -> None:
    back = trainstate.load(root / f"step_{step:08d}")
    assert np.array_equal(back["base"], BASE) and back["w"][0] == step


@pytest.mark.parametrize("restart", [False, True], ids=["same-manager", "restarted"])
@pytest.mark.parametrize("how", ["flip", "delete", "append", "header"])
def test_a_save_after_pool_damage_writes_the_damaged_bytes_again(tmp_path: Path, how: str, restart: bool) -> None:
    mgr = manager(tmp_path)
    mgr.save(1, state(1))
    mgr.save(2, state(2))  # shares base with step 1
    assert base_chunk(tmp_path, 2)[0] == base_chunk(tmp_path, 1)[0]
    damage(tmp_path, 2, how)
    if restart:
        mgr.close()
        mgr = manager(tmp_path)
    mgr.save(3, state(3))
    mgr.save(4, state(4))
    mgr.close()
    assert base_chunk(tmp_path, 3)[0] != base_chunk(tmp_path, 2)[0]  # a fresh copy
    for step in (3, 4):
        assert_restores(tmp_path, step)
    with trainstate.CheckpointManager(tmp_path, incremental=True) as mgr:
        target = state(-1)
        target["base"][:] = 0
        assert mgr.restore_latest(target) == 5
        assert np.array_equal(target["base"], BASE) and target["w"][0] == 4


def test_a_pool_file_changed_after_it_was_checked_is_checked_again(tmp_path: Path) -> None:
    """The cheap path (same size and modification time as when last checked) is only taken while the file
    is unchanged: a write to it moves its modification time, and its bytes are read again."""
    with manager(tmp_path) as mgr:
        mgr.save(1, state(1))
        path, _ = base_chunk(tmp_path, 1)
        old = time.time() - 600
        os.utime(path, (old, old))  # checked again at the next save, then trusted by its time and size
        mgr.save(2, state(2))
        damage(tmp_path, 2, "flip")
        mgr.save(3, state(3))
    assert base_chunk(tmp_path, 3)[0] != path
    assert_restores(tmp_path, 3)


def test_an_unchanged_pool_file_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking what a save shares costs a stat per pool file, not a read of its bytes, once a file has been
    checked (or written) and left alone for a while."""
    with manager(tmp_path) as mgr:
        mgr.save(1, state(1))
        path, _ = base_chunk(tmp_path, 1)
        old = time.time() - 600
        os.utime(path, (old, old))
        mgr.save(2, state(2))  # reads base back once: its time changed since it was written
        reads: list[str] = []
        real = LocalStorage.read_into

        def counting(self: LocalStorage, p: str, offset: int, out: memoryview) -> int:
            reads.append(p)
            return real(self, p, offset, out)

        monkeypatch.setattr(LocalStorage, "read_into", counting)
        mgr.save(3, state(3))
        assert str(path) not in reads
    assert_restores(tmp_path, 3)


KEY = trainstate.generate_key()


@pytest.mark.parametrize("restart", [False, True], ids=["same-manager", "restarted"])
@pytest.mark.parametrize(
    "kw", [{"async_save": True}, {"compression": "zstd"}, {"key": KEY}], ids=["async", "zstd", "encrypted"]
)
def test_damage_is_not_shared_with_async_saves_or_transforms(
    tmp_path: Path, kw: dict[str, object], restart: bool
) -> None:
    if "compression" in kw:
        pytest.importorskip("zstandard")
    if "key" in kw:
        pytest.importorskip("cryptography")
    mgr = trainstate.CheckpointManager(tmp_path, every_steps=1, incremental=True, capture_rng=False, **kw)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    mgr.wait()
    damage(tmp_path, 2, "flip")
    if restart:
        mgr.close()
        mgr = trainstate.CheckpointManager(tmp_path, every_steps=1, incremental=True, capture_rng=False, **kw)
    mgr.save(3, state(3))
    mgr.close()
    back = trainstate.load(tmp_path / "step_00000003", key=kw.get("key"))  # type: ignore[arg-type]
    assert np.array_equal(back["base"], BASE) and back["w"][0] == 3


def test_damage_the_stat_cannot_see_is_found_when_the_check_is_due_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte flipped under an unchanged size and modification time (bit rot, a tool that restores the time)
    passes the stat; bytes checked longer ago than RECHECK_SECONDS are read again, which finds it."""
    from trainstate._incremental import check

    with manager(tmp_path) as mgr:
        mgr.save(1, state(1))
        path, _ = base_chunk(tmp_path, 1)
        old = time.time() - 600
        os.utime(path, (old, old))
        mgr.save(2, state(2))  # read back once, then vouched for by time and size
        damage(tmp_path, 2, "flip")
        os.utime(path, (old, old))  # the stat sees nothing
        monkeypatch.setattr(check, "RECHECK_SECONDS", 0.0)  # the hour is up
        mgr.save(3, state(3))
    assert base_chunk(tmp_path, 3)[0] != path
    assert_restores(tmp_path, 3)


def test_when_every_checkpoint_shares_one_damaged_pool_file_the_error_says_the_way_out(tmp_path: Path) -> None:
    """Damage the hourly check has not yet seen reaches every kept checkpoint: restore_latest said only that
    none restores, and told the user to start over; excluding the shared tensor restores the rest."""
    with manager(tmp_path) as mgr:
        for step in range(3):
            mgr.save(step, state(step))
    damage(tmp_path, 0, "flip")  # base is in one pool file every checkpoint names
    target = state(0)
    with manager(tmp_path) as mgr:
        with pytest.raises(trainstate.CorruptCheckpointError, match=r"exclude=") as e:
            mgr.restore_latest(target)
        assert "share the pool's files" in str(e.value)
        assert mgr.restore_latest(target, exclude="base") == 3 and target["w"][0] == 2


def test_when_the_whole_pool_is_gone_the_error_says_so_not_to_exclude_tensors(tmp_path: Path) -> None:
    import shutil

    with manager(tmp_path) as mgr:
        for step in range(3):
            mgr.save(step, state(step))
    shutil.rmtree(tmp_path / "_shared")  # deleted by hand
    with manager(tmp_path) as mgr, pytest.raises(trainstate.CorruptCheckpointError, match="_shared/\\) is gone") as e:
        mgr.restore_latest(state(0))
    assert "exclude=" not in str(e.value)
    from helpers import cli

    shown = cli("ls", str(tmp_path), code=None).stdout  # not "complete": none of them loads
    assert "pool missing" in shown and "0 complete" in shown and "3 pool missing" in shown, shown


def test_a_run_whose_pool_links_to_another_runs_pool_is_refused_and_collects_nothing(tmp_path: Path) -> None:
    """Run b's _shared linked to run a's (to keep a frozen base once): each run's collection deleted the
    other's pool files, so a's checkpoints lost their bytes to b's retention."""
    a, b = tmp_path / "a", tmp_path / "b"
    with manager(a) as mgr:
        for step in range(2):
            mgr.save(step, state(step))
    b.mkdir()
    (b / "_shared").symlink_to(a / "_shared")
    with pytest.raises(trainstate.InvalidArgumentError, match="symbolic link"):
        manager(b)
    with trainstate.CheckpointManager(b, every_steps=1, keep_last=1, capture_rng=False) as plain:
        for step in range(3):  # a plain run with retention beside the link: its collection leaves the pool alone
            plain.save(step, {"w": np.full(10, step, np.float32)})
    assert_restores(a, 1)
    assert_restores(a, 0)
