"""Restore at the memory limit (issue 9, item 7): the targets, side by side in one run, as ratios.

Every row is timed in interleaved rounds (each round runs every method once, in turn), so a busy machine
slows all of them alike; the table shows medians, and the ratio column the median of the per-round
ratios with their range. Checksums are on everywhere trainstate has them.

1. warm in-place restore of the GPT-2-small training state (bench_core.py's, ~1.49 GB, 592 tensors):
   trainstate.load(path, state) vs safetensors load_file + copy_ into the same live tensors vs a two-thread
   memory copy of the same bytes (np.copyto from a copy of the state, split by bytes).
2. cold restore (page cache dropped before every run; needs root): trainstate.load vs a plain sequential
   read of the checkpoint's files (one thread, front to back, 16 MiB reads) and safetensors + copy_.
3. open + read one 768x3072 tensor (warm): trainstate.open + read vs safetensors.safe_open + get_tensor.
4. save of the training state with and without fsync: trainstate vs safetensors save_file.
5. 50,000 tiny tensors (4 floats each, in 500 groups): save (no fsync) and in-place load, trainstate vs
   safetensors save_file / load_file + copy_; the table gives microseconds per tensor.

Run from the repo root:
    .venv/bin/python bench/bench_restore.py              # full state, ~5 min on 2 busy cores
    .venv/bin/python bench/bench_restore.py --quick      # a small state and 5,000 tiny tensors
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
import bench_core as core  # noqa: E402

import trainstate  # noqa: E402

GB = 1e9


def rounds(
    methods: dict[str, Callable[[], Any]], n: int, before: Callable[[], Any] = lambda: None
) -> dict[str, list[float]]:
    """Seconds per method per round; methods run in turn within each round."""
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(n):
        for k, fn in methods.items():
            before()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def table(title: str, times: dict[str, list[float]], base: str, unit: str = "ms", per: float = 1.0) -> list[str]:
    scale = {"ms": 1e3, "us": 1e6}[unit] / per
    out = [f"### {title}", "", f"| method | median {unit} | range | {base} / method, per round: median [range] |"]
    out.append("|---|---:|---:|---|")
    for k, v in times.items():
        ratios = sorted(b / a for a, b in zip(v, times[base]))
        ratio = f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]"
        out.append(
            f"| {k} | {statistics.median(v) * scale:.2f} | {min(v) * scale:.2f}-{max(v) * scale:.2f} | {ratio} |"
        )
    return [*out, ""]


def ratio(times: dict[str, list[float]], num: str, den: str) -> tuple[float, float, float]:
    """Median and range of num/den over rounds: how many times faster ``den`` is."""
    r = sorted(a / b for a, b in zip(times[num], times[den]))
    return statistics.median(r), r[0], r[-1]


def memcpy_two_threads(state: core.State) -> Callable[[], None]:
    live = list(core.flat_tensors(state).values())
    copies = [t.detach().clone() for t in live]
    total, acc, cut = sum(t.nbytes for t in live), 0, len(live)
    for i, t in enumerate(live):
        acc += t.nbytes
        if acc >= total / 2:
            cut = i + 1
            break
    pool = ThreadPoolExecutor(2)

    def lane(a: int, b: int) -> None:
        for src, dst in zip(copies[a:b], live[a:b]):
            np.copyto(dst.detach().numpy(), src.numpy())

    def run() -> None:
        for f in [pool.submit(lane, 0, cut), pool.submit(lane, cut, len(live))]:
            f.result()

    return run


def sequential_read(path: Path) -> Callable[[], None]:
    buf = memoryview(bytearray(16 << 20))

    def run() -> None:
        for f in sorted(path.iterdir()):
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass

    return run


def tiny_state(n: int) -> dict[str, dict[str, torch.Tensor]]:
    return {f"g{g}": {f"t{i}": torch.full((4,), float(g * 100 + i)) for i in range(100)} for g in range(n // 100)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, help="parent for the checkpoints (default /tmp; not tmpfs)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small state, 5,000 tiny tensors")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trainstate-bench-restore-", dir=args.dir or "/tmp"))
    n = args.rounds
    lines = [f"# trainstate restore benchmark ({'quick' if args.quick else 'full'}, {n} interleaved rounds)", ""]
    misses: list[str] = []

    def target(text: str, ok: bool) -> None:
        misses.append(f"- {'PASS' if ok else 'MISS'}  {text}")

    try:
        state = core.build_state(core.SMALL if args.quick else core.FULL)
        flat = core.flat_tensors(state)
        nbytes = sum(t.nbytes for t in flat.values())
        load0 = os.getloadavg()[0]
        lines += [
            f"- machine: {os.cpu_count()} cores, torch {torch.__version__}, safetensors {safetensors.__version__}, "
            f"trainstate {trainstate.__version__}; state {len(flat)} tensors, {nbytes / GB:.3f} GB",
        ]
        ts, st = root / "ts", root / "st"
        trainstate.save(ts, state, fsync=False)
        core.save_safetensors(state, st, False)
        reference = core.fingerprint(state)

        # 1. warm in-place restore
        warm = {
            "trainstate.load": lambda: trainstate.load(ts, state),
            "safetensors+copy_": lambda: core.load_safetensors(state, st),
            "memcpy, 2 threads": memcpy_two_threads(state),
        }
        for k in ("trainstate.load", "safetensors+copy_"):
            for t in flat.values():
                t.detach().zero_()
            warm[k]()
            assert core.fingerprint(state) == reference, f"{k} did not restore the saved state"
        times = rounds(warm, n)
        lines += table(f"1. warm in-place restore, {nbytes / GB:.2f} GB", times, "trainstate.load")
        med, lo, hi = ratio(times, "safetensors+copy_", "trainstate.load")
        target(f"warm restore >= 1.3x faster than safetensors+copy_: {med:.2f}x [{lo:.2f}-{hi:.2f}]", med >= 1.3)
        med, lo, hi = ratio(times, "trainstate.load", "memcpy, 2 threads")
        target(f"warm restore within 3x of a two-thread memory copy: {med:.2f}x [{lo:.2f}-{hi:.2f}]", med <= 3)

        # 2. cold restore
        try:
            core.drop_caches()
            cold = {
                "trainstate.load": lambda: trainstate.load(ts, state),
                "sequential read of its files": sequential_read(ts),
                "safetensors+copy_": lambda: core.load_safetensors(state, st),
            }
            times = rounds(cold, max(3, n // 2), core.drop_caches)
            lines += table("2. cold restore (page cache dropped before each run)", times, "trainstate.load")
            med, lo, hi = ratio(times, "sequential read of its files", "trainstate.load")
            target(f"cold restore at least as fast as a sequential read: {med:.2f}x [{lo:.2f}-{hi:.2f}]", med >= 1)
        except OSError:
            lines += ["cold restore skipped: dropping the page cache needs root", ""]

        # 3. open + read one tensor
        opens = {
            "trainstate open+read": lambda: core.open_trainstate(ts),
            "safetensors safe_open+get_tensor": lambda: core.open_safetensors(st),
        }
        times = rounds(opens, max(15, n * 3))
        lines += table(
            "3. open + read one 768x3072 tensor (checksum verified by trainstate)", times, "trainstate open+read"
        )
        med, lo, hi = ratio(times, "trainstate open+read", "safetensors safe_open+get_tensor")
        target(f"open + read one tensor within 3x of safetensors: {med:.2f}x [{lo:.2f}-{hi:.2f}]", med <= 3)

        # 4. save, with and without fsync
        saved = root / "saved"

        def fresh() -> None:  # nothing to replace, and no dirty pages carried into the next save
            shutil.rmtree(saved, ignore_errors=True)
            os.sync()

        for fsync in (False, True):
            saves = {
                "trainstate.save": lambda f=fsync: trainstate.save(saved, state, fsync=f),
                "safetensors save_file": lambda f=fsync: core.save_safetensors(state, saved, f),
            }
            times = rounds(saves, max(3, n // 2), fresh)
            lines += table(f"4. save {nbytes / GB:.2f} GB, {'with' if fsync else 'no'} fsync", times, "trainstate.save")
            med, lo, hi = ratio(times, "safetensors save_file", "trainstate.save")
            target(
                f"save ({'fsync' if fsync else 'no fsync'}) >= safetensors: {med:.2f}x [{lo:.2f}-{hi:.2f}]", med >= 1
            )

        # 5. many tiny tensors
        count = 5_000 if args.quick else 50_000
        tiny = tiny_state(count)
        tiny_flat = {f"{g}.{k}": t for g, d in tiny.items() for k, t in d.items()}
        tts, tst = root / "tiny-ts", root / "tiny.safetensors"

        def st_load() -> None:
            loaded = load_file(tst)
            with torch.no_grad():
                for k, t in tiny_flat.items():
                    t.copy_(loaded[k])

        tiny_methods = {
            "trainstate.save": lambda: trainstate.save(tts, tiny, fsync=False),
            "safetensors save_file": lambda: save_file(tiny_flat, tst),
            "trainstate.load": lambda: trainstate.load(tts, tiny),
            "safetensors load_file+copy_": st_load,
        }

        def clear() -> None:
            shutil.rmtree(tts, ignore_errors=True)
            tst.unlink(missing_ok=True)
            os.sync()

        for fn in tiny_methods.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in tiny_methods}
        for _ in range(max(3, n // 2)):
            clear()
            for k, fn in tiny_methods.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        save_t = {k: times[k] for k in ("trainstate.save", "safetensors save_file")}
        load_t = {k: times[k] for k in ("trainstate.load", "safetensors load_file+copy_")}
        lines += table(f"5a. save {count:,} tiny tensors (us per tensor)", save_t, "trainstate.save", "us", count)
        lines += table(
            f"5b. in-place load of {count:,} tiny tensors (us per tensor)", load_t, "trainstate.load", "us", count
        )
        med, lo, hi = ratio(times, "trainstate.save", "safetensors save_file")
        target(f"tiny tensors: save within 2x of safetensors: {med:.2f}x [{lo:.2f}-{hi:.2f}]", med <= 2)
        med, lo, hi = ratio(times, "trainstate.load", "safetensors load_file+copy_")
        target(f"tiny tensors: load within 2x of safetensors: {med:.2f}x [{lo:.2f}-{hi:.2f}]", med <= 2)
        lines.insert(3, f"- 1-min load average at start / end: {load0:.2f} / {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join([*lines, "### targets", "", *misses]))


if __name__ == "__main__":
    main()
