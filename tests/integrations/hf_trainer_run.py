"""A tiny Hugging Face Trainer run with TrainstateCallback: the SIGKILL test's script, and the in-process tests' setup.

A 2-layer BERT with hidden size 16, built from a config (nothing downloaded), dropout on, trained on 40 synthetic
sequences whose fetching is random twice over: ``__getitem__`` replaces tokens at random (Python's, NumPy's and
torch's global generators) and the collator masks tokens (torch's). Batches of 4 with 2-step gradient accumulation:
5 updates per epoch, 3 epochs; an evaluation and a save every 3 updates.

    python hf_trainer_run.py RUN_DIR FINAL_DIR [--kill-at STEP] [--async] [--trainer-own]

writes the final weights to FINAL_DIR (``trainstate.save``). ``--kill-at STEP`` SIGKILLs the process right after
the checkpoint of STEP was handed to the manager (with ``--async`` it may still be in flight). ``--trainer-own``
uses the Trainer's own checkpoints and resume instead of trainstate's (a comparison, not a test of trainstate).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
from transformers import set_seed as hf_set_seed
from transformers.utils import logging as hf_logging

import trainstate
from trainstate.integrations.huggingface import TrainstateCallback

hf_logging.set_verbosity_error()


class NoisyTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 40, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(2, 50, (n, 8), generator=g)
        self.y = (self.x[:, 0] > 25).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.x[i].clone()
        if random.random() < 0.5:  # Python's generator
            ids[int(np.random.randint(8))] = int(torch.randint(2, 50, ()))  # NumPy's and torch's
        return {"input_ids": ids, "labels": self.y[i]}


def masking_collator(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([b["input_ids"] for b in batch])
    return {
        "input_ids": ids.masked_fill(torch.rand(ids.shape) < 0.15, 1),
        "labels": torch.stack([b["labels"] for b in batch]),
    }


def model() -> BertForSequenceClassification:
    hf_set_seed(0)
    cfg = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=2,
    )
    return BertForSequenceClassification(cfg)


def arguments(output_dir: str, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        num_train_epochs=3,
        learning_rate=3e-3,
        save_strategy="steps",
        save_steps=3,
        eval_strategy="steps",
        eval_steps=3,
        logging_steps=2,
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def trainer(output_dir: str, callbacks: list[Any], **overrides: Any) -> Trainer:
    return Trainer(
        model=model(),
        args=arguments(output_dir, **overrides),
        train_dataset=NoisyTokens(),
        eval_dataset=NoisyTokens(16, seed=1),
        data_collator=masking_collator,
        callbacks=callbacks,
    )


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread, as the script runs: a tiny model's steps on two threads of a busy two-core machine
    spend most of their time spinning (7 s of CPU for this run against 0.9 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class KillAfterSave(TrainerCallback):  # type: ignore[misc]
    """SIGKILL the process once the checkpoint of ``step`` was handed over (by TrainstateCallback's flush, which
    runs earlier in the callback list at the same event, or by the Trainer's own save)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("final")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--trainer-own", action="store_true")
    p.add_argument("--no-seeding", action="store_true")
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--workers", type=int, default=0)
    a = p.parse_args(argv)
    overrides = {"save_steps": a.save_steps, "dataloader_num_workers": a.workers}
    torch.set_num_threads(1)
    kill = [KillAfterSave(a.kill_at)] if a.kill_at is not None else []
    if a.trainer_own:
        t = trainer(a.run_dir, kill, **overrides)
        resume = (
            any(name.startswith("checkpoint-") for name in os.listdir(a.run_dir)) if os.path.isdir(a.run_dir) else False
        )
        t.train(resume_from_checkpoint=True if resume else None)
    else:
        cb = TrainstateCallback(
            os.path.join(a.run_dir, "ckpt"), keep_last=2, async_save=a.async_save, seed_per_sample=not a.no_seeding
        )
        t = trainer(a.run_dir, [cb, *kill], **overrides)
        point = cb.resume_point(t)
        print(
            "resumed from step", None if point is None else t.state.global_step if False else cb._resume[0], flush=True
        )
        t.train(resume_from_checkpoint=point)
    trainstate.save(a.final, {"model": t.model})


if __name__ == "__main__":
    main(sys.argv[1:])
