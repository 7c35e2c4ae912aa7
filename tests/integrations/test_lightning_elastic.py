"""Lightning with ExactResume over the global sample stream (a ``ResumableSampler(global_batch_size=...)`` as the
training loader's batch sampler) resumes at another number of processes: a 2-process DDP run (gloo, CPU,
torchrun), SIGKILLed mid-epoch, resumed on 1 process, consumes every sample of every epoch once, in the global
order of an uninterrupted run, with the same augmentation draws; its generators are re-derived by the documented
rule. At the same number of processes the resume stays bit-identical. A loader, sampler or accumulation that
does not fit the checkpoint or the Trainer is refused by name."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("lightning") is None:  # not imported here: only the runs need it
    pytest.skip("lightning is not installed", allow_module_level=True)
torch = pytest.importorskip("torch")

import trainstate  # noqa: E402
from helpers import torchrun  # noqa: E402
from trainstate._rng import _derived  # noqa: E402
from trainstate._sample_stream import SampleStream  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")

SCRIPT = Path(__file__).with_name("lightning_elastic_run.py")
TOTAL, GLOBAL_BATCH, SEED, STEPS_PER_EPOCH, EPOCHS = 48, 8, 7, 6, 3


def _records(log: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(log.parent.glob(log.name + ".r*")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _global_batches(records: list[dict[str, Any]]) -> dict[int, list[tuple[int, int, float]]]:
    """Each optimizer step's (epoch, index, augmentation) triples, rank after rank, micro-batch after micro-batch."""
    out: dict[int, list[tuple[int, int, float]]] = {}
    for r in sorted(records, key=lambda r: (r["step"], r["rank"])):  # stable: a rank's micro-batches stay in order
        out.setdefault(r["step"], []).extend((r["epoch"], i, a) for i, a in zip(r["indices"], r["aug"]))
    return out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = trainstate.load(path, framework="torch")["model"]
    return loaded


def test_2_processes_killed_mid_epoch_resume_on_1_with_every_sample_once_in_the_global_order(tmp_path: Path) -> None:
    # 2 processes, 2 micro-batches each per global batch of 8 (accumulate_grad_batches=2), a DataLoader worker
    # each; checkpoints every 4 steps; killed as step 10 starts, in epoch 1 (steps 6-11): steps 8 and 9 are lost
    killed = torchrun(SCRIPT, tmp_path / "run", tmp_path / "p0", "--micro", 2, "--workers", 1, "--kill-at", 10, env={})
    assert killed.returncode != 0 and "rank 0: killed at 10" in killed.stdout, killed.stdout[-3000:]
    resumed = torchrun(
        SCRIPT,
        tmp_path / "run",
        tmp_path / "p1",
        "--micro",
        2,
        "--reference",
        tmp_path / "ref",
        tmp_path / "pref",
        env={},
        nproc=1,
    )
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "Restoring states from the checkpoint path at" in resumed.stdout

    kept = [r for r in _records(tmp_path / "p0") if r["step"] < 8] + _records(tmp_path / "p1")
    got, reference = _global_batches(kept), _global_batches(_records(tmp_path / "pref"))
    assert sorted(got) == list(range(STEPS_PER_EPOCH * EPOCHS)) == sorted(reference)
    stream = SampleStream(TOTAL, GLOBAL_BATCH, seed=SEED)
    for step, samples in reference.items():  # the uninterrupted run is the stream's order
        epoch, b = divmod(step, STEPS_PER_EPOCH)
        assert [i for _, i, _ in samples] == stream.share(epoch, b, 0, 1, 1)[0].tolist()
    for step in reference:  # the same samples, in the same order, with the same augmentation draws
        assert got[step] == reference[step], f"step {step}"
    for epoch in range(EPOCHS):
        seen = Counter(i for samples in got.values() for e, i, _ in samples if e == epoch)
        duplicated, dropped = sum(c - 1 for c in seen.values()), TOTAL - len(seen)
        print(f"epoch {epoch}: {duplicated} duplicated, {dropped} dropped")
        assert (duplicated, dropped) == (0, 0)
    # the resumed process's generators: re-derived from (the stream's seed, the step saved, its rank)
    assert f"rank 0 of 1: torch seed {_derived(SEED, 8, 0) & 0xFFFFFFFF}" in resumed.stdout


