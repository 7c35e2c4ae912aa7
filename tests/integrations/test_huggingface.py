"""TrainstateCallback in one process: what it saves and keeps, and the ways users get it wrong.

The SIGKILL-and-resume test is test_huggingface_resume.py; the run is hf_trainer_run.py's tiny BERT.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

import hf_trainer_run as run  # noqa: E402
from transformers import TrainerCallback, default_data_collator  # noqa: E402

import trainstate  # noqa: E402
from trainstate.integrations.huggingface import TrainstateCallback  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with run.one_thread():
        yield


def accuracy(pred: Any) -> dict[str, Any]:
    """A compute_metrics that returns NumPy scalars, as most do."""
    return {"accuracy": np.float32((pred.predictions.argmax(-1) == pred.label_ids).mean())}


def test_saves_on_the_trainers_events_and_keeps_what_retention_says(tmp_path: Path) -> None:
    """A whole run (15 updates, a save and an evaluation every 3) keeping the last two checkpoints and the best one
    by eval_loss, which load_best_model_at_end loads at the end. "Best" is the highest loss here, to be sure it is
    not one of the last two."""
    cb = TrainstateCallback(tmp_path / "ckpt", keep_last=2, keep_best=("eval_loss", "max", 1))
    trainer = run.trainer(str(tmp_path), [cb], load_best_model_at_end=True, greater_is_better=True)
    trainer.compute_metrics = accuracy
    assert cb.resume_point(trainer) is None  # nothing to resume: a fresh run
    trainer.train()

    evals = {e["step"]: e for e in trainer.state.log_history if "eval_loss" in e}
    assert sorted(evals) == [3, 6, 9, 12, 15]
    best = max(evals, key=lambda s: evals[s]["eval_loss"])
    assert best < 12  # else load_best_model_at_end and keep_best would be no different from keep_last here
    # every save event was written (history), retention kept the best and the last two
    assert [r.step for r in cb.manager.history()] == [3, 6, 9, 12, 15]
    kept = {c.step: c for c in cb.manager.list()}
    assert sorted(kept) == [best, 12, 15]
    for step, info in kept.items():  # each with the evaluation of its own step, NumPy scalars included
        assert info.metrics["eval_loss"] == evals[step]["eval_loss"]
        assert info.metrics["eval_accuracy"] == pytest.approx(float(evals[step]["eval_accuracy"]))
    # the Trainer wrote no checkpoint folders of its own
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    # a plain trainstate checkpoint: everything a resume needs, readable without the Trainer
    saved = trainstate.load(cb.manager.path_for(15))
    assert set(saved) == {"model", "optimizer", "lr_scheduler", "trainer_state", "rng", "data"}
    assert saved["trainer_state"]["global_step"] == 15
    assert saved["data"]["epoch"] == 3 and saved["data"]["batches_into_epoch"] == 0
    assert saved["data"]["batches_per_epoch"] == 10 and saved["data"]["seeded_per_sample"] is True
    assert isinstance(saved["trainer_state"]["log_history"][1]["eval_accuracy"], float)
    # the training loader's dataset is the user's again: the per-sample seeding hook is gone
    assert "__getitems__" not in vars(trainer.train_dataset)
    # load_best_model_at_end: the model now is the best checkpoint's
    best_model = trainstate.load(cb.manager.path_for(best), include="model.*")["model"]
    for name, value in trainer.model.state_dict().items():
        assert np.array_equal(value.numpy(), best_model[name]), name


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One epoch (5 updates), saved at 3 and at the end, NumPy metrics in its log history."""
    out = tmp_path_factory.mktemp("short")
    cb = TrainstateCallback(out / "ckpt")
    trainer = run.trainer(str(out), [cb], num_train_epochs=1)
    trainer.compute_metrics = accuracy
    with run.one_thread():
        trainer.train()
    return {"ckpt": out / "ckpt", "trainer": trainer}


