"""The local tier: training throughput with a local checkpoint every step, and the time to recover per tier.

1. Throughput. A training loop over a ~100 MB model (float32 MLP, SGD) whose steps take ~200 ms, run with:
   no checkpointing; a local tier every step (``LocalTier`` on /dev/shm, async; durable saves far apart), with
   ``copy_behind=True``, and every 5 steps; the durable tier every step (async, to the local disk); and
   ``torch.save`` every 10 steps (what a user would otherwise write). Steps per second, as a ratio to the loop without checkpointing, median of interleaved
   rounds.
2. Recovery. Restoring the newest checkpoint into the live model (``restore_latest``) from the local tier on
   tmpfs, from the durable tier on the local disk, and from the durable tier on S3 (a moto server on
   127.0.0.1 reached through s3fs: HTTP on loopback, not a real object store); ``torch.load`` of the same state
   from tmpfs beside them. Median of repeats; the page cache warm.

Run from the repo root:
    .venv/bin/python bench/bench_local_tier.py            # ~3 min on 2 cores
    .venv/bin/python bench/bench_local_tier.py --quick    # smaller state, fewer steps: a smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import trainstate
from trainstate._storage.fsspec import FsspecStorage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.s3_server import MotoServer  # noqa: E402

BUCKET = "trainstate-tier"


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def model_of(megabytes: float, width: int = 1024) -> torch.nn.Module:
    layers = max(1, round(megabytes * 1e6 / (4 * width * width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def calibrated_batch(model: torch.nn.Module, opt: torch.optim.Optimizer, step_s: float) -> int:
    """A batch size whose training step takes about ``step_s`` seconds here."""
    batch = 16
    for _ in range(6):
        x = torch.randn(batch, model[0].in_features)
        t = time.perf_counter()
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        took = (time.perf_counter() - t) / 2
        batch = max(1, int(batch * step_s / took))
    return batch


def loop(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int, steps: int, on_step: Callable[[int], None]
) -> float:
    """Seconds for ``steps`` training steps, ``on_step(step)`` after each."""
    x = torch.randn(batch, model[0].in_features)
    t = time.perf_counter()
    for step in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        on_step(step)
    return time.perf_counter() - t


def throughput(args: argparse.Namespace, shm: Path, disk: Path) -> None:
    torch.manual_seed(0)
    model = model_of(args.mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    state = {"model": model, "optim": opt}
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    batch = calibrated_batch(model, opt, args.step_s)
    base = loop(model, opt, batch, 3, lambda s: None) / 3
    log(f"state {nbytes / 1e6:.0f} MB, batch {batch}, ~{base * 1e3:.0f} ms per step")

    def variant(name: str) -> Callable[[], float]:
        def run() -> float:
            root = Path(tempfile.mkdtemp(dir=disk))
            local = Path(tempfile.mkdtemp(dir=shm))
            try:
                if name == "none":
                    return loop(model, opt, batch, args.steps, lambda s: None)
                if name == "torch.save every 10 steps":

                    def save(step: int) -> None:
                        if step % 10 == 0:
                            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, root / "ckpt.pt")

                    return loop(model, opt, batch, args.steps, save)
                if name.startswith("local tier"):
                    every = 5 if "5 steps" in name else 1
                    tier = trainstate.LocalTier(local / "run", every_steps=every, copy_behind="copy_behind" in name)
                    mgr = trainstate.CheckpointManager(root / "ckpt", every_steps=10**6, local=tier, async_save=True)
                else:  # the durable tier every step
                    mgr = trainstate.CheckpointManager(root / "ckpt", every_steps=1, keep_last=2, async_save=True)
                mgr.save(0, state)  # the step-0 save (durable and staging buffers) outside the timing
                mgr.wait()
                took = loop(model, opt, batch, args.steps, lambda s: mgr.save(s + 1, state))
                mgr.close()
                return took
            finally:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(local, ignore_errors=True)

        return run

    names = [
        "none",
        "local tier every step",
        "local tier every step, copy_behind",
        "local tier every 5 steps",
        "durable tier every step (disk)",
        "torch.save every 10 steps",
    ]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names:
            times[n].append(variant(n)())
            log(f"round {r + 1}: {n}: {args.steps / times[n][-1]:.2f} steps/s")
    ref = statistics.median(times["none"])
    print(
        f"\n### Training throughput, {nbytes / 1e6:.0f} MB state, ~{base * 1e3:.0f} ms steps, {args.steps} steps, "
        f"median of {args.rounds} interleaved rounds\n"
    )
    print("| checkpointing | steps/s | vs none |")
    print("|---|---:|---:|")
    for n in names:
        med = statistics.median(times[n])
        print(f"| {n} | {args.steps / med:.2f} | {ref / med:.3f} |")


def recovery(args: argparse.Namespace, shm: Path, disk: Path) -> None:
    torch.manual_seed(0)
    model = model_of(args.mb)
    state = {"model": model}
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    rows: dict[str, list[float]] = {}
    with MotoServer() as server:
        server.create_bucket(BUCKET)
        s3 = FsspecStorage(server.filesystem(skip_instance_cache=True))
        local_root = Path(tempfile.mkdtemp(dir=shm))
        disk_root = Path(tempfile.mkdtemp(dir=disk))
        tier = trainstate.LocalTier(local_root / "run", every_steps=1)
        with trainstate.CheckpointManager(disk_root / "ckpt", every_steps=10, local=tier) as mgr:
            mgr.save(0, state)
            mgr.save(1, state)  # the local tier's
        with trainstate.CheckpointManager(f"s3://{BUCKET}/ckpt", every_steps=1, storage=s3) as mgr:
            mgr.save(0, state)
        torch.save(model.state_dict(), local_root / "model.pt")
        target = {"model": model_of(args.mb)}

        def from_local() -> None:
            with trainstate.CheckpointManager(disk_root / "ckpt", local=tier) as mgr:
                assert mgr.restore_latest(target) == 2

        def from_disk() -> None:
            with trainstate.CheckpointManager(disk_root / "ckpt") as mgr:
                assert mgr.restore_latest(target) == 1

        def from_s3() -> None:
            with trainstate.CheckpointManager(f"s3://{BUCKET}/ckpt", storage=s3) as mgr:
                assert mgr.restore_latest(target) == 1

        def torch_load() -> None:
            target["model"].load_state_dict(torch.load(local_root / "model.pt"))

        cases = {
            "local tier (tmpfs)": from_local,
            "durable tier, local disk": from_disk,
            "durable tier, S3 (moto on loopback)": from_s3,
            "torch.load from tmpfs (reference)": torch_load,
        }
        for r in range(args.repeats):
            for name, run in cases.items():
                t = time.perf_counter()
                run()
                rows.setdefault(name, []).append(time.perf_counter() - t)
            log(f"recovery round {r + 1} done")
        shutil.rmtree(local_root, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)
    local = statistics.median(rows["local tier (tmpfs)"])
    print(f"\n### Recovery: restore_latest of a {nbytes / 1e6:.0f} MB state, median of {args.repeats}\n")
    print("| from | seconds | GB/s | vs local tier |")
    print("|---|---:|---:|---:|")
    for name, times in rows.items():
        med = statistics.median(times)
        print(f"| {name} | {med:.3f} | {nbytes / med / 1e9:.2f} | {med / local:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--step-s", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.steps, args.rounds, args.repeats = 10.0, 8, 1, 1
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # a core left for the background writers
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    disk = Path(tempfile.gettempdir())
    print(
        f"# Local tier benchmark: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, trainstate {trainstate.__version__}"
    )
    throughput(args, shm, disk)
    recovery(args, shm, disk)


if __name__ == "__main__":
    main()
