"""A real torchrun job saving compressed and / or encrypted checkpoints, SIGKILLed whole mid-run and resumed.

The job (tests/ranks_train.py: FSDP2 on a CPU mesh, AdamW, dropout, an augmenting loader over
ResumableSampler) trains once and saves every ``EVERY`` steps through one CheckpointManager per feature set
(async, ``keep_last=2``), each into its own directory: one launch covers every feature set, since a fresh
torchrun job costs seconds of CPU per rank before its first step (torch and torch._dynamo imports). Once
each directory holds a committed checkpoint past step 0, and as soon as the next save is seen in flight,
every process of the job is SIGKILLed: the launcher's process group and each rank's (torchrun starts every
rank in a session of its own). At once a new job starts (at 4 ranks: the test's rank processes, already
up); it resumes each feature set's run from that run's newest checkpoint, one after the other, and trains to
the end. Each must end bit-identical (weights, AdamW moments, each rank's next random draws) to an
uninterrupted run of the same program (on the ranks of tests/ranks.py). The newest checkpoint of each
killed-and-resumed run (at 4 ranks: of the zstd + key + incremental run) then restores on 1 and on 3 ranks
to the values a single process reads from it, which are the uninterrupted run's final values.

The feature sets are zstd, a key, and zstd + key + incremental (which covers zstd + key): adding one is one
entry in FEATURE_SETS.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")
pytest.importorskip("zstandard")
pytest.importorskip("cryptography")

import ranks  # noqa: E402
import ranks_train  # noqa: E402
import trainstate  # noqa: E402
from trainstate._format.run_dir import is_staging_name  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")

KEY = "5e" * 32
FEATURE_SETS = {  # name -> CheckpointManager arguments
    "zstd": {"compression": "zstd"},
    "key": {"key": KEY},
    "zstd+key+incremental": {"compression": "zstd", "key": KEY, "incremental": True},
}
STEPS, EVERY = 25, 4  # saves at 0, 4, ..., 24: the newest checkpoint holds the final state
PACE = 0.2  # seconds the killed job sleeps after each step: time to see its checkpoints and kill it mid-run
# The runs whose newest checkpoint is restored on 1 and on 3 ranks (seconds of CPU each), per world size
RESTORED_ELSEWHERE = {2: set(FEATURE_SETS), 4: {"zstd+key+incremental"}}
# Where the killed job resumes: a new torchrun job (fresh interpreters, as after a preemption), or, at 4 ranks,
# the test's rank processes (tests/ranks.py), already up: a 4-rank torchrun job costs over 30 s of CPU.
RESUME_IN_A_NEW_JOB = {2: True, 4: False}
TESTS = Path(__file__).resolve().parent.parent
SCRIPT = TESTS / "ranks_train.py"
ROOT = TESTS.parent


def _runs(base: Path) -> list[list]:
    return [[str(base / name), features] for name, features in FEATURE_SETS.items()]


def _launch(world: int, job: Path, runs: list[list], *flags: str) -> subprocess.Popen:
    job.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    argv += [str(SCRIPT), str(job), "--runs", json.dumps(runs), "--steps", str(STEPS), "--every", str(EVERY)]
    log = open(job / "log", "wb")  # noqa: SIM115 - the child holds it
    return subprocess.Popen([*argv, *flags], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _log(job: Path) -> str:
    return (job / "log").read_text(errors="replace")[-6000:]


def _committed(directory: Path) -> list[int]:
    if not directory.exists():
        return []
    return sorted(int(p.parent.name[5:]) for p in directory.glob("step_*/manifest.json"))


def _in_flight(runs: Path) -> bool:
    """Whether a save is being written in any run under ``runs`` (its staging directory exists)."""
    return any(is_staging_name(n) for d in runs.iterdir() for n in os.listdir(d))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not reaped yet
    except FileNotFoundError:
        return False


def _kill_the_job(launcher: subprocess.Popen, job: Path, world: int) -> None:
    """SIGKILL every process of the job at once: the launcher's process group and each rank's."""
    pids = [int((job / "pids" / f"rank{r}").read_text()) for r in range(world)]
    for group in [launcher.pid, *pids]:  # each a session (and process group) leader: its pid is the group's
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(_alive(p) for p in pids)


def _results(job: Path, world: int) -> list[list[dict]]:
    import pickle

    return [pickle.loads((job / f"final-r{r}.pkl").read_bytes()) for r in range(world)]


def _assert_same(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for name, value in want.items():
        assert value.dtype == got[name].dtype, f"{where}: {name} is {got[name].dtype}, not {value.dtype}"
        assert np.array_equal(value, got[name]), f"{where}: {name} differs"


def _transforms(directory: Path) -> tuple[set[tuple[str, ...]], set[str]]:
    """The transform pipelines of a checkpoint's chunks, and the files they are in."""
    body = json.loads((directory / "manifest.json").read_bytes())
    chunks = [c for t in body["tensors"].values() for c in t["chunks"]]
    return {tuple(t["name"] for t in c.get("transforms", [])) for c in chunks}, {c["file"] for c in chunks}


