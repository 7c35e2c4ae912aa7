"""The Hugging Face Trainer with TrainstateCallback, trained on 2 processes (torchrun, gloo, CPU), SIGKILLed after a
mid-epoch checkpoint and resumed on 1 process with the global batch kept: across the whole run every sample of
every epoch is taken once, in the global batches and order of an uninterrupted 2-process run, with the same
augmentation draws; the per-rank generators are re-derived; a resume with another global batch is refused.

Two launches of hf_trainer_elastic_run.py (each imports the Trainer: seconds of CPU): ``first`` under torchrun
(the uninterrupted reference, then the run killed after its step-4 checkpoint), ``resume`` in one plain process
(the refused resume, then a resume with the per-device batch doubled and one with the accumulation doubled).
The final weights are not compared: the gradient all-reduce adds in another order than one process does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from helpers import torchrun  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")

SCRIPT = Path(__file__).with_name("hf_trainer_elastic_run.py")
SAMPLES, UPDATES_PER_EPOCH, EPOCHS, KILLED_AT = 40, 3, 3, 4  # 40 samples, global batch 16: 3 updates an epoch

Trained = list[tuple[int, int]]  # (update, index): the samples each update trained, from every process


def _rows(path: Path) -> list[list[object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def _trained(work: Path, run: str, ranks: int, before: int | None = None) -> Trained:
    """What each update of ``run`` trained; with ``before``, only the updates before it (a killed run's updates
    after its checkpoint are lost)."""
    out = []
    for rank in range(ranks):
        for update, indices in _rows(work / f"{run}-trained-rank{rank}.jsonl"):
            assert isinstance(update, int) and isinstance(indices, list)
            out += [(update, int(i)) for i in indices if before is None or update < before]
    return out


def _draws(work: Path, run: str, ranks: int) -> dict[tuple[int, int], tuple[object, ...]]:
    """Each fetched sample's augmentation draws, by (epoch, index); a sample fetched twice drew the same."""
    out: dict[tuple[int, int], tuple[object, ...]] = {}
    for rank in range(ranks):
        for epoch, index, *draws in _rows(work / f"{run}-fetched-rank{rank}.jsonl"):
            key = (int(epoch), int(index))  # type: ignore[call-overload]
            assert out.setdefault(key, tuple(draws)) == tuple(draws), f"{run}: {key} fetched with other draws"
    return out


def _batches(trained: Trained) -> dict[int, list[int]]:
    """The global batch each update took, over every process."""
    out: dict[int, list[int]] = {}
    for update, index in trained:
        out.setdefault(update, []).append(index)
    return {u: sorted(v) for u, v in sorted(out.items())}


def _duplicated_and_dropped(trained: Trained) -> tuple[int, int]:
    duplicated = dropped = 0
    for epoch in range(EPOCHS):
        seen = Counter(i for u, i in trained if u // UPDATES_PER_EPOCH == epoch)
        duplicated += sum(n - 1 for n in seen.values() if n > 1)
        dropped += sum(1 for i in range(SAMPLES) if i not in seen)
    return duplicated, dropped


def test_two_processes_killed_mid_epoch_resume_on_one_with_the_same_global_batch(tmp_path: Path) -> None:
    first = torchrun(SCRIPT, tmp_path, "first", env={})
    assert first.returncode != 0 and "SIGKILL" in first.stdout, first.stdout[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    resumed = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "resume"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]

    # another global batch (4 per device x 2 accumulation x 1 process) is refused by name, before any fetch
    refused = [line for line in out.splitlines() if line.startswith("refused:")]
    assert len(refused) == 1 and "data.global_batch_size" in refused[0] and "16" in refused[0], out[-4000:]
    assert "gradient_accumulation_steps" in refused[0]  # the hint: keep the global batch
    assert not (tmp_path / "wrong-fetched-rank0.jsonl").exists()

    reference = _trained(tmp_path, "ref", 2)
    assert _duplicated_and_dropped(reference) == (0, 0)
    assert len(_batches(reference)) == EPOCHS * UPDATES_PER_EPOCH
    reference_draws = _draws(tmp_path, "ref", 2)
    # what the killed run trained up to its checkpoint (what it trained after is lost with the kill)
    killed = _trained(tmp_path, "run", 2, before=KILLED_AT)
    assert {u for u, _ in killed} == set(range(KILLED_AT))
    killed_draws = _draws(tmp_path, "run", 2)
    for variant in ("batch", "accumulation"):
        assert f"{variant} resumed from step {KILLED_AT}; generators re-derived: True" in out, out[-4000:]
        after = _trained(tmp_path, variant, 1)
        assert min(u for u, _ in after) == KILLED_AT
        whole = killed + after
        duplicated, dropped = _duplicated_and_dropped(whole)
        print(f"{variant}: 2 -> 1 processes, {duplicated} duplicated, {dropped} dropped")
        assert (duplicated, dropped) == (0, 0)
        assert _batches(whole) == _batches(reference), f"{variant}: other global batches than the uninterrupted run"
        draws = {**killed_draws, **_draws(tmp_path, variant, 1)}
        for update, index in whole:
            key = (update // UPDATES_PER_EPOCH, index)
            assert draws[key] == reference_draws[key], f"{variant}: sample {key} drew other augmentation"
