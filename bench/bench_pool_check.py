"""What checking the shared pool costs an incremental save (trainstate._incremental.check).

State: a frozen base of --tensors float32 tensors of --mb MB each, and a small adapter that changes every
save, saved by CheckpointManager(dir, every_steps=1, incremental=True, keep_last=2) (fsync on). Reported,
as the median of --saves saves each:

- the time of save(), and of the pool check inside it, where the shared files were checked before and
  left alone (a stat per file),
- the same where their bytes are read back: the first save after a restart (nothing known yet),
- save() with the check turned off, for the difference.

Run from the repo root (page cache warm; about a minute on 2 cores for the default 512 MB):
    .venv/bin/python bench/bench_pool_check.py
    .venv/bin/python bench/bench_pool_check.py --tensors 16 --mb 4 --saves 3   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np

import trainstate
from trainstate._format.manifest import Chunk
from trainstate._incremental import check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=256)
    parser.add_argument("--mb", type=float, default=2.0)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    n = int(args.mb * (1 << 20) // 4)
    rng = np.random.default_rng(0)
    base = {f"layer{i:03d}": rng.standard_normal(n, dtype=np.float32) for i in range(args.tensors)}
    total = sum(t.nbytes for t in base.values())

    spent: list[float] = []
    real = check.PoolCheck.damaged

    def timed(self: check.PoolCheck, shared: Iterable[Chunk], sizes: Mapping[str, int], threads: int) -> set[str]:
        start = time.perf_counter()
        try:
            return real(self, shared, sizes, threads)
        finally:
            spent.append(time.perf_counter() - start)

    def off(self: check.PoolCheck, shared: Iterable[Chunk], sizes: Mapping[str, int], threads: int) -> set[str]:
        return set()

    def state(step: int) -> dict[str, object]:
        return {"base": base, "adapter": np.full(4096, step, np.float32)}

    def run(root: Path, saves: int, setup: Callable[[trainstate.CheckpointManager, int], None]) -> list[float]:
        times = []
        with trainstate.CheckpointManager(root, every_steps=1, incremental=True, keep_last=2) as mgr:
            for i in range(saves):
                setup(mgr, i)
                start = time.perf_counter()
                mgr.save(next(steps), state(i))
                times.append(time.perf_counter() - start)
        return times

    steps = iter(range(1, 10**6))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        check.PoolCheck.damaged = timed  # type: ignore[method-assign]
        run(root, 2, lambda mgr, i: None)  # writes the base, then checks it once (just written: read back)
        time.sleep(check.RACY_SECONDS + 0.1)
        run(root, 1, lambda mgr, i: None)  # a restart: read back, now vouched for by time and size
        time.sleep(check.RACY_SECONDS + 0.1)
        spent.clear()
        trusted = run(root, args.saves, lambda mgr, i: None)[1:]  # the first of a process reads back
        trusted_check = spent[1:]
        restarted, restarted_check = [], []
        for _ in range(args.saves):
            spent.clear()
            restarted += run(root, 1, lambda mgr, i: None)
            restarted_check += spent
        check.PoolCheck.damaged = off  # type: ignore[method-assign]
        unchecked = run(root, args.saves + 1, lambda mgr, i: None)[1:]
        check.PoolCheck.damaged = real  # type: ignore[method-assign]

    med = statistics.median
    print(f"base: {args.tensors} tensors, {total / 1e6:.0f} MB shared by every save; median of {args.saves} saves")
    print(f"{'case':<44}{'save()':>10}{'check':>10}")
    print(f"{'check off':<44}{med(unchecked):>9.3f}s{'-':>10}")
    print(f"{'files checked before, unchanged (stat only)':<44}{med(trusted):>9.3f}s{med(trusted_check):>9.4f}s")
    print(f"{'first save after a restart (read back)':<44}{med(restarted):>9.3f}s{med(restarted_check):>9.3f}s")


if __name__ == "__main__":
    main()
