"""Attacks on tools/crashstates: holes through which the campaign could report 0 failures while trainstate has a
crash-consistency bug. Each test asserts what the tool SHOULD do and is marked ``xfail(strict=True)``: it
documents a hole that is there today (a fix turns it into an XPASS, which fails until the mark is removed)."""

from __future__ import annotations

import io
import mmap
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.crashstates import collective, objects  # noqa: E402
from tools.crashstates.campaign import run  # noqa: E402
from tools.crashstates.record import Image, Op, Recorder, snapshot  # noqa: E402
from tools.crashstates.states import _build, _volatile, states_after  # noqa: E402
from tools.crashstates.workloads import WORKLOADS  # noqa: E402

# -- the recorder: mutations it does not see ---------------------------------------------------------------


def _fdopen(d):
    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    with os.fdopen(fd, "wb") as f:  # open(fd) passes through unrecorded
        f.write(b"hello")


def _fileio(d):
    with io.FileIO(d / "f", "w") as f:
        f.write(b"hello")


def _writev(d):
    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    os.writev(fd, [b"hel", b"lo"])
    os.close(fd)


def _pwritev(d):
    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    os.pwritev(fd, [b"hello"], 0)
    os.close(fd)


def _sendfile(d):
    src, dst = os.open(d / "old", os.O_RDONLY), os.open(d / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    os.sendfile(dst, src, 0, 10)
    os.close(src)
    os.close(dst)


def _copyfile(d):
    shutil.copyfile(d / "old", d / "f")  # Linux: os.sendfile under the hood


def _link(d):
    os.link(d / "old", d / "f")


def _symlink(d):
    os.symlink(d / "old", d / "f")


def _truncate_path(d):
    os.truncate(d / "old", 2)


def _file_truncate(d):
    with open(d / "old", "r+b") as f:
        f.truncate(2)


def _writelines(d):
    with open(d / "f", "wb") as f:
        f.writelines([b"hel", b"lo"])


def _mmap_write(d):
    fd = os.open(d / "old", os.O_RDWR)
    m = mmap.mmap(fd, 0)
    m[0:5] = b"HELLO"
    m.flush()
    m.close()
    os.close(fd)


def _o_append(d):
    fd = os.open(d / "old", os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"AB")  # lands at the end; recorded at the recorder's own offset (0)
    os.close(fd)


UNSEEN = [
    _o_append,
    _fdopen,
    _fileio,
    _writev,
    _pwritev,
    _sendfile,
    _copyfile,
    _link,
    _symlink,
    _truncate_path,
    _file_truncate,
    _writelines,
    _mmap_write,
]


@pytest.mark.parametrize("mutate", UNSEEN, ids=[f.__name__.lstrip("_") for f in UNSEEN])
def test_the_recording_replays_to_the_tree_the_work_left(tmp_path, mutate):
    """Whatever the work did, the tree before plus the recorded operations must give the tree after (else the
    crash states are built from a history that did not happen, and a bug in an unseen write is never judged)."""
    root = tmp_path / "r"
    root.mkdir()
    (root / "old").write_bytes(b"0123456789")
    with Recorder(root) as recorder:
        mutate(root)
    after = snapshot(root)
    for name in os.listdir(root):  # snapshot() skips a symlink: count it as a file holding its target
        if (root / name).is_symlink():
            after.files[name] = (root / name).read_bytes()
    replayed = _build(recorder.before, recorder.ops, set()).image(drop=False)
    assert replayed.files == after.files, [(o.kind, o.path, o.path2) for o in recorder.ops]


def test_an_fsync_is_credited_to_the_file_it_was_made_on(tmp_path):
    """open(a, 'wb'), write, close (no fsync); then open(b, 'rb') (read mode: not tracked) gets the same fd
    number and is fsynced: the recording must not say that ``a`` was fsynced (that makes a's unsynced data
    durable in every crash state, hiding a missing fsync)."""
    root = tmp_path / "r"
    root.mkdir()
    (root / "b").write_bytes(b"b" * 10)
    with Recorder(root) as recorder:
        with open(root / "a", "wb") as f:
            f.write(b"a" * 10)
            fd_a = f.fileno()
        with open(root / "b", "rb") as g:
            assert g.fileno() == fd_a  # the lowest free number: reused
            os.fsync(g.fileno())  # the common "flush a file another writer made" idiom
    assert ("fsync", "a") not in [(o.kind, o.path) for o in recorder.ops]
    last = list(states_after(recorder.before, recorder.ops))
    assert any(image.files.get("a") == b"" for _, image in last)


def test_operations_are_recorded_in_the_order_they_ran(tmp_path, monkeypatch):
    """Thread A fsyncs the directory; then thread B renames into it. The rename ran after the fsync, so a crash
    may lose it; the recording must keep that order (here A is only slow to get back from the call)."""
    root = tmp_path / "r"
    root.mkdir()
    (root / "x.tmp").write_bytes(b"x")
    fsynced, renamed = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_to_return(fd):
        real_fsync(fd)
        fsynced.set()
        renamed.wait(5)  # the thread is descheduled right after the syscall

    monkeypatch.setattr(os, "fsync", slow_to_return)
    with Recorder(root) as recorder:

        def other():
            fsynced.wait(5)
            os.rename(root / "x.tmp", root / "x")
            renamed.set()

        t = threading.Thread(target=other)
        t.start()
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
        t.join()
    last = list(states_after(recorder.before, recorder.ops))
    assert any("x" not in image.files for _, image in last), [(o.kind, o.path) for o in recorder.ops]


# -- the state model: states a disk can be left in that are never generated ----------------------------------


def test_a_lost_directory_takes_what_is_under_it():
    """mkdir d; a file in d written, fsynced; d fsynced; d's parent never fsynced. By the model's own rule the
    mkdir is volatile, so some crash state must lack d (and the file in it); none does."""
    ops = [
        Op("mkdir", "d"),
        Op("create", "d/f"),
        Op("write", "d/f", data=b"f" * 8),
        Op("fsync", "d/f"),
        Op("fsync", "d"),
    ]
    assert _volatile(ops) == [0]
    before = Image(set(), {})
    assert any("d/f" not in image.files for _, image in states_after(before, ops))


def test_trainstate_first_save_survives_losing_the_run_directory_entry(tmp_path):
    """Found by this attack and fixed in trainstate: the run directory's parent was never fsynced after ``mkdir
    run``, so under the model a crash after 'committed 3' could take the whole run (a lost mkdir takes what is
    under it). trainstate now fsyncs the parent of each directory it creates (the run's, a save's new parents),
    and no state after the last operation lacks the committed checkpoint."""
    from tools.crashstates.workloads import Place

    w = WORKLOADS[1]
    root = tmp_path / "r"
    root.mkdir()
    recorder = Recorder(root)
    with recorder:
        w.run(Place(root), recorder, w)
        import trainstate

        trainstate.save(root / "new" / "parents" / "ckpt", {"x": b"1"}, fsync=True)
    assert recorder.ops[0].kind == "mkdir" and recorder.ops[0].path == "run"
    assert [recorder.ops[i].path for i in _volatile(recorder.ops) if recorder.ops[i].kind == "mkdir"] == []
    last = list(states_after(recorder.before, recorder.ops))
    assert all(any(p.startswith("run/step_00000003/") for p in image.files) for _, image in last)
    assert all("new/parents/ckpt/manifest.json" in image.files for _, image in last)


def test_unsynced_in_place_overwrites_persist_per_file_and_per_page():
    """Two fsynced files, both overwritten in place (no fsync after): writeback is per page, per file, so a
    crash can leave a new and b old, or a's first page new and its second old. Neither is generated."""
    page = 4096
    before = Image(set(), {"a": b"0" * 2 * page, "b": b"0" * page})
    ops = [
        Op("write", "a", offset=0, data=b"1" * 2 * page),
        Op("write", "b", offset=0, data=b"1" * page),
    ]
    images = [image for _, image in states_after(before, ops)]
    assert any(i.files["a"] == b"1" * 2 * page and i.files["b"] == b"0" * page for i in images)
    assert any(i.files["a"] == b"1" * page + b"0" * page for i in images)


# -- the object store's model ---------------------------------------------------------------------------------


def test_any_request_in_flight_may_have_landed():
    log = objects.Log()
    for i in range(11):
        log.requests.append(objects.Request("put", f"b/data{i}", log.tick(), data=b"x"))
    assert any("b/data10" in state for _, _, state in objects.crash_states({}, log))


# -- the collective combining ---------------------------------------------------------------------------------


def test_a_background_threads_operation_during_an_exchange_is_not_ordered_after_it(tmp_path):
    """Rank 0's main thread enters a gather (waiting for rank 1); meanwhile its background thread deletes an old
    checkpoint. That deletion did not wait for rank 1, so a crash may have it done while rank 1 has written
    nothing: the cut (rank 0 after its unlink, rank 1 before its first op) must be generated."""
    root = tmp_path / "r"
    root.mkdir()
    (root / "old").write_bytes(b"o")
    recorder = Recorder(root)
    calls: list[tuple[int, int, str, str]] = []
    entered, deleted = threading.Event(), threading.Event()
    with recorder:

        def background():
            entered.wait(5)
            os.unlink(root / "old")  # retention on the writer thread
            deleted.set()

        t = threading.Thread(target=background)
        t.start()
        entered_at = len(recorder.ops)  # what _note_calls records on entry
        entered.set()
        deleted.wait(5)  # ... the gather blocks here until rank 1 arrives
        calls.append((entered_at, len(recorder.ops), "gather", "save"))  # ... and on return
        t.join()
    rank0 = collective.RankRecording(recorder.before, recorder.ops, [], calls)
    rank1_ops = [Op("create", "part1", at=10**18), Op("write", "part1", data=b"x", at=10**18 + 1)]
    rank1 = collective.RankRecording(recorder.before, rank1_ops, [], [(2, 2, "gather", "save")])
    cuts = {cut for cut, *_ in collective.crash_states([rank0, rank1])}
    assert "ranks at ops (1, 0)" in cuts


# -- the oracle -------------------------------------------------------------------------------------------------


def test_a_new_managers_save_that_deletes_the_last_good_checkpoint_fails_the_campaign(monkeypatch):
    """Injected bug: a manager's save of step 99 (the oracle's) deletes every other checkpoint, with no
    retention configured ('async saves' keeps everything). The module docstring promises 'the checkpoint
    restored is still whole afterwards (nothing deleted the last good checkpoint)'."""
    import trainstate

    real = trainstate.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        out = real(self, step, *args, **kwargs)
        if step == 99:
            self.wait()
            run_dir = Path(self.path_for(99)).parent
            for p in run_dir.glob("step_*"):
                if p.name != Path(self.path_for(99)).name:
                    shutil.rmtree(p)
        return out

    monkeypatch.setattr(trainstate.CheckpointManager, "save", save)
    result = run(WORKLOADS[2], sample=15, seed=1)
    assert result.failures, "the last good checkpoint deleted, 0 failures"


def test_a_pin_whose_name_is_not_flushed_fails_the_pins_campaign(monkeypatch):
    """Found by this attack and fixed in trainstate: the pin file was flushed but its directory was not, so a
    crash after ``pin`` returned could lose the pin and the next manager's retention (keep_last=1) then deleted
    the pinned checkpoint. ``pin`` now syncs the checkpoint's directory (``Storage.sync_directory``); without
    that, the oracle (which now judges pins) fails the pins workload."""
    from trainstate._storage.local import LocalStorage

    result = run(WORKLOADS[3], sample=200, seed=1)
    assert result.failures == []
    monkeypatch.setattr(LocalStorage, "sync_directory", lambda self, path: None)
    result = run(WORKLOADS[3], sample=200, seed=1)
    assert any("pin" in f for f in result.failures), result.failures
