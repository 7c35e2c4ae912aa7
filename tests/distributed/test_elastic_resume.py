"""Exact resume at any number of ranks (gloo, CPU): a DDP job over the global sample stream is SIGKILLed
mid-epoch on 4 ranks and resumed on 2, 3, 1, 2 and 4 ranks in turn; across the whole run every sample of
every epoch is consumed exactly once, in the global order an uninterrupted run uses, with the same
augmentation draws."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_elastic as workers  # noqa: E402
import ranks  # noqa: E402
from helpers import cli  # noqa: E402
from trainstate._sample_stream import SampleStream  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")

# (world size, micro-batches per rank, step after which every rank is SIGKILLed (None: run to the end),
# DataLoader workers per rank). The global batch stays 8: 4 x 1 x 2, 2 x 2 x 2, 3 x 1 x (3, 3, 2), 1 x 2 x 4.
PHASES = [(4, 1, 7, 0), (2, 2, 11, 1), (3, 1, 16, 0), (1, 2, 19, 2), (2, 1, 22, 0), (4, 1, None, 0)]


def _records(log: Path) -> list[dict]:
    out = []
    for path in sorted(log.parent.glob(log.name + ".r*")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _effective(phases: list[list[dict]], resumed_at: list[int]) -> list[dict]:
    """What counts of each phase's log: the steps before the step the next phase resumed at (the later ones
    were lost with the kill and done again)."""
    kept = []
    for records, until in zip(phases, [*resumed_at[1:], None]):
        kept += [r for r in records if until is None or r["step"] < until]
    return kept


def _global_batches(records: list[dict]) -> dict[int, list[int]]:
    """Each optimizer step's samples, rank after rank, micro-batch after micro-batch, as consumed."""
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    out = {}
    for step, rs in by_step.items():
        worlds = {r["world"] for r in rs}
        assert len(worlds) == 1, (step, worlds)  # one job's records per step
        rs.sort(key=lambda r: r["rank"])  # stable: each rank's micro-batches stay in order
        out[step] = [i for r in rs for i in r["indices"]]
    return out


def _run_phases(tmp_path: Path, phases: list[tuple[int, int, int | None, int]], fsdp: bool = False) -> tuple:
    run, logs = tmp_path / "run", []
    resumed_at = []
    for n, (world, micro, kill_at, workers_per_rank) in enumerate(phases):
        log = tmp_path / f"phase{n}"
        existing = sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) if run.exists() else []
        resumed_at.append(int(existing[-1].split("_")[1]) + 1 if existing else 0)
        out = ranks.run(world, workers.train, str(run), str(log), micro, kill_at, workers_per_rank, fsdp, timeout=180)
        if kill_at is None:
            assert out == [workers.STEPS] * world, out
        else:
            assert all(o == "exit code -9" for o in out), out  # the whole job killed
        logs.append(_records(log))
    return logs, resumed_at


def test_a_job_killed_on_4_ranks_resumed_on_2_3_1_2_4_consumes_every_sample_once_in_the_global_order(tmp_path):
    logs, resumed_at = _run_phases(tmp_path, PHASES)
    assert resumed_at == [0, 7, 10, 16, 19, 22]  # saves at every third step: a kill loses the steps since
    kept = _effective(logs, resumed_at)
    batches = _global_batches(kept)
    assert sorted(batches) == list(range(workers.STEPS))  # every optimizer step once
    stream = SampleStream(workers.TOTAL, workers.GLOBAL_BATCH, seed=workers.SEED)
    per_epoch = workers.TOTAL // workers.GLOBAL_BATCH
    for epoch in range(workers.EPOCHS):
        want = stream.order(epoch).tolist()
        got = [i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in batches[s]]
        assert got == want, epoch  # the global order an uninterrupted run uses
        seen = Counter(got)
        duplicated = sum(c - 1 for c in seen.values() if c > 1)
        dropped = workers.TOTAL - len(seen)
        print(f"epoch {epoch}: {len(got)} samples consumed, {duplicated} duplicated, {dropped} dropped")
        assert (duplicated, dropped) == (0, 0)
    # every epoch record of the kept log matches the epoch its step belongs to
    assert all(r["epoch"] == r["step"] // per_epoch for r in kept)
    # the checkpoint says what it holds: the world size that saved it and the global data position
    newest = sorted((tmp_path / "run").glob("step_*"))[-1]
    shown = cli("inspect", str(newest)).stdout
    assert "data position (sampler)" in shown and "restores on any number of ranks" in shown, shown
    info = json.loads(cli("inspect", "--json", str(newest)).stdout)
    (position,) = info["data_positions"]
    assert info["world_size"] == 4 and position["global_batch_size"] == workers.GLOBAL_BATCH
    step = int(newest.name.split("_")[1])  # the optimizer steps done: one global batch each
    assert position["epoch"] * per_epoch + position["batches"] == step + 1, position
    assert position["samples"] == position["batches"] * workers.GLOBAL_BATCH

    # the same samples' augmentation draws as an uninterrupted run (here on 4 ranks, never killed)
    (tmp_path / "reference").mkdir()
    reference, _ = _run_phases(tmp_path / "reference", [(4, 1, None, 0)])
    draws = {(r["epoch"], i): a for r in reference[0] for i, a in zip(r["indices"], r["aug"])}
    assert len(draws) == workers.TOTAL * workers.EPOCHS
    mismatched = [(r["epoch"], i) for r in kept for i, a in zip(r["indices"], r["aug"]) if draws[(r["epoch"], i)] != a]
    assert mismatched == []


def test_an_fsdp2_job_killed_on_2_ranks_resumed_on_3_consumes_every_sample_once(tmp_path):
    """FSDP2 (``fully_shard``, AdamW): the model and optimizer shards are cut again for 3 ranks, and the sample
    stream continues as under DDP."""
    logs, resumed_at = _run_phases(tmp_path, [(2, 2, 4, 0), (3, 1, None, 1)], fsdp=True)
    assert resumed_at == [0, 4]
    batches = _global_batches(_effective(logs, resumed_at))
    stream = SampleStream(workers.TOTAL, workers.GLOBAL_BATCH, seed=workers.SEED)
    per_epoch = workers.TOTAL // workers.GLOBAL_BATCH
    assert sorted(batches) == list(range(workers.STEPS))
    for epoch in range(workers.EPOCHS):
        got = [i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in batches[s]]
        assert got == stream.order(epoch).tolist(), epoch
        seen = Counter(got)
        duplicated, dropped = sum(c - 1 for c in seen.values()), workers.TOTAL - len(seen)
        print(f"FSDP2, epoch {epoch}: {duplicated} duplicated, {dropped} dropped")
        assert (duplicated, dropped) == (0, 0)