def test_at_the_same_number_of_processes_a_resume_over_the_stream_is_bit_identical(tmp_path: Path) -> None:
    killed = torchrun(SCRIPT, tmp_path / "run", tmp_path / "p0", "--kill-at", 10, env={}, nproc=1)
    assert killed.returncode != 0 and "rank 0: killed at 10" in killed.stdout, killed.stdout[-3000:]
    resumed = torchrun(
        SCRIPT, tmp_path / "run", tmp_path / "p1", "--reference", tmp_path / "ref", tmp_path / "pref", env={}, nproc=1
    )
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    kept = [r for r in _records(tmp_path / "p0") if r["step"] < 8] + _records(tmp_path / "p1")
    assert _global_batches(kept) == _global_batches(_records(tmp_path / "pref"))
    got, expected = _weights(tmp_path / "run" / "final" / "rank0"), _weights(tmp_path / "ref" / "final" / "rank0")
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


# -- refusals, in this process ------------------------------------------------------------------------------


def _fit(root: Path, model: Any, *, accumulate: int = 1, interrupt_at: int | None = None) -> None:
    import lightning_elastic_run as run

    callbacks: list[Any] = [run.run.ExactResume()]
    callbacks.append(run.run.ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_last=True))
    if interrupt_at is not None:
        callbacks.append(run.run.Interrupt(interrupt_at))
    trainer = run.run.L.Trainer(
        max_epochs=1,
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=accumulate,
        plugins=[run.run.TrainstateCheckpointIO()],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, ckpt_path="last")


def _interrupted(root: Path, model: Any, **kw: Any) -> None:
    import lightning_elastic_run as run

    with pytest.raises(run.run.Interrupted):
        _fit(root, model, interrupt_at=3, **kw)


class _Plain:
    """A model whose training loader is a plain shuffling DataLoader (ExactResume replays it)."""

    @staticmethod
    def make(log: Path) -> Any:
        import lightning_elastic_run as run

        class Plain(run.Streamed):
            def train_dataloader(self) -> Any:
                return run.DataLoader(run.Augmented(), batch_size=8, shuffle=True)

        return Plain(log, 1, 0)


def test_a_resume_with_other_micro_batches_mid_epoch_is_refused_by_name(tmp_path: Path) -> None:
    import lightning_elastic_run as run

    _interrupted(tmp_path / "run", run.Streamed(tmp_path / "log", 2, 0), accumulate=2)
    with pytest.raises(trainstate.StateMismatchError, match="micro_batches=1.*micro_batches=2"):
        _fit(tmp_path / "run", run.Streamed(tmp_path / "log", 1, 0), accumulate=1)


def test_a_checkpoint_over_the_stream_refuses_a_plain_loader_and_the_other_way_round(tmp_path: Path) -> None:
    import lightning_elastic_run as run

    _interrupted(tmp_path / "stream", run.Streamed(tmp_path / "log", 1, 0))
    with pytest.raises(trainstate.StateMismatchError, match="global stream"):
        _fit(tmp_path / "stream", _Plain.make(tmp_path / "log"))
    _interrupted(tmp_path / "plain", _Plain.make(tmp_path / "log"))
    with pytest.raises(trainstate.StateMismatchError, match="global stream"):
        _fit(tmp_path / "plain", run.Streamed(tmp_path / "log", 1, 0))


def test_a_sampler_cut_for_other_ranks_or_accumulation_is_refused(tmp_path: Path) -> None:
    import lightning_elastic_run as run

    class TwoRanks(run.Streamed):
        def train_dataloader(self) -> Any:
            sampler = trainstate.ResumableSampler(TOTAL, global_batch_size=GLOBAL_BATCH, num_replicas=2, rank=0)
            return run.DataLoader(run.Augmented(), batch_sampler=sampler)

    with pytest.raises(trainstate.InvalidArgumentError, match="rank 0 of num_replicas=2.*rank 0 of 1"):
        _fit(tmp_path / "a", TwoRanks(tmp_path / "log", 1, 0))
    with pytest.raises(trainstate.InvalidArgumentError, match="micro_batches=2.*accumulates gradients over 1"):
        _fit(tmp_path / "b", run.Streamed(tmp_path / "log", 2, 0), accumulate=1)
