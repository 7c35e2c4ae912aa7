"""Crash consistency by enumeration (tools/crashstates): each recorded commit path, a random sample of its crash
states judged by the oracle (the full run is ``python -m tools.crashstates``); and the campaign is not vacuous:
a save that never flushes fails it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.crashstates.campaign import run  # noqa: E402
from tools.crashstates.record import Recorder  # noqa: E402
from tools.crashstates.states import crash_states  # noqa: E402
from tools.crashstates.workloads import WORKLOADS  # noqa: E402


@pytest.mark.parametrize("workload", WORKLOADS, ids=[w.name for w in WORKLOADS])
def test_a_sample_of_every_crash_state_restores_what_was_committed(workload):
    result = run(workload, sample=40, seed=1)
    assert result.states > 200 and result.checked == 40
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
