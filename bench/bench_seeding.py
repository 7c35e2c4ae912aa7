"""Per-sample seeding overhead: what seeding each sample from (seed, epoch, index) adds to data loading.

1. The pieces, in microseconds per sample: the seed (two splitmix64 rounds) and the SeededIndex that
   carries it; seeding random + np.random + torch's CPU generator; pickling a batch of 32 indices through
   the index queue (SeededIndex against plain int); with num_workers=0, saving and restoring the training
   loop's three generators once per batch (shown per sample for batches of 32).
2. End to end: one epoch of a DataLoader whose dataset does nothing but return its index (so the overhead
   is not hidden by real work), batch 32, trainstate.ResumableSampler attached (seeding on) against the
   same permutation as a plain list sampler (off), for num_workers 0 and 2. Median of --repeats epochs.

Run from the repo root:
    .venv/bin/python bench/bench_seeding.py            # ~15 s on 2 cores
    .venv/bin/python bench/bench_seeding.py --n 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time
import timeit
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import trainstate
from trainstate import _seeding as seeding


class Indices(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def per_call_us(fn: Any, number: int = 2000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def pieces() -> list[tuple[str, float]]:
    key = seeding.epoch_seed(0, 3)
    batch_int = list(range(1000, 1032))
    batch_seeded = [seeding.SeededIndex(i, seeding.sample_seed(key, i)) for i in batch_int]
    gen = torch.default_generator

    def save_restore() -> None:
        saved = random.getstate(), np.random.get_state(), gen.get_state()
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        gen.set_state(saved[2])

    return [
        ("seed + SeededIndex", per_call_us(lambda: seeding.SeededIndex(7, seeding.sample_seed(key, 7)))),
        ("seed random+numpy+torch", per_call_us(lambda: seeding.seed_globals(0x123456789ABCDEF))),
        ("pickle round trip, int", per_call_us(lambda: pickle.loads(pickle.dumps(batch_int)), 500) / 32),
        ("pickle round trip, SeededIndex", per_call_us(lambda: pickle.loads(pickle.dumps(batch_seeded)), 500) / 32),
        ("0 workers: save+restore / 32", per_call_us(save_restore, 200) / 32),
    ]


def epoch_us_per_sample(n: int, workers: int, seeded: bool, repeats: int) -> float:
    ds = Indices(n)
    sampler = trainstate.ResumableSampler(ds, seed=0)
    if seeded:
        loader = sampler.attach(DataLoader(ds, batch_size=32, sampler=sampler, num_workers=workers))
    else:
        loader = DataLoader(ds, batch_size=32, sampler=sampler._order(), num_workers=workers)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _batch in loader:
            pass
        times.append(time.perf_counter() - t)
    return statistics.median(times) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("piece                               us/sample")
    for name, us in pieces():
        print(f"{name:34s} {us:9.2f}")
    print(f"\nepoch of {args.n} trivial samples, batch 32   off us/sample   on us/sample   added")
    for workers in (0, 2):
        off = epoch_us_per_sample(args.n, workers, False, args.repeats)
        on = epoch_us_per_sample(args.n, workers, True, args.repeats)
        print(f"num_workers={workers}                             {off:8.2f}       {on:8.2f}   {on - off:+7.2f}")


if __name__ == "__main__":
    main()
