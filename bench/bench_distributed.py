"""Many ranks (issue 10). ``--simulate``: the global save plan for R ranks x T tensors, no processes.

Each rank holds one row-shard of every tensor (FSDP) — and, in the second row, every tensor whole
(DDP: each box replicated on every rank). The table gives the planner's seconds on rank 0 (what a save
waits for between the ranks' plans and their writes) and the bytes the plans take in memory.

    .venv/bin/python bench/bench_distributed.py --simulate --ranks 1024 --tensors 1000
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from trainstate._distributed.plan import RankPlan, assign


def sharded(ranks: int, tensors: int) -> list[RankPlan]:
    rows = 4 * ranks
    names = [f"model.layers.{t}.weight" for t in range(tensors)]
    headers = [("BF16", "torch", (rows, 4096))] * tensors
    plans = []
    for r in range(ranks):
        boxes = np.zeros((tensors, 6), np.int64)
        boxes[:, 0], boxes[:, 1], boxes[:, 3], boxes[:, 4], boxes[:, 5] = 2, 4 * r, 4, 4096, 4 * 4096 * 2
        plans.append(RankPlan(names, headers, boxes))
    return plans


def replicated(ranks: int, tensors: int) -> list[RankPlan]:
    names = [f"model.layers.{t}.weight" for t in range(tensors)]
    headers = [("F32", "torch", (1024, 1024))] * tensors
    boxes = np.zeros((tensors, 6), np.int64)
    boxes[:, 0], boxes[:, 3], boxes[:, 4], boxes[:, 5] = 2, 1024, 1024, 1024 * 1024 * 4
    return [RankPlan(names, headers, boxes) for _ in range(ranks)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--simulate", action="store_true", required=True)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"| layout ({args.ranks} ranks x {args.tensors} tensors) | boxes | plan seconds (median of {args.repeats}) |")
    print("|---|---:|---:|")
    for label, build in (
        ("FSDP: one shard of each tensor per rank", sharded),
        ("DDP: every tensor on every rank", replicated),
    ):
        plans = build(args.ranks, args.tensors)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            shares = assign(plans)
            times.append(time.perf_counter() - start)
        written = sum(map(len, shares))
        print(
            f"| {label} | {args.ranks * args.tensors:,} ({written:,} written) | {sorted(times)[len(times) // 2]:.2f} |"
        )


if __name__ == "__main__":
    main()
