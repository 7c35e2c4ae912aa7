"""Locks and signals belong to the manager that took them: forks, SIGKILL, dropped managers, Ctrl-C."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import trainstate

torch = pytest.importorskip("torch")

_WORKERS_SCRIPT = textwrap.dedent("""
    import sys, time, torch, trainstate
    from torch.utils.data import DataLoader
    mgr = trainstate.CheckpointManager(sys.argv[1], every_steps=1)
    loader = DataLoader(list(range(64)), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader); next(it)                      # the workers are forked now, lock and all
    mgr.save(1, {"w": torch.ones(3)})
    print("ready", flush=True)
    time.sleep(60)
""")


def test_a_restart_right_after_sigkill_is_not_refused_by_orphaned_workers(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKERS_SCRIPT, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGKILL)  # the trainer dies; its DataLoader workers live on for a while
        proc.wait()
        with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:  # at once, not seconds later
            state = {"w": torch.zeros(3)}
            assert mgr.restore_latest(state) == 2
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_close_with_persistent_workers_alive_frees_the_directory(tmp_path):
    from torch.utils.data import DataLoader

    mgr = trainstate.CheckpointManager(tmp_path)
    loader = DataLoader(list(range(64)), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    mgr.close()
    with trainstate.CheckpointManager(tmp_path):
        pass
    del it, loader
    gc.collect()  # shut the workers down here, not in whichever test collects next


def test_a_dropped_manager_gives_back_its_lock_and_signal_handlers(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    mgr = trainstate.CheckpointManager(tmp_path)  # a notebook cell...
    assert signal.getsignal(signal.SIGINT) != before[signal.SIGINT]
    del mgr  # ...and the manager dropped without close()
    assert {s: signal.getsignal(s) for s in before} == before
    with trainstate.CheckpointManager(tmp_path):
        pass
    mgr = trainstate.CheckpointManager(tmp_path)
    holder = [mgr, {"cycle": None}]
    holder[1]["cycle"] = holder  # kept alive only by a reference cycle: freed by one collection
    del mgr, holder
    with trainstate.CheckpointManager(tmp_path):
        pass
    gc.collect()


def test_a_live_second_manager_in_the_same_process_is_refused_with_what_to_do(tmp_path):
    first = trainstate.CheckpointManager(tmp_path)
    with pytest.raises(trainstate.CheckpointError, match="this process"):
        trainstate.CheckpointManager(tmp_path)
    first.close()


def test_a_constructor_that_fails_leaves_no_lock_and_no_handlers(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(trainstate.InvalidArgumentError):
        trainstate.CheckpointManager(tmp_path, keep_best=("loss", "minimum", 2))
    assert signal.getsignal(signal.SIGINT) == before
    with trainstate.CheckpointManager(tmp_path):
        pass


def test_a_full_disk_while_writing_the_lock_is_a_storage_error(tmp_path):
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mnt / "run").mkdir()
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:  # fill every block
                os.write(fd, b"x" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        before = signal.getsignal(signal.SIGINT)
        with pytest.raises(trainstate.StorageError):
            trainstate.CheckpointManager(mnt / "run")
        assert signal.getsignal(signal.SIGINT) == before
        (mnt / "filler").unlink()
        with trainstate.CheckpointManager(mnt / "run"):  # nothing was left held
            pass
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # lazy: even if a leaked fd holds it


_CTRL_C_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time, torch, trainstate
    from trainstate._storage.local import LocalStorage

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even if started with it ignored

    class Slow(LocalStorage):
        def _write(self, fd, view):
            time.sleep(0.2)
            return super()._write(fd, view)

    mgr = trainstate.CheckpointManager(sys.argv[1], every_steps=1, async_save=True, storage=Slow())
    mgr.save(1, {"w": torch.ones(1000)})             # in flight for a while
    os.kill(os.getpid(), signal.SIGINT)              # first Ctrl-C: remembered
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()   # second Ctrl-C, while waiting
    start = time.monotonic()
    try:
        mgr.save(2, {"w": torch.ones(1000)})         # the preemption save waits for the one in flight
    except KeyboardInterrupt:
        print("interrupted after %.1fs" % (time.monotonic() - start), flush=True)
        os._exit(0)
    print("not interrupted", flush=True)
""")


