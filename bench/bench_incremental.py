"""Incremental checkpoints: a LoRA-style fine-tune saved every N steps, incremental beside full, in one run.

State: a frozen GPT-2-shaped base (bench_core.GPT2, d=1024, 18 layers: 280M float32 parameters, 1.1 GB),
a rank-8 LoRA adapter on every block's attention (c_attn and c_proj: 0.9M parameters) and its AdamW state
(exp_avg, exp_avg_sq, step), held as {"base": base, "lora": lora, "optim": opt, "step": n}. Between saves
the adapter takes --steps AdamW steps on random gradients (the base gets none: frozen), so every save has
the same ~1.1 GB unchanged and ~11 MB changed.

For each mode -- CheckpointManager(dir, every_steps=1, keep_last=2, fsync=True) with incremental=False
(every save writes everything) and incremental=True (unchanged tensors refer to the run's pool) -- the
script saves --saves times, synchronously and then with async_save=True, and reports per save:

- bytes written (the save's own files and manifest; SaveRecord.nbytes),
- time per save: the wall time of save() for synchronous saves; for async ones the time save() blocks
  the loop and the background time (write + commit) after it, each the median over the saves after the
  first (the first incremental save writes the base; it is shown on its own),
- bytes on disk at the end (keep_last=2: two checkpoints kept),
- the time to load the newest checkpoint back (page cache warm), which reads the pool the same way.

Run from the repo root (about two minutes on 2 cores; needs ~4 GB of free disk under --dir):
    .venv/bin/python bench/bench_incremental.py
    .venv/bin/python bench/bench_incremental.py --quick          # a 25 MB base: smoke run
    .venv/bin/python bench/bench_incremental.py --dir /data/tmp --saves 8 --json incremental.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import trainstate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_core as core

GB, MB = 1e9, 1e6
BASE, QUICK = core.Shape(18, 50257, 1024, d=1024), core.Shape(2, 2000, 128, d=512)
RANK = 8


class LoRA(nn.Module):
    """Low-rank adapters for every block's c_attn (d -> 3d) and c_proj (d -> d)."""

    def __init__(self, n_layer: int, d: int) -> None:
        super().__init__()
        self.a = nn.ParameterList(nn.Parameter(torch.randn(d, RANK) * 0.01) for _ in range(2 * n_layer))
        self.b = nn.ParameterList(
            nn.Parameter(torch.zeros(RANK, 3 * d if i % 2 == 0 else d)) for i in range(2 * n_layer)
        )


def build(shape: core.Shape) -> dict[str, Any]:
    torch.manual_seed(0)
    base = core.GPT2(shape)
    base.requires_grad_(False)
    lora = LoRA(shape.n_layer, shape.d)
    return {"base": base, "lora": lora, "optim": torch.optim.AdamW(lora.parameters(), lr=1e-3), "step": 0}


def train(state: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        for p in state["lora"].parameters():
            p.grad = torch.randn_like(p) * 1e-3
        state["optim"].step()
        state["step"] += 1


def nbytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(state: dict[str, Any], root: Path, *, incremental: bool, async_save: bool, saves: int, steps: int) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    walls = []
    with trainstate.CheckpointManager(
        root, every_steps=1, keep_last=2, incremental=incremental, async_save=async_save, collective=False
    ) as mgr:
        for _ in range(saves):
            train(state, steps)
            start = time.perf_counter()
            mgr.save(state["step"], state)
            walls.append(time.perf_counter() - start)
        mgr.wait()
        history = mgr.history()
    target = build(QUICK if state["base"].wte.weight.shape[0] == QUICK.vocab else BASE)
    start = time.perf_counter()
    with trainstate.CheckpointManager(root, read_only=True, collective=False) as ro:
        ro.restore_latest(target)
    load = time.perf_counter() - start
    assert torch.equal(target["lora"].b[0], state["lora"].b[0]) and torch.equal(
        target["base"].wte.weight, state["base"].wte.weight
    )
    later = history[1:]
    out = {
        "first_save_s": walls[0],
        "first_written_bytes": history[0].nbytes,
        "written_bytes": statistics.median(r.nbytes for r in later),
        "save_s": statistics.median(walls[1:]),
        "background_s": statistics.median(r.write_seconds + r.commit_seconds for r in later) if async_save else 0.0,
        "on_disk_bytes": nbytes(root),
        "load_s": load,
    }
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps of the adapter between saves")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    shape = QUICK if args.quick else BASE
    state = build(shape)
    base_bytes = sum(t.nbytes for t in state["base"].state_dict().values()) - state["base"].wte.weight.nbytes
    lora_bytes = sum(p.nbytes for p in state["lora"].parameters())
    print(f"base {base_bytes / GB:.2f} GB frozen; adapter {lora_bytes / MB:.1f} MB + AdamW moments (x2)")
    root = Path(tempfile.mkdtemp(prefix="bench-incr-", dir=args.dir))
    results: dict[str, dict] = {}
    try:
        for async_save in (False, True):
            for incremental in (False, True):
                name = f"{'incremental' if incremental else 'full'}{' async' if async_save else ''}"
                results[name] = run(
                    state,
                    root / "run",
                    incremental=incremental,
                    async_save=async_save,
                    saves=args.saves,
                    steps=args.steps,
                )
                print(f"  {name}: done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(
        f"{'mode':<18} {'1st save':>9} {'1st wrote':>10} {'save':>8} {'background':>11} {'wrote':>9} "
        f"{'on disk':>8} {'load':>7}"
    )
    for name, r in results.items():
        print(
            f"{name:<18} {r['first_save_s']:>8.2f}s {r['first_written_bytes'] / GB:>8.2f}GB {r['save_s']:>7.3f}s "
            f"{r['background_s']:>10.3f}s {r['written_bytes'] / MB:>7.1f}MB {r['on_disk_bytes'] / GB:>6.2f}GB "
            f"{r['load_s']:>6.2f}s"
        )
    full, incr = results["full"], results["incremental"]
    print(
        f"\nincremental vs full (synchronous, after the first save): {full['written_bytes'] / incr['written_bytes']:.0f}x "
        f"fewer bytes written, {full['save_s'] / incr['save_s']:.1f}x faster per save"
    )
    if args.json:
        args.json.write_text(json.dumps({"shape": shape.__dict__, "saves": args.saves, "results": results}, indent=2))


if __name__ == "__main__":
    main()
