"""Crash consistency by enumeration (tools/crashstates): each recorded commit path, a random sample of its crash
states judged by the oracle (the full run is ``python -m tools.crashstates``); and the campaign is not vacuous:
a save that never flushes fails it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.crashstates import collective, objects  # noqa: E402
from tools.crashstates.campaign import EVERY, run  # noqa: E402
from tools.crashstates.record import Op, Recorder  # noqa: E402
from tools.crashstates.states import crash_states  # noqa: E402
from tools.crashstates.workloads import ON_STORE, WORKLOADS  # noqa: E402


@pytest.mark.parametrize("workload", EVERY, ids=[w.name for w in EVERY])
def test_a_sample_of_every_crash_state_restores_what_was_committed(workload):
    sample = 12 if workload.local and workload.ranks > 1 else 40  # judged by 2 ranks: 0.6 s a state
    result = run(workload, sample=sample, seed=1)
    assert result.states > 20 and result.checked == min(sample, result.states)
    assert result.failures == []


def test_a_save_that_never_flushes_fails_the_campaign(monkeypatch):
    from trainstate._storage.local import LocalStorage

    monkeypatch.setattr(LocalStorage, "_fsync", lambda self, fd: None)
    result = run(WORKLOADS[0], sample=60, seed=1)
    assert len(result.failures) > 10, result.failures


def test_the_generator_keeps_what_was_fsynced_and_may_lose_what_was_not(tmp_path):
    """One file written and fsynced, renamed, its directory fsynced; a second one written and renamed, no fsync:
    after the last operation every state holds the first whole; some lose the second, or its bytes."""
    import os

    root = tmp_path / "r"
    root.mkdir()
    with Recorder(root) as recorder:
        for name, flush in (("a", True), ("b", False)):
            fd = os.open(root / f"{name}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, name.encode() * 100)
            if flush:
                os.fsync(fd)
            os.close(fd)
            os.rename(root / f"{name}.tmp", root / name)
            if flush:
                dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
                os.fsync(dfd)
                os.close(dfd)
    last = [image for k, _, image in crash_states(recorder.before, recorder.ops) if k == len(recorder.ops)]
    assert all(image.files.get("a") == b"a" * 100 for image in last)
    assert any("b" not in image.files for image in last)  # the rename lost
    assert any(image.files.get("b") == b"" for image in last)  # renamed, its data lost
    assert any(image.files.get("b") == b"b" * 100 for image in last)


def test_every_single_bit_flip_of_a_small_checkpoint_is_detected_before_it_reaches_the_target():
    import logging

    from tools.crashstates import flips

    logging.getLogger("trainstate").setLevel(logging.CRITICAL)
    result = flips.campaign("small", flips.small_state(), every=True)
    print(f"{result.flips} flips, {result.detected} detected, {result.harmless} harmless")
    assert result.flips > 10_000 and result.failures == []
    assert result.detected + result.harmless == result.flips


def test_random_bit_flips_of_a_model_like_checkpoint_are_detected():
    import logging

    from tools.crashstates import flips

    logging.getLogger("trainstate").setLevel(logging.CRITICAL)
    result = flips.campaign("realistic", flips.realistic_state(0.5), every=False, count=200, seed=3)
    assert result.flips == 200 and result.failures == [] and result.detected + result.harmless == 200


def test_an_object_store_save_that_clears_the_old_data_first_fails_the_campaign(monkeypatch):
    """Deleting an overwritten checkpoint's data files before the new manifest lands leaves, after a crash
    there, the old manifest pointing at objects that are gone: the object-store model must find that."""
    import posixpath

    from trainstate._storage.fsspec import FsspecStorage

    begin = FsspecStorage.begin

    def clearing_begin(self, final, *, overwrite):
        for name in self.list(final):
            if name.startswith("data-"):
                self._rm(posixpath.join(final, name))
        return begin(self, final, overwrite=overwrite)

    monkeypatch.setattr(FsspecStorage, "begin", clearing_begin)
    result = run(ON_STORE[0])
    assert any("missing" in f for f in result.failures), result.failures


def test_an_object_store_keeps_what_returned_and_may_or_may_not_hold_what_was_in_flight():
    """A PUT that returned is there in every later state; one in flight at the crash is there whole or absent;
    a multipart upload's object appears only at its complete, never after its create or parts alone."""
    log = objects.Log()
    store = objects.ObjectStore(log=log)
    store.pipe_file("b/a", b"a" * 10)
    with store.open("b/big", "wb", block_size=4) as f:
        for piece in (b"0123", b"4567", b"89"):
            f.write(piece)
    flying = objects.Request("put", "b/c", log.tick(), data=b"c")  # sent, never returned
    log.requests.append(flying)
    kinds = [r.kind for r in log.requests]
    assert kinds[:2] == ["put", "create"] and kinds.count("part") >= 2 and "complete" in kinds
    complete = next(r for r in log.requests if r.kind == "complete")
    states = list(objects.crash_states({}, log))
    for t, _, state in states:
        if t >= log.requests[0].returned:
            assert state["b/a"] == b"a" * 10
        assert state.get("b/big") in (None, b"0123456789")  # whole or absent
        if t < complete.sent:
            assert "b/big" not in state
    last = [state for t, _, state in states if t == flying.sent]
    assert {"b/c" in state for state in last} == {True, False}