def _kill_and_resume(base: Path, world: int) -> dict:
    """The uninterrupted run's results, and those of the job killed mid-run and resumed."""
    # the uninterrupted run: the same program on the test's ranks (no fresh interpreters needed here)
    ref = ranks.ok(ranks.run(world, ranks_train.train, _runs(base / "ref"), STEPS, EVERY, timeout=240))
    job = base / "killed"
    launcher = _launch(world, job, _runs(base / "run"), "--pace", str(PACE))
    deadline = time.monotonic() + 240
    while not all(max(_committed(Path(d)), default=0) >= EVERY for d, _ in _runs(base / "run")):
        assert launcher.poll() is None, f"the job ended before it was killed:\n{_log(job)}"
        assert time.monotonic() < deadline, _log(job)
        time.sleep(0.02)
    # then while a save is in flight (one of the next step's three), or wherever the job is if none is seen
    while not _in_flight(base / "run") and max(_committed(base / "run" / "zstd")) < 3 * EVERY:
        assert launcher.poll() is None, f"the job ended before it was killed:\n{_log(job)}"
        time.sleep(0.002)
    assert launcher.poll() is None, f"the job ended before it was killed:\n{_log(job)}"
    _kill_the_job(launcher, job, world)
    assert not list(job.glob("final-r*.pkl"))  # it really died mid-run
    at_kill = {name: _committed(base / "run" / name) for name in FEATURE_SETS}
    # restarted at once (a new job starts within a second here; the ranks of tests/ranks.py are up)
    if RESUME_IN_A_NEW_JOB[world]:
        resumed_job = base / "resumed"
        again = _launch(world, resumed_job, _runs(base / "run"), "--separately")
        assert again.wait(timeout=300) == 0, _log(resumed_job)
        resumed = _results(resumed_job, world)
    else:
        resumed = ranks.ok(ranks.run(world, ranks_train.train_each, _runs(base / "run"), STEPS, EVERY))
    return {"ref": ref, "resumed": resumed, "at_kill": at_kill}


def _check_run(base: Path, job: dict, world: int, name: str) -> None:
    """One feature set's run: resumed bit-identically; its newest checkpoint whole (restoring on 1 and 3 ranks)."""
    index = list(FEATURE_SETS).index(name)
    assert max(job["at_kill"][name]) >= EVERY, job["at_kill"]
    for rank in range(world):
        ref, resumed = job["ref"][rank], job["resumed"][rank][index]
        assert ref["start"] == 0
        assert EVERY < resumed["start"] <= max(job["at_kill"][name]) + 1, name  # from a checkpoint of the kill
        _assert_same(resumed["values"], ref["values"], f"{name}: rank {rank}")
        assert np.array_equal(resumed["rng_next"], ref["rng_next"]), name  # each rank's own stream came back

    directory = base / "run" / name
    assert _committed(directory) == [STEPS - 1 - EVERY, STEPS - 1], name  # keep_last=2, after the resume too
    assert not [n for n in os.listdir(directory) if is_staging_name(n)], name  # what the kill left was swept
    newest = directory / f"step_{STEPS - 1:08d}"
    key = FEATURE_SETS[name].get("key")
    pipelines, files = _transforms(newest)
    writers = {re.search(r"-(r\d{5})-", f).group(1) for f in files}  # type: ignore[union-attr]
    assert writers == {f"r{r:05d}" for r in range(world)}  # each rank wrote its shards
    if FEATURE_SETS[name].get("incremental"):  # in the run's pool, files named per save and rank
        assert all(f.startswith("pool-") and (directory / "_shared" / f).is_file() for f in files), files
    if "compression" in FEATURE_SETS[name]:
        assert any("zstd" in p for p in pipelines), (name, pipelines)
    if key is not None:
        assert all(p and p[-1] == "aes-256-gcm" for p in pipelines), (name, pipelines)  # every chunk encrypted
    with trainstate.open(str(newest), key=key) as ck:
        assert ck.world_size == world and ck.encrypted == (key is not None)
        one_process = {k: np.asarray(ck.read(k)) for k in job["ref"][0]["values"]}
    _assert_same(one_process, job["ref"][0]["values"], f"{name}: read by one process")
    for at in (1, 3) if name in RESTORED_ELSEWHERE[world] else ():
        for rank, got in enumerate(ranks.ok(ranks.run(at, ranks_train.restore, str(newest), key))):
            _assert_same(got, one_process, f"{name}: restored on {at} ranks, rank {rank}")


# One test per world size, checking every feature set: the job is the cost, and under xdist's worksteal (CI's
# ``-n 2``) tests of one job split over two workers would each run it.
@pytest.mark.parametrize("world", [2, 4])
def test_a_job_sigkilled_mid_run_resumes_bit_identically_and_its_newest_checkpoints_restore_on_1_and_3_ranks(
    tmp_path, world
):
    job = _kill_and_resume(tmp_path, world)
    assert not np.array_equal(job["ref"][0]["rng_next"], job["ref"][1]["rng_next"])  # the ranks' own streams
    for name in FEATURE_SETS:
        _check_run(tmp_path, job, world, name)
