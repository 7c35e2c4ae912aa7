"""lightning_run.py's Lightning run under DDP: two processes (``strategy="ddp"``, gloo on CPU), its checkpoints
written by TrainstateCheckpointIO with zstd and a key, ExactResume on.

Launched by test_lightning_ddp.py with torchrun (Lightning then takes the processes torchrun started)::

    python -m torch.distributed.run --nproc_per_node 2 lightning_ddp_run.py ROOT [--kill-after STEP]
        [--reference REF]

Trains ROOT to the end, resuming from its ``last.ckpt`` when there is one; ModelCheckpoint saves every 3 steps
(each rank trains 4 batches an epoch of the DistributedSampler's half). ``--kill-after STEP`` SIGKILLs every
rank in the batch after STEP's checkpoint; ``--reference`` then trains REF from scratch in the same processes.
Every rank's generators are seeded by rank as training starts (``SeedPerRank``), so the ranks' random draws
differ. Each rank writes its final weights to ``ROOT/final/rank{R}`` (``trainstate.save``, that rank alone). The key is
read from ``$TRAINSTATE_TEST_KEY``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_run as run  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import trainstate  # noqa: E402

KEY_ENV = "TRAINSTATE_TEST_KEY"
EVERY = 3


class KillAfter(run.L.Callback):  # type: ignore[misc]
    """SIGKILL this rank in the batch after the checkpoint of ``step`` (every rank does, at the same batch)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            print(f"rank {trainer.global_rank}: checkpointed {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class SeedPerRank(run.L.Callback):  # type: ignore[misc]
    """Seed torch's, NumPy's and Python's generators by rank (after Lightning seeded every rank alike, before a
    checkpoint is restored): each rank's noise and dropout differ, so a resume must give each rank its own."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        run.L.seed_everything(100 + trainer.global_rank, verbose=False)


def fit(root: Path, kill_after: int | None) -> None:
    run.L.seed_everything(0, verbose=False)
    model = run.Tiny()
    checkpoint = run.ModelCheckpoint(
        dirpath=root / "checkpoints", every_n_train_steps=EVERY, save_top_k=2, monitor="train_loss", save_last=True
    )
    trainer = run.L.Trainer(
        max_epochs=run.EPOCHS,
        default_root_dir=root,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        plugins=[run.TrainstateCheckpointIO(compression="zstd", key_env=KEY_ENV)],
        callbacks=[
            SeedPerRank(),
            run.ExactResume(),
            checkpoint,
            *([KillAfter(kill_after)] if kill_after is not None else []),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, run.loader(), ckpt_path="last")
    trainstate.save(root / "final" / f"rank{trainer.global_rank}", {"model": model.net}, collective=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("--kill-after", type=int)
    ap.add_argument("--reference", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fit(args.root, args.kill_after)
    if args.reference is not None:
        fit(args.reference, None)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
