"""The corruption campaign (tools/reliability/corruption.py) at test size: every flipped byte is caught cleanly."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import trainstate

sys.path.insert(0, str(Path(__file__).parents[2]))  # the repository root, for tools.reliability

from tools.reliability import corruption

pytestmark = pytest.mark.campaign  # run at test size; `-m "not campaign"` for a quick loop


def test_random_flips_are_all_detected_cleanly():
    rows = corruption.run(trials=600, seed=1)
    assert {r.campaign.rsplit(" ", 1)[-1] for r in rows} == {"files", "manifest.json"}
    for row in rows:
        assert row.trials > 200, row  # both kinds get a real share of the trials
        assert row.passed == row.trials, "\n".join([row.campaign, *row.notes])
        assert "undetected: 0" in row.notes and "unclean: 0" in row.notes, row.notes


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny"
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": 3, "lr": 0.5, "tag": "x"}
    trainstate.save(path, state, metadata={"k": 1}, threads=1, fsync=False)
    return path


def test_every_manifest_byte_flipped_is_detected_cleanly(tiny):
    (target,) = [t for t in corruption.targets_of(tiny) if t.kind == "manifest"]
    reference = trainstate.load(tiny)
    failures = []
    for offset in range(len(target.original)):
        for mask in (0x01, 0xFF):
            outcome = corruption.flip_and_probe(target, offset, mask, reference)
            if outcome.verdict != "detected":
                failures.append(corruption.Case(target, offset, mask, outcome).describe())
    assert target.path.read_bytes() == target.original
    assert not failures, f"{len(failures)} of {2 * len(target.original)} flips:\n" + "\n".join(failures[:30])


def test_the_probe_reports_what_it_should(tiny, monkeypatch):
    """The harness is not vacuous: an intact checkpoint is 'undetected', a raw exception is 'unclean'."""
    reference = trainstate.load(tiny)
    outcome = corruption.probe(tiny, reference)
    assert outcome.verdict == "undetected" and outcome.same_state is True

    def raw_error(*args, **kwargs):
        raise KeyError("from deep inside")

    monkeypatch.setattr(trainstate, "load", raw_error)
    outcome = corruption.probe(tiny)
    assert outcome.verdict == "unclean" and "UNCLEAN KeyError" in outcome.errors[0]
