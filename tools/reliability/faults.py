"""Disk full and I/O errors: every create / write / fsync / rename of a save fails once, in turn.

For each operation and each N, a save whose Nth such call fails with ENOSPC (or EIO) is attempted beside
two committed checkpoints. Each time: the error is a StorageError naming the path, the earlier checkpoints
still restore exactly, no staging leftovers remain, and the new checkpoint is either absent or complete.
A fault in the save's history record (``_history/``, written after the commit) raises nothing: the
checkpoint is committed and whole, and only its timings are missing from ``trainstate history``.
Async saves must surface the error on the next call. Then the same on a real tmpfs that actually fills up.
"""

from __future__ import annotations

import argparse
import errno
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import trainstate
from trainstate._format.run_dir import is_staging_name
from trainstate._history.log import read as read_history
from trainstate._storage import LocalStorage
from trainstate._storage.faulty import OPERATIONS, FaultyStorage

from .common import Row, check_numpy_state, numpy_state, print_rows

MAX_CALLS = 200  # no save here makes more calls of one kind


def _baseline(root: Path) -> None:
    with trainstate.CheckpointManager(root, every_steps=1) as mgr:
        for step in (0, 1):
            mgr.save(step, numpy_state(step))


def _only_a_record_failed(root: Path, raised: BaseException | None, steps: tuple[int, ...]) -> bool:
    """Whether the fault hit a save's history record, written after its commit: by design that fails no
    save (the checkpoint is committed), so the save returned, its checkpoint lists without timings, and
    the record cut short was removed rather than left torn."""
    if raised is not None:
        return False
    lost = [e for e in trainstate.history(root) if e.step in steps and e.note == "no timing record"]
    return bool(lost) and all(e.status == "kept" for e in lost) and not read_history(LocalStorage(), str(root))[1]


def _invariants(root: Path, new_step: int, raised: BaseException | None, expect_error: bool) -> list[str]:
    problems = []
    if expect_error and not isinstance(raised, trainstate.StorageError):
        problems.append(f"expected a StorageError, got {raised!r}")
    if isinstance(raised, trainstate.StorageError) and raised.errno not in (errno.ENOSPC, errno.EIO):
        problems.append(f"error lost its errno: {raised!r}")
    leftovers = [p.name for p in root.iterdir() if is_staging_name(p.name)]
    if leftovers:
        problems.append(f"leftovers: {leftovers}")
    for step in (0, 1):
        try:
            check_numpy_state(trainstate.load(root / f"step_{step:08d}"), step)
        except Exception as e:  # noqa: BLE001 - any failure is a finding
            problems.append(f"step {step} no longer restores: {e!r}")
    new = root / f"step_{new_step:08d}"
    if new.exists():
        try:
            check_numpy_state(trainstate.load(new), new_step)
        except Exception as e:  # noqa: BLE001
            problems.append(f"new checkpoint visible but broken: {e!r}")
    return problems


def _sync_trial(root: Path, storage: FaultyStorage) -> BaseException | None:
    try:
        with trainstate.CheckpointManager(root, every_steps=1, storage=storage) as mgr:
            mgr.save(2, numpy_state(2))
    except Exception as e:  # noqa: BLE001 - the trial inspects it
        return e
    return None


def _async_trial(root: Path, storage: FaultyStorage) -> BaseException | None:
    mgr = trainstate.CheckpointManager(root, every_steps=1, async_save=True, storage=storage)
    try:
        mgr.save(2, numpy_state(2))  # returns at once; the failure happens in the background
        mgr.save(3, numpy_state(3), force=True)  # ... and must be raised here or by close()
    except Exception as e:  # noqa: BLE001
        error: BaseException | None = e
    else:
        error = None
    try:
        mgr.close()
    except Exception as e:  # noqa: BLE001
        error = error or e
    return error


def injected(work: Path, mode: str, error: int = errno.ENOSPC) -> Row:
    """Every call of every operation fails once; ``mode`` is "sync" or "async"."""
    trial: Callable[[Path, FaultyStorage], BaseException | None] = _sync_trial if mode == "sync" else _async_trial
    row = Row(
        f"injected {errno.errorcode[error]} at the Nth create/write/fsync/rename, {mode} save",
        0,
        0,
        "clean error, nothing lost",
    )
    for op in OPERATIONS:
        for n in range(1, MAX_CALLS):
            root = work / f"{mode}-{op}-{n}"
            _baseline(root)
            storage = FaultyStorage(op, n, error)
            raised = trial(root, storage)
            if not storage.fired:  # the save made fewer than n such calls: this op is exhausted
                shutil.rmtree(root)
                break
            row.trials += 1
            record_only = _only_a_record_failed(root, raised, (2, 3))
            problems = _invariants(root, 2, raised, expect_error=not record_only)
            if problems:
                row.notes.append(f"{op} #{n}: {'; '.join(problems)}")
            else:
                row.passed += 1
            shutil.rmtree(root)
    return row


