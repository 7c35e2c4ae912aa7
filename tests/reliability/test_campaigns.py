"""The reliability campaigns, at test size: crashes, injected faults, a disk that fills up, concurrency.

tools/reliability runs the same code at full size and writes docs/reliability.md.
"""

from __future__ import annotations

import errno

import pytest
from tools.reliability import concurrency, crash, faults

from trainstate._storage.faulty import OPERATIONS

pytestmark = pytest.mark.campaign  # run at test size; `-m "not campaign"` for a quick loop


def _clean(row) -> None:
    assert row.trials > 0, row.campaign
    assert row.passed == row.trials, f"{row.campaign}: " + "\n".join(row.notes)


def test_sigkill_during_sync_and_async_saves(tmp_path):
    for row in crash.run(kills=3, seed=7):
        _clean(row)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_injected_write_fsync_rename_failure_is_clean(tmp_path, mode):
    row = faults.injected(tmp_path, mode)
    _clean(row)
    # The campaign fails the 1st, 2nd, ... call of each operation until a save makes no more such calls, so
    # every call is covered by construction; here: each kind of operation was reached at least once. (The
    # count of calls is the saver's business: gathering small tensors into 1 MiB writes took it from 15 to 13.)
    assert row.trials >= len(OPERATIONS)
    assert row.trials == row.passed


def test_injected_io_error_and_overwrite(tmp_path):
    _clean(faults.injected(tmp_path, "sync", errno.EIO))
    _clean(faults.overwrite_faults(tmp_path))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_real_filesystem_filling_up(mode):
    mnt = faults.mount_tmpfs("1m")
    if mnt is None:
        pytest.skip("mounting a tmpfs needs root")
    faults.unmount(mnt)
    _clean(faults.real_disk_full(mode, rounds=1))


def test_concurrent_managers_and_readers():
    # one restart after SIGKILL (a fresh process importing torch): test_lifecycle restarts once more, and
    # the full-size campaign ten times
    for row in concurrency.run(saves=30, restarts=1):
        _clean(row)
