"""Remote benchmark: save and restore throughput to S3 (a local moto server) beside the local disk.

State: float32 NumPy arrays, by default 20 of 1M elements and 2 of 15M (~200 MB, GB = 1e9 B). Every number
is the median of --repeats runs. The S3 endpoint is a moto server this script starts on 127.0.0.1 and
stops at the end, reached through s3fs over HTTP, so the S3 numbers measure trainstate + s3fs + HTTP +
moto on this machine, not a real object store; the raw s3fs rows (one object of the same bytes, written
and read whole) show what the server allows without trainstate.

1. save: trainstate._save (fsync on for the local disk); each checkpoint is deleted before the next run.
2. restore in place (trainstate.load(path, target)) into preallocated arrays; the local disk is read with
   a warm page cache.
3. for S3: how trainstate cut the state into files, how many uploads and ranged GETs ran at once
   (measured by wrapping the storage), and the part size.

Run from the repo root:
    .venv/bin/python bench/bench_remote.py                    # ~200 MB state, ~1-2 min on 2 cores
    .venv/bin/python bench/bench_remote.py --quick            # ~20 MB, smoke run
    .venv/bin/python bench/bench_remote.py --out bench/out/remote.txt
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

import trainstate
from trainstate._storage.fsspec import FsspecStorage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.s3_server import AWS_ISOLATION, MotoServer  # noqa: E402

MB = 1e6
BUCKET = "trainstate-bench"
# boto must never look anywhere real for credentials or regions, and 127.0.0.1 must bypass any proxy.


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


# -- the S3 server ------------------------------------------------------------------------------------


class Moto(MotoServer):
    """The shared server, with this benchmark's bucket."""

    def __enter__(self) -> Moto:
        super().__enter__()
        self.create_bucket(BUCKET)
        return self

    def filesystem(self, **kwargs: Any) -> Any:
        return super().filesystem(skip_instance_cache=True, **kwargs)


class Observed(FsspecStorage):
    """FsspecStorage that records how many writes and ranged reads were in flight at once."""

    def __init__(self, fs: Any) -> None:
        super().__init__(fs)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.active = {"write": 0, "read": 0}
        self.peak = {"write": 0, "read": 0}
        self.count = {"write": 0, "read": 0}

    def _track(self, kind: str, op: Callable[[], int]) -> int:
        with self._lock:
            self.active[kind] += 1
            self.count[kind] += 1
            self.peak[kind] = max(self.peak[kind], self.active[kind])
        try:
            return op()
        finally:
            with self._lock:
                self.active[kind] -= 1

    def write(self, path: str, views: Iterable[memoryview], *, fsync: bool) -> int:
        return self._track("write", lambda: super(Observed, self).write(path, views, fsync=fsync))

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        return self._track("read", lambda: super(Observed, self).read_into(path, offset, out))


# -- the runs ----------------------------------------------------------------------------------------


