"""hf_trainer_run.py's Trainer run, trained on 2 processes and resumed on 1: test_huggingface_elastic.py's script.

Its dataset logs every sample it fetches (the update it is fetched for, the index, the augmentation's three draws) to
a file of its own per run and rank, so the test can check which samples each update took, and their draws::

    python -m torch.distributed.run --nproc_per_node 2 hf_trainer_elastic_run.py WORK first
    python hf_trainer_elastic_run.py WORK resume

``first`` (2 processes, gloo): an uninterrupted reference run (``WORK/ref``), then the run (``WORK/run``), saving every
2 updates, SIGKILLed on both ranks once its step-4 checkpoint is written (mid-epoch: 3 updates an epoch). Both keep
the global batch at 16: 4 samples per device x 2 accumulation steps x 2 processes. ``resume`` (1 process): a resume
at a global batch of 8 (refused: it prints ``refused:`` and the error), then two resumes of copies of the run, one
with ``per_device_train_batch_size`` doubled (``batch``), one with ``gradient_accumulation_steps`` doubled
(``accumulation``), each printing the step it resumed from and whether its generators are the re-derived ones.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_trainer_run as run  # noqa: E402

import trainstate  # noqa: E402
from trainstate.errors import StateMismatchError  # noqa: E402
from trainstate.integrations.huggingface import TrainstateCallback  # noqa: E402


class LoggedTokens(run.NoisyTokens):
    """NoisyTokens that appends ``[epoch, index, draw, draw, draw]`` to ``log`` for every sample it fetches, and
    hands each sample's index on (``idx``) for :class:`LoggingTrainer` to log the update that trains it."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.log = log
        self.epoch = 0  # the epoch the fetches are for (FollowTheEpoch)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        a, b, c = random.random(), int(np.random.randint(8)), int(torch.randint(2, 50, ()))
        ids = self.x[i].clone()
        if a < 0.5:
            ids[b] = c
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(json.dumps([self.epoch, i, a, b, c]) + "\n")
        return {"input_ids": ids, "labels": self.y[i], "idx": torch.tensor(i)}


def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {**run.masking_collator(batch), "idx": torch.stack([b["idx"] for b in batch])}


class LoggingTrainer(Trainer):  # type: ignore[misc]
    """A Trainer that appends ``[update, indices]`` to ``steps_log`` for each micro-batch it trains (the loader
    fetches a batch ahead, so the dataset cannot tell which update a fetch is for)."""

    steps_log = ""

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        idx = inputs.pop("idx")
        with open(self.steps_log, "a", encoding="utf-8") as f:
            f.write(json.dumps([self.state.global_step, [int(i) for i in idx]]) + "\n")
        return super().training_step(model, inputs, num_items_in_batch)


class FollowTheEpoch(TrainerCallback):  # type: ignore[misc]
    """Tell the dataset the epoch its fetches are for (an epoch's iterator starts after on_epoch_begin)."""

    def __init__(self, dataset: LoggedTokens) -> None:
        self.dataset = dataset

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.dataset.epoch = int(state.epoch or 0)  # whole at an epoch's start, part-way at a resumed one


class FirstStepRNG(TrainerCallback):  # type: ignore[misc]
    """torch's generator state at the first step's start (after TrainstateCallback put the restored one back)."""

    def __init__(self) -> None:
        self.seen: torch.Tensor | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.seen is None:
            self.seen = torch.get_rng_state().clone()


def trainer(work: str, name: str, per_device: int, accumulation: int, callbacks: list[Any]) -> Trainer:
    rank = int(os.environ.get("RANK", "0"))  # the process group starts with the TrainingArguments
    dataset = LoggedTokens(os.path.join(work, f"{name}-fetched-rank{rank}.jsonl"))
    args = run.arguments(
        os.path.join(work, name),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        save_steps=2,
        eval_strategy="no",
        remove_unused_columns=False,  # idx reaches LoggingTrainer
        **({"ddp_backend": "gloo"} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}),
    )
    t = LoggingTrainer(
        model=run.model(),
        args=args,
        train_dataset=dataset,
        data_collator=collate,
        callbacks=[*callbacks, FollowTheEpoch(dataset)],
    )
    t.steps_log = os.path.join(work, f"{name}-trained-rank{rank}.jsonl")
    return t


def train(work: str, name: str, per_device: int, accumulation: int, kill_at: int | None = None) -> None:
    cb = TrainstateCallback(os.path.join(work, name, "ckpt"), keep_last=2)
    kill = [run.KillAfterSave(kill_at)] if kill_at is not None else []
    t = trainer(work, name, per_device, accumulation, [cb, *kill])
    t.train(resume_from_checkpoint=cb.resume_point(t))


def rederived_torch_state(step: int) -> torch.Tensor:
    """torch's generator as ``RNGState(seed=0).rederive(0, step)`` sets it, this process's left as they were."""
    here = trainstate.RNGState().state_dict()
    trainstate.RNGState(seed=0).rederive(0, step)
    state = torch.get_rng_state().clone()
    trainstate.RNGState().load_state_dict(here)
    return state


def resume(work: str, name: str, per_device: int, accumulation: int) -> None:
    shutil.copytree(os.path.join(work, "run"), os.path.join(work, name))
    cb = TrainstateCallback(os.path.join(work, name, "ckpt"), keep_last=2)
    seen = FirstStepRNG()
    t = trainer(work, name, per_device, accumulation, [cb, seen])
    point = cb.resume_point(t)
    assert cb.resumed_from is not None
    expected = rederived_torch_state(cb.resumed_from)
    t.train(resume_from_checkpoint=point)
    same = seen.seen is not None and torch.equal(seen.seen, expected)
    print(f"{name} resumed from step {cb.resumed_from}; generators re-derived: {same}", flush=True)


def main(argv: list[str]) -> None:
    work, phase = argv
    torch.set_num_threads(1)
    if phase == "first":
        train(work, "ref", 4, 2)
        train(work, "run", 4, 2, kill_at=4)
        return
    shutil.copytree(os.path.join(work, "run"), os.path.join(work, "wrong"))
    try:
        train(work, "wrong", 4, 2)  # a global batch of 8
    except StateMismatchError as e:
        print("refused:", str(e).replace("\n", " | "), flush=True)
    resume(work, "batch", 8, 2)
    resume(work, "accumulation", 4, 4)


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