def test_ranks_recordings_combine_into_cuts_that_respect_what_the_ranks_told_each_other():
    """Rank 1 writes its file and fsyncs it, then sends to rank 0 (a gather); rank 0 then renames the commit
    into place and fsyncs the directory. No combined state holds the commit without rank 1's bytes; with rank
    1's fsync left out, some state does (its data was not durable when rank 0 committed)."""
    from tools.crashstates.record import Image

    def recordings(flush):
        rank1 = [Op("create", "d/part1", at=1), Op("write", "d/part1", data=b"x" * 8, at=2)]
        rank1 += [Op("fsync", "d/part1", at=3)] if flush else []
        rank0 = [Op("create", "d/part0", at=0), Op("write", "d/part0", data=b"y" * 8, at=4)]
        rank0 += [Op("fsync", "d/part0", at=5), Op("fsync", "d", at=6), Op("rename", "d", "done", at=7)]
        rank0 += [Op("fsync", ".", at=8)]
        return [
            collective.RankRecording(Image({"d"}, {}), rank0, [(6, "committed 0")], [(3, 3, "gather", "save")]),
            collective.RankRecording(Image({"d"}, {}), rank1, [], [(len(rank1), len(rank1), "gather", "save")]),
        ]

    def torn(flush):
        states = list(collective.crash_states(recordings(flush)))
        assert any(image.files.get("done/part1") == b"x" * 8 for *_, image in states)
        return [
            cut
            for cut, *_, image in states
            if "done/part0" in image.files and image.files.get("done/part1") != b"x" * 8
        ]

    assert torn(flush=True) == []
    assert torn(flush=False)


def test_a_local_tier_copy_made_with_fsync_is_durable_when_it_is_written(tmp_path):
    """A peer's copy of a local checkpoint (the local tier's replicas, ``fsync=True``): once written, no crash state
    loses it or any of its bytes: its files, its staging directory's names, its rename and new parent folders
    are all flushed. Found by the enumeration once the recorder saw buffered writes when they reach the file:
    each file was fsynced before its buffer was flushed (a manifest, smaller than the buffer, was not flushed at
    all), and the staging directory, the folder and new parents were never fsynced."""
    import numpy as np

    import trainstate
    from trainstate._manager.tier_peers import pack, unpack

    source = tmp_path / "source"
    trainstate.save(source / "step_00000007", {"w": np.arange(100.0)})
    packed = pack(source, 7)
    root = tmp_path / "r"
    root.mkdir()
    with Recorder(root) as recorder:
        unpack(root / "w2" / "rank00001", packed, keep=2, fsync=True)
    want = {p.name: p.read_bytes() for p in (source / "step_00000007").iterdir()}
    last = [image for k, _, image in crash_states(recorder.before, recorder.ops) if k == len(recorder.ops)]
    assert last and all(
        {p.rsplit("/", 1)[1]: b for p, b in image.files.items() if p.startswith("w2/rank00001/step_00000007/")} == want
        for image in last
    )