def overwrite_faults(work: Path) -> Row:
    """trainstate.save(overwrite=True) failing anywhere leaves the old checkpoint or the new one, whole."""
    row = Row("injected ENOSPC during save(overwrite=True)", 0, 0, "old or new checkpoint intact")
    for op in OPERATIONS:
        for n in range(1, MAX_CALLS):
            root = work / f"over-{op}-{n}"
            trainstate.save(root / "c", numpy_state(1))
            storage = FaultyStorage(op, n)
            try:
                trainstate.save(root / "c", numpy_state(2), overwrite=True, storage=storage)
                raised = None
            except Exception as e:  # noqa: BLE001
                raised = e
            if not storage.fired:
                shutil.rmtree(root)
                break
            row.trials += 1
            try:
                state = trainstate.load(root / "c")
                check_numpy_state(state, state["step"])
                leftovers = [p.name for p in root.iterdir() if is_staging_name(p.name)]
                ok = isinstance(raised, trainstate.StorageError) and not leftovers
                if ok:
                    row.passed += 1
                else:
                    row.notes.append(f"{op} #{n}: raised {raised!r}, leftovers {leftovers}")
            except Exception as e:  # noqa: BLE001
                row.notes.append(f"{op} #{n}: checkpoint lost: {e!r}")
            shutil.rmtree(root)
    return row


def mount_tmpfs(size: str) -> Path | None:
    """A real filesystem of ``size`` that fills up (needs root); None where mounting is not allowed."""
    mnt = Path(tempfile.mkdtemp(prefix="trainstate-full-"))
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        mnt.rmdir()
        return None
    return mnt


def unmount(mnt: Path) -> None:
    subprocess.run(["umount", str(mnt)], check=False, capture_output=True)
    shutil.rmtree(mnt, ignore_errors=True)


def real_disk_full(mode: str, rounds: int = 5) -> Row:
    """Save growing states onto a 6 MB tmpfs until it is full; check the error and what survives."""
    row = Row(f"real tmpfs filling up, {mode} save", 0, 0, "clean error, nothing lost")
    for _ in range(rounds):
        mnt = mount_tmpfs("6m")
        if mnt is None:
            row.notes.append("skipped: cannot mount a tmpfs here (needs root)")
            return row
        try:
            row.trials += 1
            problems = _fill(mnt / "run", mode)
            if problems:
                row.notes.append("; ".join(problems))
            else:
                row.passed += 1
        finally:
            unmount(mnt)
    return row


def _fill(root: Path, mode: str) -> list[str]:
    mgr = trainstate.CheckpointManager(root, every_steps=1, async_save=(mode == "async"))
    raised: BaseException | None = None
    step = 0
    try:
        for step in range(100):  # each checkpoint ~1 MB: the 6 MB disk fills within a few saves
            mgr.save(step, numpy_state(step, size=1 << 18))
    except Exception as e:  # noqa: BLE001
        raised = e
    try:
        mgr.close()
    except Exception as e:  # noqa: BLE001
        raised = raised or e
    problems = []
    if not isinstance(raised, trainstate.StorageError) or raised.errno != errno.ENOSPC:
        problems.append(f"expected StorageError(ENOSPC), got {raised!r}")
    leftovers = [p.name for p in root.iterdir() if is_staging_name(p.name)]
    if leftovers:
        problems.append(f"leftovers: {leftovers}")
    listed = trainstate.CheckpointManager(root, storage=LocalStorage())
    try:
        infos = listed.list()
        if not infos:
            problems.append("no checkpoint survived")
        for info in infos:
            check_numpy_state(trainstate.load(root / info.name), info.step)
    except Exception as e:  # noqa: BLE001
        problems.append(f"a listed checkpoint does not restore: {e!r}")
    finally:
        listed.close()
    return problems


def run(quick: bool = False) -> list[Row]:
    work = Path(tempfile.mkdtemp(prefix="trainstate-faults-"))
    try:
        rows = [
            injected(work, "sync"),
            injected(work, "async"),
            injected(work, "sync", errno.EIO),
            overwrite_faults(work),
            real_disk_full("sync", 2 if quick else 5),
            real_disk_full("async", 2 if quick else 5),
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print_rows(run(args.quick))


if __name__ == "__main__":
    main()
