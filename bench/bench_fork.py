"""Fork benchmark: how long the async saves right after DataLoader workers fork block the training loop.

A training script typically resumes (which reserves the staging buffer), then starts its DataLoader, whose
workers fork() the process. A fork makes every private page of the parent copy-on-write shared with the
children, so unless the staging buffer is kept out of the children, the first save's copy into it faults
on, and copies, every page before writing it.

State: --mb MiB of float32 torch tensors (4 MiB each) in a dict. For every repeat, a fresh
CheckpointManager(dir, every_steps=1, async_save=True) is prepared (the reservation thread is joined), then:
- "no fork": three async saves, each waited for before the next (untimed);
- "after fork": a DataLoader(num_workers=--workers, persistent_workers=True) is started and one batch
  read, then the same three saves, the workers alive throughout.
Blocking is SaveRecord.blocking_seconds from history(); page faults are the process's minor faults during the
save() call (getrusage), which other load on the machine does not skew. Every number is the median of
--repeats.

Run from the repo root:
    .venv/bin/python bench/bench_fork.py                      # ~272 MB state, ~1 min on 2 cores
    .venv/bin/python bench/bench_fork.py --mb 64 --repeats 3  # smoke run
"""

from __future__ import annotations

import argparse
import itertools
import resource
import shutil
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import trainstate

SAVES = ("first save", "second save", "third save")


class Numbers(Dataset[torch.Tensor]):
    """A dataset whose workers do a little work, so forking them is all that matters."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


def build_state(mb: int) -> dict[str, Any]:
    per = 1 << 20  # float32 elements in 4 MB
    return {f"w{i}": torch.randn(per) for i in range(max(1, mb // 4))}


def prepared_manager(path: Path, state: dict[str, Any]) -> trainstate.CheckpointManager:
    mgr = trainstate.CheckpointManager(path, every_steps=1, keep_last=1, async_save=True)
    mgr.prepare(state)
    for t in threading.enumerate():  # wait for the reservation, as a loop that trains a while would
        if t.name == "trainstate-reserve":
            t.join()
    return mgr


def timed_saves(mgr: trainstate.CheckpointManager, state: dict[str, Any], steps: Any) -> list[tuple[float, int]]:
    """(blocking seconds, minor page faults) of each save."""
    out = []
    for _ in SAVES:
        for t in state.values():
            t.add_(1.0)  # the loop trains between saves (its own copy-on-write faults land here, untimed)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        mgr.save(next(steps), state)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        mgr.wait()
        rec = mgr.history()[-1]
        if not rec.background or rec.error:
            raise AssertionError(f"unexpected history record {rec}")
        out.append((rec.blocking_seconds, faults))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=260, help="state size in MiB (default 260: ~272 MB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", type=Path, help="parent for the checkpoints (default /tmp)")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="trainstate-fork-", dir=args.dir or "/tmp"))
    state, steps = build_state(args.mb), itertools.count()
    nbytes = sum(t.nbytes for t in state.values())
    rows: dict[str, list[list[tuple[float, int]]]] = {"no fork": [], "after fork": []}
    try:
        for i in range(args.repeats):
            for case in rows:
                path = root / f"{case.replace(' ', '-')}-{i}"
                with prepared_manager(path, state) as mgr:
                    if case == "no fork":
                        rows[case].append(timed_saves(mgr, state, steps))
                        continue
                    loader = DataLoader(Numbers(), batch_size=64, num_workers=args.workers, persistent_workers=True)
                    it = iter(loader)
                    next(it)  # the workers are forked and running
                    rows[case].append(timed_saves(mgr, state, steps))
                    del it, loader
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"# async save blocking after DataLoader workers fork ({nbytes / 1e6:.0f} MB state = "
        f"{nbytes // 4096} pages, {args.workers} persistent workers, median of {args.repeats})\n"
    )
    print("| case | " + " | ".join(f"{s}: ms (min–max) | faults" for s in SAVES) + " |")
    print("|---|" + "---:|---:|" * len(SAVES))
    for case, runs in rows.items():
        cells = []
        for j in range(len(SAVES)):
            ms = sorted(1e3 * r[j][0] for r in runs)
            cells += [
                f"{statistics.median(ms):.0f} ({ms[0]:.0f}–{ms[-1]:.0f})",
                f"{statistics.median(r[j][1] for r in runs):.0f}",
            ]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