def test_a_second_ctrl_c_interrupts_while_an_async_save_is_in_flight(tmp_path):
    # each data file write sleeps; the in-flight save takes several seconds, the second Ctrl-C comes at 0.3 s
    out = subprocess.run(
        [sys.executable, "-c", _CTRL_C_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.startswith("interrupted"), out.stdout + out.stderr


def test_the_first_ctrl_c_saves_and_sets_preempted(tmp_path):
    with trainstate.CheckpointManager(tmp_path, every_steps=100) as mgr:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert mgr.save(3, {"w": torch.ones(2)}) and mgr.preempted
    assert (tmp_path / "step_00000003" / "manifest.json").exists()


_RETRY_SCRIPT = textwrap.dedent("""
    import sys, torch, trainstate

    def train(attempt):
        mgr = trainstate.CheckpointManager(sys.argv[1], every_steps=10, async_save=True)
        state = {"w": torch.zeros(2_000_000)}
        start = mgr.restore_latest(state) or 0
        for step in range(start, 60):
            state["w"].add_(1)
            mgr.save(step, state)
            if attempt == 0 and step == 50:
                raise RuntimeError("transient failure")   # the manager is dropped with a save in flight
        mgr.close()
        return start

    try:
        train(0)
    except RuntimeError:
        pass
    print("resumed at", train(1), flush=True)
""")


def test_a_manager_dropped_with_an_async_save_in_flight_lets_a_retry_start(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _RETRY_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "resumed at 51", out.stdout + out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr


_EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, trainstate
    mgr = trainstate.CheckpointManager(sys.argv[1], every_steps=1, async_save=True)
    mgr.save(1, {"w": torch.ones(4_000_000)})
    # the script ends here, without close(): the save it was told had started must still commit
""")


def test_an_async_save_in_flight_at_exit_still_commits(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "step_00000001" / "manifest.json").exists(), out.stderr


def test_close_with_a_final_step_never_silently_does_nothing(tmp_path):
    mgr = trainstate.CheckpointManager(tmp_path)
    with pytest.raises(trainstate.InvalidArgumentError, match="both"):
        mgr.close(7)
    mgr.close()
    with pytest.raises(trainstate.CheckpointError, match="closed"):
        mgr.close(8, {"w": torch.ones(2)})


def test_settings_cannot_be_set_on_a_built_manager(tmp_path):
    with trainstate.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(trainstate.InvalidArgumentError, match="keep_last"):
            mgr.keep_last = 5  # not a setting of a built manager: silently ignored before


@pytest.mark.parametrize("kwargs", [{"async_save": "yes"}, {"fsync": 1}])
def test_flags_must_be_booleans(tmp_path, kwargs):
    with pytest.raises(trainstate.InvalidArgumentError):
        trainstate.CheckpointManager(tmp_path, **kwargs)


@pytest.mark.parametrize("directory", [None, "", 123])
def test_a_bad_directory_is_an_argument_error(directory):
    with pytest.raises(trainstate.InvalidArgumentError):
        trainstate.CheckpointManager(directory)


@pytest.fixture
def ctrl_c_as_at_a_terminal():
    """SIGINT raising KeyboardInterrupt, as at a terminal: a process started in the background (`cmd &` in a
    non-interactive shell, as a CI script may start the tests) inherits it ignored, and so would the manager."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_as_at_a_terminal")
def test_forked_children_do_not_act_on_the_managers_signal_handler(tmp_path):
    with trainstate.CheckpointManager(tmp_path):
        gc.collect()
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say: Ctrl-C to the group reaches it too
            gc.disable()  # no finalizer of the parent's objects runs here
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
                os._exit(1)  # the manager's handler swallowed it
            except KeyboardInterrupt:
                os._exit(0)  # as if no manager existed
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
