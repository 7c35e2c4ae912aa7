"""The crash, corruption and fuzz campaigns for compressed, encrypted and incremental checkpoints, at test size.

tools/reliability runs them per flavor (tools/reliability/common.py: FLAVORS) at a larger size and writes
docs/reliability.md; the plain flavor's own tests are test_campaigns.py, test_corruption_campaign.py and
test_fuzz.py. Each flavor here gets a couple of SIGKILLs (sync or async, alternating), ~200 byte flips and
~50 hostile checkpoints, so the whole file stays a few seconds per flavor.
"""

from __future__ import annotations

import json

import pytest
from tools.reliability import corruption, crash, fuzz  # the repository root is on sys.path (pyproject: pythonpath)
from tools.reliability.common import FLAVORS, Flavor

import trainstate

pytestmark = pytest.mark.campaign  # run at test size; `-m "not campaign"` for a quick loop

FLAVORED = [f for name, f in FLAVORS.items() if name != "plain"]
IDS = [f.name for f in FLAVORED]


def _clean(row) -> None:
    assert row.trials > 0, row.campaign
    assert row.passed == row.trials, f"{row.campaign}: " + "\n".join(row.notes)


@pytest.mark.parametrize("flavor", FLAVORED, ids=IDS)
def test_sigkill_mid_save(flavor: Flavor):
    mode = "async" if flavor.name in ("zstd", "incremental") else "sync"
    row = crash.campaign(mode, kills=2, seed=11, flavor=flavor)
    assert flavor.name in row.campaign
    _clean(row)


@pytest.mark.parametrize("flavor", FLAVORED, ids=IDS)
def test_every_flipped_byte_is_detected_cleanly(flavor: Flavor):
    rows = corruption.run(trials=200, seed=2, flavor=flavor, with_torch=False)  # torch: the full-size run
    assert len(rows) == (3 if flavor.key is not None else 2)
    for row in rows:
        _clean(row)
        assert "undetected: 0" in row.notes or "AES-GCM tag" in row.campaign, row.notes
    if flavor.key is not None:  # flips in stored chunk bytes, read with every checksum off: the tag caught each
        tag = rows[-1]
        assert tag.trials > 10 and tag.notes[0] == f"load(verify=False) raised: TamperedCheckpointError {tag.trials}"


@pytest.fixture(scope="module", params=FLAVORED, ids=IDS)
def harness(request):
    h = fuzz.Harness(slow_after=2.0, hang_after=5.0, many_chunks=False, flavor=request.param, warm_up=2)
    yield h
    h.close()


def test_hostile_checkpoints_give_only_trainstate_errors(harness):
    clean = harness.run_files(dict(harness.base.files))
    assert clean.violations == [] and clean.results["load"] == clean.results["verify"] == "ok", clean.results
    failures = []
    for campaign, examples in (("structure", 20), ("bytes", 15), ("headers", 10)):
        for i in range(examples):
            case = fuzz.MUTATORS[campaign](harness.base, fuzz.case_rng(5, campaign, i))
            outcome = harness.run_case(case)
            failures += [f"{campaign}:{i} {case.describe()[:200]}: {v}" for v in outcome.violations]
    assert not failures, "\n".join(failures)


def _changed_metadata(harness, reseal: bool) -> fuzz.Case:
    body = json.loads(harness.base.manifest)
    body["metadata"]["v"].append(["injected", 1])
    raw = fuzz.seal(body, harness.base.key) if reseal else fuzz.canonical(body) + b"\n"
    must_reject = not reseal
    expect = "TamperedCheckpointError" if must_reject and harness.base.key is not None else None
    return fuzz.Case(
        "structure",
        {**harness.base.files, fuzz.MANIFEST: raw},
        ["metadata += injected"],
        set(),
        must_reject=must_reject,
        expect=expect,
    )


def test_the_fuzzer_seals_like_the_writer_and_the_checks_bite(harness):
    """Re-sealed (with the key's MAC, for an encrypted flavor) a changed manifest is accepted, so mutations
    reach the parser; not re-sealed it is refused (by the MAC); and a refusal of the wrong class is caught."""
    sealed = harness.run_case(_changed_metadata(harness, reseal=True))
    assert sealed.violations == [] and sealed.results["load"] == "ok", sealed.results
    unsealed_case = _changed_metadata(harness, reseal=False)
    unsealed = harness.run_case(unsealed_case)
    assert unsealed.violations == []
    expected = "TamperedCheckpointError" if harness.base.key is not None else "CorruptCheckpointError"
    assert unsealed.results["open"] == unsealed.results["load"] == expected
    unsealed_case.expect = "FormatVersionError"  # the checker holds the reader to the class it must raise
    wrong = harness.run_case(unsealed_case)
    assert {(v.kind, v.op) for v in wrong.violations} == {("misclassified", "load"), ("misclassified", "open")}


def test_the_base_is_laid_out_as_its_flavor_writes(harness):
    """An incremental base is a checkpoint whose data files are all in its run's pool; the others have none."""
    assert bool(harness.base.pool) == harness.base.flavor.incremental
    assert all(n in harness.base.pool for n in harness.base.data_files) == harness.base.flavor.incremental
    path = harness.write(dict(harness.base.files))
    try:
        assert trainstate.load(path, **harness.base.flavor.open_kwargs())["step"] == 7
    finally:
        harness.remove(path)