def test_resume_point_writes_a_stand_in_the_trainer_reads(short: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(short["ckpt"], out / "ckpt")
    cb = TrainstateCallback(out / "ckpt")
    trainer = run.trainer(str(out), [cb], num_train_epochs=1)
    folder = cb.resume_point(trainer)
    assert folder is not None and cb.resumed_from == 5
    with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as f:
        state = json.load(f)  # plain JSON: the NumPy metrics became floats
    history = short["trainer"].state.log_history
    assert state["global_step"] == 5 and state["log_history"] == history[:-1]  # all but the end-of-training summary
    assert "train_runtime" in history[-1]
    assert any(isinstance(e.get("eval_accuracy"), float) for e in state["log_history"])
    with open(os.path.join(folder, "model.safetensors.index.json"), encoding="utf-8") as f:
        assert set(json.load(f)["weight_map"]) == set(trainer.model.state_dict())
    trainer.train(resume_from_checkpoint=folder)  # the run was over: nothing to train, the state restored
    assert not os.path.exists(folder)  # removed once the Trainer read it
    assert trainer.state.global_step == 5
    saved = trainstate.load(out / "ckpt" / "step_00000005", include="model.*")["model"]
    for name, value in trainer.model.state_dict().items():
        assert np.array_equal(value.numpy(), saved[name]), name


def test_bad_arguments_are_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(trainstate.InvalidArgumentError, match="save_strategy='steps', save_steps=N"):
        TrainstateCallback(tmp_path / "a", every_steps=5)
    with pytest.raises(trainstate.InvalidArgumentError, match="unknown option.*keep_lst.*keep_last"):
        TrainstateCallback(tmp_path / "a", keep_lst=3)
    with pytest.raises(trainstate.InvalidArgumentError, match="capture_rng"):
        TrainstateCallback(tmp_path / "a", capture_rng=False)
    with pytest.raises(trainstate.InvalidArgumentError, match="seed_per_sample must be True or False"):
        TrainstateCallback(tmp_path / "a", seed_per_sample="yes")
    with pytest.raises(trainstate.InvalidArgumentError, match="keep_last"):
        TrainstateCallback(tmp_path / "a", keep_last=0)
    trainstate.save(tmp_path / "ckpt", {"w": np.ones(2)})
    with pytest.raises(trainstate.InvalidArgumentError, match="is a checkpoint, not a run directory"):
        TrainstateCallback(tmp_path / "ckpt")

    cb = TrainstateCallback(tmp_path / "no")
    trainer = run.trainer(str(tmp_path), [cb], save_strategy="no", eval_strategy="no")
    with pytest.raises(trainstate.InvalidArgumentError, match="save_strategy='no'.*would never save"):
        trainer.train()
    assert not trainstate.CheckpointManager(tmp_path / "no", read_only=True).list()

    cb = TrainstateCallback(tmp_path / "best")  # no keep_best: load_best_model_at_end would find nothing
    trainer = run.trainer(str(tmp_path), [cb], load_best_model_at_end=True)
    with pytest.raises(trainstate.InvalidArgumentError, match=r"keep_best=\('eval_loss', 'min', 1\)"):
        trainer.train()
    cb = TrainstateCallback(tmp_path / "best-max", keep_best=("eval_loss", "max", 1))  # the wrong way round:
    trainer = run.trainer(str(tmp_path), [cb], load_best_model_at_end=True)  # retention would delete the best
    with pytest.raises(trainstate.InvalidArgumentError, match=r"lowest \(greater_is_better=False\).*'max'"):
        trainer.train()

    done = TrainstateCallback(tmp_path / "done")  # a directory with a run's checkpoints, and no resume_point call
    with trainstate.CheckpointManager(tmp_path / "done") as mgr:
        mgr.save(15, {"w": np.ones(2)})
    with pytest.raises(trainstate.InvalidArgumentError, match=r"already holds checkpoints .*resume_point\(trainer\)"):
        run.trainer(str(tmp_path), [done]).train()

    stray = TrainstateCallback(tmp_path / "stray")
    with pytest.raises(trainstate.InvalidArgumentError, match="add_callback"):
        stray.resume_point(run.trainer(str(tmp_path), []))  # the callback is not the Trainer's


def test_several_processes_without_a_collective_manager_are_refused(tmp_path: Path) -> None:
    """A Trainer of several processes needs the callback's manager to save with all of them (the 2-process runs
    are test_huggingface_ddp.py); here the Trainer's arguments say 2 and the manager has one process."""
    from types import SimpleNamespace

    two = SimpleNamespace(world_size=2)
    cb = TrainstateCallback(tmp_path / "a")
    with pytest.raises(trainstate.InvalidArgumentError, match="its manager sees 1 .*launch with torchrun"):
        cb._check_ranks(two, cb.manager)
    cb = TrainstateCallback(tmp_path / "b", collective=False)
    with pytest.raises(trainstate.InvalidArgumentError, match="collective=False would have each rank write"):
        cb._check_ranks(two, cb.manager)
    cb._check_ranks(SimpleNamespace(world_size=1), cb.manager)  # one process: nothing to check


def test_the_callback_added_twice(tmp_path: Path) -> None:
    cb = TrainstateCallback(tmp_path / "ckpt")
    trainer = run.trainer(str(tmp_path), [cb], num_train_epochs=1, eval_strategy="no")  # saves at 3 and 5
    trainer.add_callback(cb)  # the same one again: the Trainer warns, and calls it twice per event
    assert trainer.callback_handler.callbacks.count(cb) == 2
    assert cb.resume_point(trainer) is None  # opens the manager, which locks the directory
    second = TrainstateCallback(tmp_path / "ckpt")  # building one takes no lock (a notebook cell run again)...
    with pytest.raises(trainstate.CheckpointError, match="another CheckpointManager"):
        second.resume_point(run.trainer(str(tmp_path), [second]))  # ...but it cannot save beside the first
    trainer.train()
    assert [r.step for r in cb.manager.history()] == [3, 5]  # once each

    other = TrainstateCallback(tmp_path / "other")
    trainer.add_callback(other)
    with pytest.raises(trainstate.InvalidArgumentError, match="has 2 TrainstateCallbacks"):
        cb.resume_point(trainer)
    # without resume_point the second one would never save, silently: training stops at its start
    first, second = TrainstateCallback(tmp_path / "first"), TrainstateCallback(tmp_path / "second")
    trainer = run.trainer(str(tmp_path), [first, second], num_train_epochs=1, eval_strategy="no")
    with pytest.raises(trainstate.InvalidArgumentError, match="two TrainstateCallbacks"):
        trainer.train()
    again = TrainstateCallback(tmp_path / "first")  # the first let go of its directory
    run.trainer(str(tmp_path), [again], num_train_epochs=1, eval_strategy="no").train()
    assert [r.step for r in again.manager.history()] == [3, 5]


def test_a_directory_from_another_tool_is_named(tmp_path: Path) -> None:
    with trainstate.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(10, {"model": torch.nn.Linear(2, 2)})
    cb = TrainstateCallback(tmp_path / "ckpt")
    with pytest.raises(
        trainstate.InvalidArgumentError, match="holds no trainer_state.*not written by TrainstateCallback"
    ):
        cb.resume_point(run.trainer(str(tmp_path), [cb]))


def test_a_damaged_newest_checkpoint_is_skipped(
    short: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    shutil.copytree(short["ckpt"], out / "ckpt")
    newest = out / "ckpt" / "step_00000005"
    data = max(newest.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF  # a flipped bit in a tensor's bytes
    data.write_bytes(bytes(raw))
    cb = TrainstateCallback(out / "ckpt")
    trainer = run.trainer(str(out), [cb], num_train_epochs=1, eval_strategy="no")
    with caplog.at_level(logging.WARNING, logger="trainstate"):
        folder = cb.resume_point(trainer)
    assert folder is not None and cb.resumed_from == 3
    assert "step_00000005 cannot be resumed from" in caplog.text
    trainer.train(resume_from_checkpoint=folder)
    assert trainer.state.global_step == 5


def test_checkpoints_none_of_which_reads_are_an_error_not_a_fresh_start(short: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(short["ckpt"], out / "ckpt")
    for manifest in (out / "ckpt").glob("step_*/manifest.json"):
        manifest.write_bytes(manifest.read_bytes()[:40])  # every manifest cut short
    for _ in range(2):  # the first callback let go of the directory: a second one is told the same, not "locked"
        cb = TrainstateCallback(out / "ckpt")
        with pytest.raises(trainstate.CorruptCheckpointError, match="none of the 2 checkpoint"):
            cb.resume_point(run.trainer(str(out), [cb], num_train_epochs=1, eval_strategy="no"))


def test_the_trainers_own_checkpoints_are_not_passed_over_in_silence(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "checkpoint-500").mkdir()  # a run moved over from the Trainer's own checkpoints
    cb = TrainstateCallback(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING, logger="trainstate"):
        assert cb.resume_point(run.trainer(str(tmp_path), [cb])) is None
    assert "the Trainer's own checkpoints (checkpoint-500), which TrainstateCallback does not read" in caplog.text
    cb.manager.close()  # no train() here to close it (its signal handlers would outlive the test)


def test_resuming_with_another_batch_size_is_refused(short: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(short["ckpt"], out / "ckpt")
    shutil.rmtree(out / "ckpt" / "step_00000005")  # resume mid-run, from step 3
    cb = TrainstateCallback(out / "ckpt")
    trainer = run.trainer(str(out), [cb], num_train_epochs=1, per_device_train_batch_size=2)
    folder = cb.resume_point(trainer)
    with pytest.raises(
        trainstate.StateMismatchError, match=r"data.batches_per_epoch: target has 20, checkpoint has 10"
    ):
        trainer.train(resume_from_checkpoint=folder)
    # the failed start let go of everything: the dataset is the user's, the directory unlocked
    assert "__getitems__" not in vars(trainer.train_dataset)
    trainstate.CheckpointManager(out / "ckpt").close()
    # and the same callback starts again, at the batch size the run had
    trainer = run.trainer(str(out), [cb], num_train_epochs=1, eval_strategy="no")
    trainer.train(resume_from_checkpoint=cb.resume_point(trainer))
    assert cb.resumed_from == 3 and trainer.state.global_step == 5


class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The run's sequences as a stream (no index: nothing to seed per sample), deterministic."""

    def __iter__(self) -> Any:
        data = run.NoisyTokens()
        for i in range(len(data)):
            yield {"input_ids": data.x[i], "labels": data.y[i]}


def test_an_iterable_dataset_resumes_exactly_when_its_stream_is_fixed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def train(out: Path) -> tuple[Any, TrainstateCallback]:
        cb = TrainstateCallback(out / "ckpt", keep_last=5)
        trainer = run.trainer(str(out), [cb], max_steps=6, save_steps=2, eval_strategy="no")
        trainer.train_dataset = _Stream()
        trainer.data_collator = default_data_collator  # fetching draws no random number
        trainer.train(resume_from_checkpoint=cb.resume_point(trainer))
        return trainer, cb

    with caplog.at_level(logging.WARNING, logger="trainstate"):
        whole, cb = train(tmp_path / "whole")
    assert "not seeded per sample (an iterable dataset has no sample index" in caplog.text
    assert [r.step for r in cb.manager.history()] == [2, 4, 6]
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "ckpt" / "step_00000006")
    resumed, cb = train(tmp_path / "cut")
    assert cb.resumed_from == 4
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


class _Preempt(TrainerCallback):  # type: ignore[misc]
    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == 4:
            os.kill(os.getpid(), signal.SIGUSR1)  # what a scheduler sends before it preempts a job


def test_a_preemption_signal_saves_and_stops(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    cb = TrainstateCallback(tmp_path / "ckpt", async_save=True)
    trainer = run.trainer(str(tmp_path), [cb, _Preempt()], eval_strategy="no", logging_steps=1)
    trainer.train(resume_from_checkpoint=cb.resume_point(trainer))
    assert cb.preempted and trainer.state.global_step == 5  # the step under way when the signal came
    assert [(r.step, r.reason) for r in cb.manager.history()] == [
        (3, "Trainer save_strategy='steps', save_steps=3"),
        (5, "preemption (SIGUSR1)"),
    ]
    assert signal.getsignal(signal.SIGUSR1) == before  # the manager gave the handler back at the end
    # the checkpoint holds the preempted step's log entry: the resumed run starts after that step
    with trainstate.open(tmp_path / "ckpt" / "step_00000005") as ck:
        saved = ck.load(include=["trainer_state.*"])["trainer_state"]
    assert saved["log_history"] == trainer.state.log_history[:-1]  # all but the summary train() logs at its end
    assert saved["log_history"][-1]["step"] == 5


def test_without_transformers_the_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an import of a package not installed meets
    monkeypatch.delitem(sys.modules, "trainstate.integrations.huggingface")
    with pytest.raises(trainstate.MissingDependencyError) as e:
        importlib.import_module("trainstate.integrations.huggingface")
    assert "trainstate.integrations.huggingface needs transformers" in str(e.value)
    assert 'pip install "trainstate[huggingface]"' in str(e.value)


class GrowingBuffer(torch.nn.Module):
    """A model with a buffer whose shape changes as it trains (the first token of every sequence seen), and a
    ``_load_from_state_dict`` that takes the saved buffer's shape, as models with such buffers have."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 4)
        self.head = torch.nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(0, dtype=torch.long))

    def forward(self, input_ids: Any, labels: Any = None) -> dict[str, Any]:
        if self.training:
            self.seen = torch.cat([self.seen, input_ids[:, 0]])
        logits = self.head(self.emb(input_ids).mean(1))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any) -> None:
        if prefix + "seen" in state_dict:
            self.seen = torch.empty_like(state_dict[prefix + "seen"])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def test_a_model_whose_load_state_dict_reshapes_a_buffer_resumes(tmp_path: Path) -> None:
    """The Trainer's own resume calls model.load_state_dict, so a model's _load_from_state_dict may resize its
    buffers; the callback copied the saved tensors into the fresh model's, and the shapes differed."""

    def trainer(cb: TrainstateCallback) -> Any:
        args = run.arguments(str(tmp_path), num_train_epochs=1, eval_strategy="no")
        return run.Trainer(model=GrowingBuffer(), args=args, train_dataset=run.NoisyTokens(), callbacks=[cb])

    first = trainer(TrainstateCallback(tmp_path / "ckpt"))
    first.train()
    assert first.model.seen.shape == (40,)
    cb = TrainstateCallback(tmp_path / "ckpt")
    second = trainer(cb)
    second.train(resume_from_checkpoint=cb.resume_point(second))
    assert cb.resumed_from == 5 and torch.equal(second.model.seen, first.model.seen)
    for name, value in first.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], value), name


def test_on_a_tie_the_trainers_best_is_kept_and_loaded(tmp_path: Path) -> None:
    """Every evaluation ties. The Trainer records the first as best (a new best must be strictly better); keep_best
    kept the newest of the tied ones and deleted the Trainer's, and load_best_model_at_end loaded another model
    than the one the Trainer's state names."""
    cb = TrainstateCallback(tmp_path / "ckpt", keep_last=1, keep_best=("eval_accuracy", "max", 1))
    trainer = run.trainer(
        str(tmp_path),
        [cb],
        num_train_epochs=2,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        greater_is_better=True,
    )
    trainer.compute_metrics = lambda pred: {"accuracy": 0.5}
    assert cb.resume_point(trainer) is None
    trainer.train()

    assert trainer.state.best_global_step == 3 and trainer.state.best_metric == 0.5  # the first of the tie
    assert 3 in [c.step for c in cb.manager.list()]
    assert trainer.state.best_model_checkpoint == cb.manager.path_for(3)
    best_model = trainstate.load(cb.manager.path_for(3), include="model.*")["model"]
    for name, value in trainer.model.state_dict().items():
        assert np.array_equal(value.numpy(), best_model[name]), name
