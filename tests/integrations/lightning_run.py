"""A tiny Lightning run (and the helpers) for the Lightning tests: dropout, a shuffling DataLoader with random augmentation in
the dataset, AdamW with a step LR schedule, ModelCheckpoint every few steps (top 2 by loss, and last.ckpt).

As a script (test_lightning_resume.py runs it in two fresh processes)::

    python lightning_run.py ROOT --hang-after STEP      train; in the batch after STEP's checkpoint print
                                                        "checkpointed STEP" and wait to be killed
    python lightning_run.py ROOT --control C --reference R
        resume ROOT with ckpt_path="last" to the end; then, in the same process, resume C (a copy of ROOT's
        checkpoints) with Lightning alone (no ExactResume), and train R from scratch without interruption

Each run's final weights are saved as the trainstate checkpoint DIR/final. Options: --workers N, --async-save.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import trainstate
from trainstate.integrations.lightning import ExactResume, TrainstateCheckpointIO

__all__ = ["L", "DataLoader", "ExactResume", "ModelCheckpoint", "TorchCheckpointIO", "TrainstateCheckpointIO"]

STEPS_PER_EPOCH = 8
EPOCHS = 3


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed points, each fetched with fresh random noise: augmentation drawn where the sample is loaded."""

    def __init__(self, n: int = 6 * STEPS_PER_EPOCH) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(4), self.y[i]


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The same points as a stream of unknown length, shuffled by the stream itself (from torch's RNG, when an
    epoch's iteration starts): Lightning then fetches one batch ahead of training."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = Noisy()
        for i in torch.randperm(len(data)).tolist():
            yield data[i]


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.05, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)]


class Validated(Tiny):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))


class Recording(TrainstateCheckpointIO):
    """The plugin, noting which checkpoints Lightning asked it to remove."""

    removed: list[str]

    def remove_checkpoint(self, path: Any) -> None:
        self.__dict__.setdefault("removed", []).append(os.path.basename(path))
        super().remove_checkpoint(path)


class Steps(L.Callback):
    """Counts the training steps a fit runs."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.count += 1


class WithObjectHparam(Tiny):
    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()


class Interrupted(Exception):
    pass


class Interrupt(L.Callback):
    """Raise Interrupted in the batch after ``step``'s checkpoint (Lightning re-raises it after its teardown)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise Interrupted


class HangAfter(L.Callback):
    """In the batch after the checkpoint of ``step``, say so and wait for SIGKILL."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            print(f"checkpointed {self.step}", flush=True)
            time.sleep(600)


def loader(workers: int = 0, iterable: bool = False, **kwargs: Any) -> DataLoader[Any]:
    if iterable:
        return DataLoader(Stream(), batch_size=6, num_workers=workers, **kwargs)
    return DataLoader(Noisy(), batch_size=6, shuffle=True, num_workers=workers, **kwargs)


def trainer(
    root: Path,
    *,
    exact: bool = True,
    every: int = 5,
    callbacks: tuple[Any, ...] = (),
    lightning_io: bool = False,
    validate: bool = False,
    **plugin: Any,
) -> L.Trainer:
    """``lightning_io``: Lightning's own checkpoint plugin (torch.save) instead of TrainstateCheckpointIO.
    ``validate``: validation twice an epoch, and ModelCheckpoint saving after each (by val_loss)."""
    if validate:
        checkpoint = ModelCheckpoint(dirpath=root / "checkpoints", save_top_k=2, monitor="val_loss", save_last=True)
    else:
        checkpoint = ModelCheckpoint(
            dirpath=root / "checkpoints", every_n_train_steps=every, save_top_k=2, monitor="train_loss", save_last=True
        )
    return L.Trainer(
        max_epochs=EPOCHS,
        default_root_dir=root,
        plugins=[] if lightning_io else [TrainstateCheckpointIO(**plugin)],
        callbacks=[*([ExactResume()] if exact else []), checkpoint, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=0.5 if validate else None,
    )


def fit(
    root: Path,
    *,
    exact: bool = True,
    workers: int = 0,
    iterable: bool = False,
    every: int = 5,
    callbacks: tuple[Any, ...] = (),
    lightning_io: bool = False,
    validate: bool = False,
    **plugin: Any,
) -> Tiny:
    """Train ``root``'s run to the end (resuming from its last checkpoint if it has one)."""
    L.seed_everything(0, verbose=False)
    model = Validated() if validate else Tiny()
    run = trainer(
        root, exact=exact, every=every, callbacks=callbacks, lightning_io=lightning_io, validate=validate, **plugin
    )
    val = DataLoader(Noisy(12), batch_size=4, shuffle=True, num_workers=workers) if validate else None
    run.fit(model, loader(workers, iterable), val, ckpt_path="last")
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--hang-after", type=int)
    ap.add_argument("--control", type=Path)
    ap.add_argument("--reference", type=Path)
    args = ap.parse_args()
    hang = (HangAfter(args.hang_after),) if args.hang_after is not None else ()
    runs = [(args.root, True, hang)]
    if args.control is not None:
        runs.append((args.control, False, ()))
    if args.reference is not None:
        runs.append((args.reference, True, ()))
    for root, exact, callbacks in runs:
        model = fit(root, exact=exact, workers=args.workers, callbacks=callbacks, async_save=args.async_save)
        trainstate.save(root / "final", {"model": model.net})


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
