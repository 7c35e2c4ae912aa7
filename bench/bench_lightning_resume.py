"""How close a resumed Lightning run gets to an uninterrupted one: Lightning alone, and with trainstate.

The tiny run of tests/integrations/lightning_run.py (dropout, a shuffled DataLoader whose dataset adds random
noise to each sample, AdamW, a step LR schedule; 3 epochs of 8 steps, a checkpoint every 5 steps) is
interrupted in the batch after a checkpoint and resumed with ``ckpt_path="last"`` in three ways:

- Lightning: its default TorchCheckpointIO, nothing else;
- + TrainstateCheckpointIO: the same dict saved by trainstate (the resume is Lightning's: as inexact);
- + ExactResume: the RNG and the DataLoader's place in its epoch saved and replayed.

For each, against the uninterrupted run: how many of the batches trained after the resume hold the same
samples in the same order (by their targets, which carry no noise), how many the same inputs (noise
included), and the largest difference in the final weights. Resume points: mid-epoch (steps 5, 10, 20) and
at an epoch's end (step 16).

Run from the repo root (~1 min on 2 cores):
    .venv/bin/python bench/bench_lightning_resume.py
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integrations"))
import lightning_run as run  # noqa: E402


class Batches(L.Callback):
    """The bytes of each batch trained on, by global step."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, str]] = {}  # (the samples, by their noiseless targets; the inputs)

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.seen[trainer.global_step] = (_digest(y), _digest(x))


def _digest(t: Any) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


class Interrupted(Exception):
    pass


class Interrupt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise Interrupted


def fit(
    root: Path, how: str, workers: int, every: int = 5, stop: int | None = None
) -> tuple[Any, dict[int, tuple[str, str]]]:
    L.seed_everything(0, verbose=False)
    batches = Batches()
    callbacks: tuple[Any, ...] = (batches,) if stop is None else (batches, Interrupt(stop))
    trainer = run.trainer(root, exact=how == "exact", every=every, callbacks=callbacks)
    if how == "lightning":
        trainer.strategy.checkpoint_io = TorchCheckpointIO()
    model = run.Tiny()
    try:
        trainer.fit(model, run.loader(workers), ckpt_path="last")
    except Interrupted:
        pass
    return model, batches.seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stops", type=int, nargs="+", default=[6, 11, 17, 21])  # the batch after a checkpoint
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    labels = {"lightning": "Lightning", "trainstate": "+ TrainstateCheckpointIO", "exact": "+ ExactResume"}
    print(
        "| workers | resumed from step | resume | batches after it: same samples | same inputs (noise too) "
        "| max abs weight diff |"
    )
    print("|---:|---:|---|---:|---:|---:|")
    for workers in (0, 2):
        reference, ref_batches = fit(tmp / f"ref{workers}", "exact", workers)
        ref = reference.state_dict()
        for stop in args.stops:
            every = 8 if stop == 17 else 5  # step 16 ends an epoch (8 steps each); the others are mid-epoch
            saved = (stop - 1) // every * every
            for how in labels:
                root = tmp / f"{how}{workers}-{stop}"
                fit(root, how, workers, every, stop)
                model, seen = fit(root, how, workers, every)
                after = [s for s in seen if s >= saved]
                samples = sum(seen[s][0] == ref_batches[s][0] for s in after)
                inputs = sum(seen[s][1] == ref_batches[s][1] for s in after)
                diff = max((model.state_dict()[k] - v).abs().max().item() for k, v in ref.items())
                print(
                    f"| {workers} | {saved} | {labels[how]} | {samples}/{len(after)} | {inputs}/{len(after)} "
                    f"| {diff:.3g} |",
                    flush=True,
                )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
