"""hf_trainer_run.py's Trainer run under DDP: two processes (gloo, CPU), TrainstateCallback with zstd and a key.

Launched by test_huggingface_ddp.py as a user launches a Trainer script::

    python -m torch.distributed.run --nproc_per_node 2 hf_trainer_ddp_run.py RUN_DIR FINAL_DIR [--kill-at STEP]
        [--reference REF_DIR REF_FINAL_DIR] [--async]

Each rank trains its half of every batch (the Trainer's DistributedSampler); the callback saves collectively every
``--save-steps`` updates, compressed with zstd and encrypted with the key in ``$TRAINSTATE_TEST_KEY``. Every rank's
generators are seeded apart as training begins (``SeedPerRank``), so the ranks' dropout masks differ. A run
resumes from RUN_DIR's newest checkpoint when it has one. ``--kill-at STEP`` SIGKILLs every rank once the checkpoint
of STEP was handed to the manager (with ``--async``, saving in the background, it may still be in flight); ``--reference`` then trains REF_DIR from scratch, uninterrupted, in the same processes. Each
rank writes its final weights to ``FINAL_DIR/rank{R}`` (``trainstate.save``, that rank alone), so the test can
also see that the ranks agree.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers import set_seed as hf_set_seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_trainer_run as run  # noqa: E402

import trainstate  # noqa: E402
from trainstate.integrations.huggingface import TrainstateCallback  # noqa: E402

KEY_ENV = "TRAINSTATE_TEST_KEY"


class SeedPerRank(TrainerCallback):  # type: ignore[misc]
    """Seed every rank's generators apart as training begins (the Trainer seeded them alike): each rank's dropout
    differs, so a resume must give each rank its own generators back (the callback restores them later, at the
    step the checkpoint was taken)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        hf_set_seed(100 + dist.get_rank())


def train(run_dir: str, final: str, kill_at: int | None, save_steps: int, async_save: bool) -> None:
    cb = TrainstateCallback(
        os.path.join(run_dir, "ckpt"), keep_last=2, compression="zstd", key_env=KEY_ENV, async_save=async_save
    )
    kill = [run.KillAfterSave(kill_at)] if kill_at is not None else []
    t = run.trainer(run_dir, [cb, SeedPerRank(), *kill], save_steps=save_steps, ddp_backend="gloo")
    point = cb.resume_point(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} resumed from step {cb.resumed_from}", flush=True)
    t.train(resume_from_checkpoint=point)
    trainstate.save(os.path.join(final, f"rank{dist.get_rank()}"), {"model": t.model}, collective=False)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("final")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--reference", nargs=2)
    p.add_argument("--async", dest="async_save", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    train(a.run_dir, a.final, a.kill_at, a.save_steps, a.async_save)
    if a.reference is not None:
        train(*a.reference, None, a.save_steps, a.async_save)


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