def make_state(n_small: int, n_large: int, small: int, large: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    layers = {f"layer{i:02d}": rng.standard_normal(small, dtype=np.float32) for i in range(n_small)}
    big = {f"embed{i}": rng.standard_normal(large, dtype=np.float32) for i in range(n_large)}
    return {"model": {**big, **layers}, "step": 1}


def zeros_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    return np.zeros_like(state) if isinstance(state, np.ndarray) else state


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else a == b


def timed(fn: Callable[[], Any], before: Callable[[], Any] | None = None, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.update(AWS_ISOLATION)
    sizes = (2, 2, 1 << 20, 2 << 20) if args.quick else (args.small, args.large, 1 << 20, args.large_elements)
    state = make_state(*sizes)
    arrays = [v for v in state["model"].values()]
    nbytes = sum(a.nbytes for a in arrays)
    log(f"state: {len(arrays)} tensors, {nbytes / MB:.0f} MB")
    target = zeros_like(state)
    r: dict[str, Any] = {
        "bytes": nbytes,
        "tensors": len(arrays),
        "load": [os.getloadavg()[0]],
        "save": {},
        "restore": {},
    }
    root = Path(tempfile.mkdtemp(prefix="trainstate-bench-remote-", dir=args.dir))
    r["machine"] = machine(root)
    try:
        local = str(root / "ck")
        log("local disk: save")
        r["save"]["local disk (fsync)"] = timed(
            lambda: trainstate.save(local, state), lambda: shutil.rmtree(local, ignore_errors=True), args.repeats
        )
        log("local disk: restore")
        r["restore"]["local disk (warm cache)"] = timed(lambda: trainstate.load(local, target), None, args.repeats)
        assert same(state, target), "local restore differs"
        shutil.rmtree(local)

        with Moto() as server:
            fs = server.filesystem()
            storage = Observed(fs)
            url = f"s3://{BUCKET}/bench/ck"
            log(f"S3 at {server.endpoint}: save")
            r["save"]["S3 (moto)"] = timed(
                lambda: trainstate.save(url, state, storage=storage),
                lambda: (storage.delete(storage.strip(url)), storage.reset()),
                args.repeats,
            )
            r["s3"] = {
                "writes": storage.count["write"],
                "write_peak": storage.peak["write"],
                "part_size": storage.part_size,
                "target_file_bytes": storage.target_file_bytes,
            }
            with trainstate.open(url, storage=storage) as ck:
                r["s3"]["files"] = [f.size for f in ck.manifest.files]
            log("S3: restore")
            target = zeros_like(state)
            r["restore"]["S3 (moto)"] = timed(
                lambda: trainstate.load(url, target, storage=storage), storage.reset, args.repeats
            )
            assert same(state, target), "S3 restore differs"
            r["s3"].update(reads=storage.count["read"], read_peak=storage.peak["read"])
            storage.delete(storage.strip(url))

            blob = np.concatenate(arrays).view(np.uint8)  # the same bytes as one object, one stream
            key = f"{BUCKET}/bench/raw-{uuid.uuid4().hex[:8]}"
            log("S3: raw s3fs, one object")
            r["save"]["raw s3fs write, one object"] = timed(
                lambda: _put(fs, key, blob), lambda: _rm(fs, key), args.repeats
            )
            r["restore"]["raw s3fs read, one object"] = timed(lambda: fs.cat_file(key), None, args.repeats)
            _rm(fs, key)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r["load"].append(os.getloadavg()[0])
    return r


def _put(fs: Any, key: str, blob: np.ndarray) -> None:
    with fs.open(key, "wb", block_size=16 << 20) as f:
        f.write(memoryview(blob))


def _rm(fs: Any, key: str) -> None:
    if fs.exists(key):
        fs.rm(key)


# -- report ------------------------------------------------------------------------------------------


def machine(root: Path) -> dict[str, Any]:
    cpu = [
        x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name")
    ]
    ram = [int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")]
    real, mount = os.path.realpath(root), ("?", "?", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        if (real + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(mount[2]):
            mount = (fstype, dev, mnt)
    versions = {name: _version(name) for name in ("numpy", "fsspec", "s3fs", "aiobotocore", "moto")}
    return {
        "cpu": cpu[0] if cpu else platform.processor(),
        "cores": os.cpu_count(),
        "ram_gib": round(ram[0] / 2**20, 1) if ram else "?",
        "kernel": platform.release(),
        "dir": str(root.parent),
        "filesystem": f"{mount[0]} ({mount[1]} on {mount[2]})",
        "python": platform.python_version(),
        "versions": versions,
        "trainstate": trainstate.__version__,
    }


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def table(title: str, rows: dict[str, float], nbytes: float) -> list[str]:
    base = next(s for name, s in rows.items() if name.startswith("local"))
    out = [f"### {title}", "", "| where | median seconds | MB/s | vs local disk |", "|---|---:|---:|---:|"]
    for name, s in rows.items():
        ratio = "1.00x (baseline)" if name.startswith("local") else f"{base / s:.2f}x the speed"
        out.append(f"| {name} | {s:.3f} | {nbytes / s / MB:.0f} | {ratio} |")
    return [*out, ""]


def report(r: dict[str, Any], repeats: int) -> str:
    m, n, s3 = r["machine"], r["bytes"], r["s3"]
    v = ", ".join(f"{k} {x}" for k, x in m["versions"].items())
    lines = [
        f"# trainstate remote benchmark (median of {repeats})",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}",
        f"- disk: {m['dir']} on {m['filesystem']}",
        f"- versions: python {m['python']}, {v}, trainstate {m['trainstate']}",
        f"- state: {r['tensors']} float32 tensors, {n / MB:.0f} MB (MB = 1e6 B)",
        "- S3: a moto server on 127.0.0.1 (same machine, same 2 cores), through s3fs over HTTP",
        f"- 1-min load average at start / end: {r['load'][0]:.2f} / {r['load'][1]:.2f}",
        "",
    ]
    lines += table("save", r["save"], n)
    lines += table("restore in place", r["restore"], n)
    files = s3["files"]
    lines += [
        "### S3: how trainstate talked to the store",
        "",
        f"- files per checkpoint: {len(files)} data files + manifest.json (file target "
        f"{s3['target_file_bytes'] / 2**20:.0f} MiB; sizes {', '.join(f'{x / MB:.0f}' for x in files)} MB)",
        f"- save: {s3['writes']} uploads in the last run, up to {s3['write_peak']} at once, "
        f"in parts of {s3['part_size'] / 2**20:.0f} MiB",
        f"- restore: {s3['reads']} ranged GETs in the last run (manifest, headers, one per tensor), "
        f"up to {s3['read_peak']} at once",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", type=int, default=20, help="tensors of 1M float32")
    p.add_argument("--large", type=int, default=2, help="large tensors")
    p.add_argument("--large-elements", type=int, default=15_000_000)
    p.add_argument("--quick", action="store_true", help="~20 MB state")
    p.add_argument("--dir", default=None, help="where the local checkpoints go (default: the temp dir)")
    p.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = p.parse_args()
    start = time.perf_counter()
    r = run(args)
    text = report(r, args.repeats) + f"\n(total {time.perf_counter() - start:.0f}s)\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
