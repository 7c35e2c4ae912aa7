"""A Lightning run over the global sample stream, for test_lightning_elastic.py: the training loader's batch
sampler is a ``ResumableSampler(global_batch_size=8)`` built for the Trainer's ranks, ExactResume on, checkpoints
by TrainstateCheckpointIO every 4 optimizer steps (global batches). Launched with torchrun::

    python -m torch.distributed.run --nproc_per_node N lightning_elastic_run.py ROOT LOG [--micro K]
        [--workers W] [--kill-at STEP] [--reference REF REF_LOG]

N processes train ROOT to the end (3 epochs of 6 global batches), resuming from its ``last.ckpt`` when there is
one, each global batch cut into K micro-batches per rank (``accumulate_grad_batches=K``). Every rank appends, for
each micro-batch it trains on, a JSON line to ``LOG.r{rank}``: the step, epoch, world size, the sample indices and
each sample's augmentation draw. ``--kill-at STEP`` SIGKILLs every rank as step STEP's first batch starts;
``--reference`` then trains REF from scratch in the same processes. As training starts each rank prints
``rank R of N: torch seed S`` (after a resume at another world size, S is the re-derived seed). Final weights go
to ``ROOT/final/rank{R}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_run as run  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import trainstate  # noqa: E402

TOTAL, GLOBAL_BATCH, SEED, EVERY = 48, 8, 7, 4


class Augmented(Dataset[tuple[torch.Tensor, ...]]):
    """Fixed points, each fetched with random noise from torch's, NumPy's and Python's generators."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(TOTAL, 4, generator=g)
        self.y = torch.randn(TOTAL, 1, generator=g)

    def __len__(self) -> int:
        return TOTAL

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        noise = 0.1 * torch.randn(4) + float(np.random.rand()) * 0.01 + random.random() * 0.001
        return self.x[i] + noise, self.y[i], torch.tensor(int(i)), noise.sum()


class Streamed(run.Tiny):
    def __init__(self, log: Path, micro: int, workers: int) -> None:
        super().__init__()
        self.log_path, self.micro, self.workers = log, micro, workers

    def train_dataloader(self) -> DataLoader[Any]:
        sampler = trainstate.ResumableSampler(
            TOTAL,
            global_batch_size=GLOBAL_BATCH,
            seed=SEED,
            num_replicas=self.trainer.world_size,
            rank=self.trainer.global_rank,
            micro_batches=self.micro,
        )
        return DataLoader(Augmented(), batch_sampler=sampler, num_workers=self.workers)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index, aug = batch
        record = {
            "step": self.trainer.global_step,
            "epoch": self.trainer.current_epoch,
            "rank": self.trainer.global_rank,
            "world": self.trainer.world_size,
            "indices": index.tolist(),
            "aug": aug.tolist(),
        }
        with open(f"{self.log_path}.r{self.trainer.global_rank}", "a") as f:
            f.write(json.dumps(record) + "\n")
        return super().training_step((x, y), batch_idx)


class KillAt(run.L.Callback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            print(f"rank {trainer.global_rank}: killed at {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class SaySeed(run.L.Callback):  # type: ignore[misc]
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        print(f"rank {trainer.global_rank} of {trainer.world_size}: torch seed {torch.initial_seed()}", flush=True)


class SeedPerRank(run.L.Callback):  # type: ignore[misc]
    """Each rank's generators differ (dropout masks), so a resume must give each rank its own."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        run.L.seed_everything(100 + trainer.global_rank, verbose=False)


def fit(root: Path, log: Path, micro: int, workers: int, kill_at: int | None) -> None:
    run.L.seed_everything(0, verbose=False)
    model = Streamed(log, micro, workers)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    checkpoint = run.ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=EVERY, save_last=True)
    trainer = run.L.Trainer(
        max_epochs=3,
        default_root_dir=root,
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        use_distributed_sampler=False,
        accumulate_grad_batches=micro,
        plugins=[run.TrainstateCheckpointIO()],
        callbacks=[
            SeedPerRank(),
            run.ExactResume(),
            checkpoint,
            SaySeed(),
            *([KillAt(kill_at)] if kill_at is not None else []),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, ckpt_path="last")
    trainstate.save(root / "final" / f"rank{trainer.global_rank}", {"model": model.net}, collective=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("log", type=Path)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--reference", type=Path, nargs=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fit(args.root, args.log, args.micro, args.workers, args.kill_at)
    if args.reference is not None:
        fit(args.reference[0], args.reference[1], args.micro, args.workers, None)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
