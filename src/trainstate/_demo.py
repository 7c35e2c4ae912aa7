"""``trainstate demo``: train, get killed, resume in a fresh process, and prove the result is exact.

A small MLP learns scikit-learn's bundled digits (nothing is downloaded). Three processes run the same
training program with a CheckpointManager (async saves, retention by count, step and best val_loss):

1. a reference run that is never interrupted;
2. a run that SIGKILLs itself at a random step;
3. a fresh process that resumes that run from its latest checkpoint and finishes it.

The final weights and optimizer state of runs 1 and 3 are compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainstate._optional import missing, optional

DESCRIPTION = "train, get killed, resume in a fresh process, and prove the result is exact"  # -OO drops __doc__
STEPS = 120
EVERY = 10


def _train(workdir: Path, steps: int, kill_at: int) -> None:
    """One training process (run by the demo in a subprocess)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import trainstate
    from trainstate._data import ResumableSampler

    data, target = _digits()
    x, y = torch.from_numpy(data), torch.from_numpy(target)
    train_ds, val = TensorDataset(x[:1500], y[:1500]), (x[1500:], y[1500:])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(128, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    sampler = ResumableSampler(train_ds, seed=1)
    loader = sampler.attach(DataLoader(train_ds, batch_size=32, sampler=sampler, num_workers=2))
    state = {"model": model, "optim": opt, "sched": sched, "sampler": sampler, "rng": trainstate.RNGState()}

    mgr = trainstate.CheckpointManager(
        workdir / "checkpoints",
        every_steps=EVERY,
        keep_last=2,
        keep_every_steps=50,
        keep_best=("val_loss", "min", 1),
        async_save=True,
    )
    start = mgr.restore_latest(state) or 0
    step, micro = start, 0
    while step < steps:
        for xb, yb in loader:
            model.train()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            (loss / 2).backward()  # type: ignore[no-untyped-call]  # accumulate over 2 micro-batches
            micro += 1
            if micro % 2:
                continue
            opt.step()
            sched.step()
            opt.zero_grad()
            metrics = None
            if step % EVERY == 0:
                model.eval()
                with torch.no_grad():
                    metrics = {"val_loss": float(torch.nn.functional.cross_entropy(model(val[0]), val[1]))}
            mgr.save(step, state, metrics=metrics)
            if step == kill_at:
                mgr.wait()  # let the in-flight save land, as a real crash might or might not
                os.kill(os.getpid(), signal.SIGKILL)
            step += 1
            if step >= steps:
                break
    mgr.close()
    model.eval()
    with torch.no_grad():
        accuracy = float((model(val[0]).argmax(1) == val[1]).float().mean())
    plan = mgr.last_retention
    summary = {
        "start": start,
        "accuracy": accuracy,
        "history": [[r.step, r.blocking_seconds, r.write_seconds + r.commit_seconds, r.nbytes] for r in mgr.history()],
        "kept": {c.name: plan.keep.get(c.name, []) if plan else [] for c in mgr.list()},
    }
    trainstate.save(workdir / "final", {"model": model, "optim": opt}, overwrite=True)
    (workdir / "summary.json").write_text(json.dumps(summary))


def _check_dependencies() -> None:
    """Fail before any training process starts when torch or scikit-learn's digits are missing."""
    with optional("torch", extra="demo", needed_for="trainstate demo"):
        import torch  # noqa: F401
    _digits_file()


def _digits_file() -> Path:
    """scikit-learn's bundled digits data file, found without importing sklearn (which is slow)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = (
        Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
        if spec is not None and spec.submodule_search_locations
        else None
    )
    if path is None or not path.is_file():
        raise missing("scikit-learn", extra="demo", needed_for="trainstate demo (for its digits data set)")
    return path


def _digits() -> tuple[Any, Any]:
    """scikit-learn's bundled digits (1797 8x8 images), read from its data file."""
    import numpy as np

    raw = np.loadtxt(_digits_file(), delimiter=",", dtype=np.float32)
    return raw[:, :-1] / 16.0, raw[:, -1].astype(np.int64)


def _spawn(workdir: Path, steps: int, kill_at: int = -1) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "trainstate",
        "demo",
        "--worker",
        str(workdir),
        "--steps",
        str(steps),
        "--kill-at",
        str(kill_at),
    ]
    return subprocess.run(cmd, capture_output=True, text=True)


def run(workdir: Path | None = None, steps: int = STEPS, seed: int | None = None) -> bool:
    """The demo; returns whether the resumed run ended bit-identical to the uninterrupted one."""
    import trainstate

    t0 = time.perf_counter()
    root = Path(workdir or tempfile.mkdtemp(prefix="trainstate-demo-"))
    kill_at = random.Random(seed).randrange(EVERY + 5, steps - 10)
    print(f"trainstate demo: {steps} optimizer steps of an MLP on scikit-learn digits, in {root}")
    ref = _spawn(root / "reference", steps)
    _check(ref, "reference run")
    print(f"  1. reference run, never interrupted ........ done ({time.perf_counter() - t0:.1f}s)")
    killed = _spawn(root / "interrupted", steps, kill_at)
    if killed.returncode != -signal.SIGKILL:
        _check(killed, "interrupted run")
    print(f"  2. interrupted run, SIGKILLed at step {kill_at} .. killed ({time.perf_counter() - t0:.1f}s)")
    resumed = _spawn(root / "interrupted", steps)
    _check(resumed, "resumed run")
    summary = json.loads((root / "interrupted" / "summary.json").read_text())
    print(f"  3. fresh process resumed at step {summary['start']} ....... done ({time.perf_counter() - t0:.1f}s)")

    a = trainstate.load(root / "reference" / "final")
    b = trainstate.load(root / "interrupted" / "final")
    identical = _same(a, b)
    ref_summary = json.loads((root / "reference" / "summary.json").read_text())
    _print_report(steps, kill_at, summary, ref_summary, identical, time.perf_counter() - t0)
    return identical


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        raise RuntimeError(f"the demo's {what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _same(a: Any, b: Any) -> bool:
    import numpy as np

    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return bool(type(a) is type(b) and a == b)


def _print_report(
    steps: int, kill_at: int, run: dict[str, Any], ref: dict[str, Any], identical: bool, seconds: float
) -> None:
    hist = run["history"] + ref["history"]
    blocking = [h[1] * 1e3 for h in hist]
    background = [h[2] * 1e3 for h in hist]
    rows = [
        ("optimizer steps", f"{steps} (killed at {kill_at}, resumed at {run['start']})"),
        ("saves (resumed process)", str(len(run["history"]))),
        ("save blocked training, median", f"{statistics.median(blocking):.1f} ms"),
        ("save in the background, median", f"{statistics.median(background):.1f} ms"),
        ("validation accuracy", f"{run['accuracy']:.3f} (reference {ref['accuracy']:.3f})"),
        ("final weights + optimizer", "BIT-IDENTICAL to the uninterrupted run" if identical else "DIFFERENT"),
        ("demo wall time", f"{seconds:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print("\n  checkpoints kept, and why:")
    for name, reasons in sorted(run["kept"].items()):
        print(f"    {name}  {', '.join(reasons)}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="trainstate demo", description=DESCRIPTION)
    ap.add_argument("--dir", type=Path, help="where to put the runs (default: a new temporary directory)")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--seed", type=int, help="seed for the kill step (default: random)")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _train(args.worker, args.steps, args.kill_at)
        return 0
    _check_dependencies()
    return 0 if run(args.dir, args.steps, args.seed) else 1
