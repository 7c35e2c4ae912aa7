"""Bit flips: every single-bit flip of a small checkpoint's files (exhaustive), and random ones of a larger one.

Each flip is made in place in one file of a checkpoint on disk (tmpfs where there is one) and undone after. The
flipped checkpoint is then loaded into a live target filled with a sentinel. A flip is **detected** when the
load raises a CheckpointError and the target holds, in every tensor, either the sentinel or exactly the saved
values: no flipped byte reached it. A flip is **harmless** when the load succeeds and restores exactly the saved
state (a bit the format does not read: JSON whitespace outside the checksummed span, unused header padding).
Anything else (a load that succeeds with other values, a raw exception, a flipped value in the target) is a
failure.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import trainstate


@dataclass
class FlipResult:
    name: str
    flips: int = 0
    detected: int = 0
    harmless: int = 0
    failures: list[str] = field(default_factory=list)


def small_state() -> dict[str, Any]:
    """A checkpoint of a few tensors of several dtypes, and plain values."""
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((4, 6)).astype(np.float32),
        "b": np.arange(5, dtype=np.int64),
        "h": rng.standard_normal(8).astype(np.float16),
        "step": 3,
        "note": "small",
    }


def realistic_state(megabytes: float = 1.0, width: int = 128) -> dict[str, Any]:
    """A model-like state: layers of float32 weights and biases with their optimizer moments, a step."""
    rng = np.random.default_rng(11)
    n = max(1, int(megabytes * 1e6 / (3 * 4 * width * width)))
    state: dict[str, Any] = {"step": 1200}
    for i in range(n):
        state[f"layer{i}.weight"] = rng.standard_normal((width, width)).astype(np.float32)
        state[f"layer{i}.bias"] = rng.standard_normal(width).astype(np.float32)
        state[f"adam.{i}.m"] = rng.standard_normal((width, width)).astype(np.float32)
        state[f"adam.{i}.v"] = np.abs(rng.standard_normal((width, width))).astype(np.float32)
    return state


def _target(saved: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in saved.items():
        if isinstance(v, np.ndarray):
            out[k] = np.full_like(v, 77)  # a value no saved tensor holds throughout
        else:
            out[k] = v
    return out


def _judge(path: Path, saved: dict[str, Any], key: Any) -> str:
    """'detected', 'harmless', or a failure's description."""
    target = _target(saved)
    fresh = _target(saved)
    try:
        trainstate.load(path, target, key=key)
    except trainstate.CheckpointError:
        for k, v in saved.items():
            if isinstance(v, np.ndarray) and not (np.array_equal(target[k], fresh[k]) or np.array_equal(target[k], v)):
                return f"detected, but {k} holds flipped bytes"
        return "detected"
    except Exception as e:  # noqa: BLE001 - a raw exception is a failure
        return f"raw {type(e).__name__}: {e}"
    for k, v in saved.items():
        same = np.array_equal(target[k], v) if isinstance(v, np.ndarray) else target[k] == v
        if not same:
            return f"loaded with {k} changed"
    return "harmless"


def _flip(file: Path, bit: int) -> None:
    fd = os.open(file, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, bit // 8)
        os.pwrite(fd, bytes([byte[0] ^ (1 << (bit % 8))]), bit // 8)
    finally:
        os.close(fd)


def campaign(
    name: str,
    state: dict[str, Any],
    *,
    every: bool,
    count: int = 0,
    seed: int = 0,
    key: Any = None,
    compression: str | None = None,
) -> FlipResult:
    """Flip every bit of every file of ``state``'s checkpoint (``every``), or ``count`` random bits."""
    result = FlipResult(name)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="flips-", dir=base) as tmp:
        path = Path(tmp) / "ck"
        trainstate.save(path, state, fsync=False, key=key, compression=compression)
        files = sorted(p for p in path.iterdir() if p.is_file())
        bits = [(f, b) for f in files for b in range(f.stat().st_size * 8)] if every else []
        if not every:
            rng = random.Random(seed)
            sizes = [(f, f.stat().st_size * 8) for f in files]
            total = sum(s for _, s in sizes)
            for _ in range(count):
                at = rng.randrange(total)
                for f, s in sizes:
                    if at < s:
                        bits.append((f, at))
                        break
                    at -= s
        for file, bit in bits:
            _flip(file, bit)
            try:
                verdict = _judge(path, state, key)
            finally:
                _flip(file, bit)
            result.flips += 1
            if verdict == "detected":
                result.detected += 1
            elif verdict == "harmless":
                result.harmless += 1
            else:
                result.failures.append(f"{file.name} bit {bit}: {verdict}")
    return result


def main() -> int:
    """``python -m tools.crashstates.flips [--random N]``: every bit of a small checkpoint, plain and zstd +
    encrypted, then N random bits of a realistic one (default 1,000,000)."""
    import argparse
    import logging
    import time

    ap = argparse.ArgumentParser(prog="python -m tools.crashstates.flips")
    ap.add_argument(
        "--random", type=int, default=1_000_000, help="random flips of the model-like checkpoint (1,000,000)"
    )
    ap.add_argument("--seed", type=int, default=1, help="of the random flips (run several seeds in parallel)")
    ap.add_argument("--random-only", action="store_true", help="skip the every-bit runs")
    args = ap.parse_args()
    logging.getLogger("trainstate").setLevel(logging.CRITICAL)  # every flipped load warns
    key = "6b" * 32
    runs = [
        ("every bit, small checkpoint", dict(every=True)),
        ("every bit, small checkpoint, zstd + encryption", dict(every=True, key=key, compression="zstd")),
    ]
    print("| checkpoint | flips | detected | harmless | failures | seconds |")
    print("|---|---:|---:|---:|---:|---:|")
    failures = []
    for name, kw in [] if args.random_only else runs:
        start = time.perf_counter()
        r = campaign(name, small_state(), **kw)  # type: ignore[arg-type]
        print(
            f"| {name} | {r.flips} | {r.detected} | {r.harmless} | {len(r.failures)} | "
            f"{time.perf_counter() - start:.0f} |",
            flush=True,
        )
        failures += r.failures
    start = time.perf_counter()
    big = realistic_state()
    r = campaign("random bits, realistic", big, every=False, count=args.random, seed=args.seed)
    nbytes = sum(v.nbytes for v in big.values() if isinstance(v, np.ndarray))
    print(
        f"| {args.random:,} random bits, {len(big) - 1} tensors ({nbytes / 1e6:.1f} MB) | {r.flips} | "
        f"{r.detected} | {r.harmless} | {len(r.failures)} | {time.perf_counter() - start:.0f} |",
        flush=True,
    )
    failures += r.failures
    for f in failures[:50]:
        print("  ", f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
