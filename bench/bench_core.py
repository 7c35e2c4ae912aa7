"""Core benchmark: trainstate next to the tools users would otherwise use, in one run, as ratios.

State: GPT-2-small shaped, built on CPU without downloads -- 124M float32 parameters (lm_head tied to the
token embedding) plus AdamW moments after one step on a fake gradient: ~1.5 GB in ~600 tensors, held as
{"model": model, "optim": opt, "step": 1}. Every number is the median of --repeats runs.

1. save, with and without fsync: trainstate._save; safetensors save_file (building the flat dict is timed);
   torch.save; torch.distributed.checkpoint.save; a raw os.write of the same bytes (the floor). With fsync,
   the others get os.fsync on every file and directory after they return, as trainstate does itself.
2. restore in place into the live model and optimizer, warm and (as root) cold page cache; each restore
   is first checked against a fingerprint of the saved state.
3. open + read + verify one 768x3072 tensor, on the full state and on one ~1/10 its size.
4. peak extra RSS during save, each saver in a fresh child process (psutil every 5 ms, plus VmHWM).

Run from the repo root:
    .venv/bin/python bench/bench_core.py                    # ~1.5 GB state, ~10 min on 2 cores
    .venv/bin/python bench/bench_core.py --quick            # ~0.09 GB state, smoke run
    .venv/bin/python bench/bench_core.py --dir /data/tmp --repeats 5 --json results.json
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import safetensors
import torch
import xxhash
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import trainstate

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp in a single process
State = dict[str, Any]
GB = 1e9
PROBE = "model.h.0.mlp.c_fc.weight"  # the 768x3072 tensor of section 3


@dataclass(frozen=True)
class Shape:
    n_layer: int
    vocab: int
    n_pos: int
    d: int = 768


FULL, SMALL, QUICK = Shape(12, 50257, 1024), Shape(1, 5000, 1024), Shape(1, 256, 128)


class Conv1D(nn.Module):  # GPT-2's linear layer: weight is (in, out)
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out).normal_(std=0.02))
        self.bias = nn.Parameter(torch.zeros(n_out))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), nn.Module(), nn.LayerNorm(d), nn.Module()
        self.attn.c_attn, self.attn.c_proj = Conv1D(d, 3 * d), Conv1D(d, d)
        self.mlp.c_fc, self.mlp.c_proj = Conv1D(d, 4 * d), Conv1D(4 * d, d)


class GPT2(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(s.vocab, s.d), nn.Embedding(s.n_pos, s.d)
        self.h = nn.ModuleList(Block(s.d) for _ in range(s.n_layer))
        self.ln_f = nn.LayerNorm(s.d)
        self.lm_head = nn.Linear(s.d, s.vocab, bias=False, device="meta")
        self.lm_head.weight = self.wte.weight


def build_state(shape: Shape) -> State:
    torch.manual_seed(0)
    model = GPT2(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"model": model, "optim": opt, "step": 1}


def flat_tensors(state: State) -> dict[str, torch.Tensor]:
    """name -> live tensor, each distinct tensor once (the tied lm_head is dropped)."""
    out, seen = {}, set()
    for k, t in state["model"].state_dict().items():
        if (t.data_ptr(), t.shape) not in seen:
            seen.add((t.data_ptr(), t.shape))
            out[f"model.{k}"] = t
    for i, per_param in state["optim"].state_dict()["state"].items():
        out.update({f"optim.state.{i}.{k}": t for k, t in per_param.items()})
    return out


def byte_view(t: torch.Tensor) -> memoryview:  # aliases the live tensor's memory
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def fingerprint(state: State) -> str:
    h = xxhash.xxh3_64()
    for t in flat_tensors(state).values():
        h.update(byte_view(t))
    return h.hexdigest()


# -- methods: save(state, path, fsync) and restore(state, path) -------------------------------------


def durable(path: Path, fsync: bool) -> None:
    """What trainstate does when asked to fsync: every file, the directory, and its parent."""
    for p in [*sorted(path.rglob("*")), path, path.parent] if fsync else []:
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() else 0))
        os.fsync(fd)
        os.close(fd)


def save_safetensors(state: State, path: Path, fsync: bool) -> None:
    groups = json.dumps(state["optim"].state_dict()["param_groups"], default=str)
    path.mkdir()
    save_file(flat_tensors(state), path / "state.safetensors", {"step": str(state["step"]), "groups": groups})
    durable(path, fsync)


def save_torch(state: State, path: Path, fsync: bool) -> None:
    path.mkdir()
    sd = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict(), "step": state["step"]}
    torch.save(sd, path / "state.pt")
    durable(path, fsync)


def save_dcp(state: State, path: Path, fsync: bool) -> None:
    msd, osd = get_state_dict(state["model"], state["optim"])
    writer = dcp.FileSystemWriter(path, sync_files=fsync)  # it fsyncs files unless told not to
    dcp.save({"model": msd, "optim": osd, "step": state["step"]}, storage_writer=writer, no_dist=True)
    durable(path, fsync)


def save_raw(state: State, path: Path, fsync: bool) -> None:
    path.mkdir()
    with open(path / "raw.bin", "wb", buffering=0) as f:  # unbuffered: each write() is one os.write
        for t in flat_tensors(state).values():
            view, pos = byte_view(t), 0
            while pos < len(view):
                pos += f.write(view[pos:])
    durable(path, fsync)


def load_safetensors(state: State, path: Path) -> None:
    loaded = load_file(path / "state.safetensors")
    with torch.no_grad():
        for name, live in flat_tensors(state).items():
            live.copy_(loaded[name])


def load_torch(state: State, path: Path) -> None:
    sd = torch.load(path / "state.pt", weights_only=True)
    state["model"].load_state_dict(sd["model"])
    state["optim"].load_state_dict(sd["optim"])


def load_dcp(state: State, path: Path) -> None:
    msd, osd = get_state_dict(state["model"], state["optim"])
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    set_state_dict(state["model"], state["optim"], model_state_dict=msd, optim_state_dict=osd)


def load_raw(state: State, path: Path) -> None:
    with open(path / "raw.bin", "rb", buffering=0) as f:
        for t in flat_tensors(state).values():
            if f.readinto(byte_view(t)) != t.nbytes:  # one read(2) fills a regular file's range
                raise EOFError(f"{path} is short")


def open_trainstate(path: Path) -> Any:
    with trainstate.open(path) as ck:
        return ck.read(PROBE)  # memory-mapped, checksum verified (every byte hashed)


def open_safetensors(path: Path) -> Any:
    with safetensors.safe_open(path / "state.safetensors", framework="pt") as f:
        return f.get_tensor(PROBE)


SAVERS: dict[str, Callable[[State, Path, bool], Any]] = {
    "trainstate": lambda state, path, fsync: trainstate.save(path, state, overwrite=True, fsync=fsync, threads=2),
    "safetensors": save_safetensors,
    "torch.save": save_torch,
    "dcp": save_dcp,
    "raw write": save_raw,
}
LOADERS: dict[str, tuple[str, Callable[[State, Path], Any]]] = {  # name -> (the saver it reads, restore)
    "trainstate": ("trainstate", lambda state, path: trainstate.load(path, state)),
    "safetensors+copy_": ("safetensors", load_safetensors),
    "torch.load": ("torch.save", load_torch),
    "dcp": ("dcp", load_dcp),
    "raw read": ("raw write", load_raw),
}
OPENERS = {"trainstate": open_trainstate, "safetensors": open_safetensors}


# -- harness -------------------------------------------------------------------------------------


def clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()  # no dirty pages carried from one run into the next


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def median_time(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_save(state: State, path: Path, repeats: int) -> dict[str, dict[str, float]]:
    for saver in SAVERS.values():  # warm-up, so first-call costs stay out of the timings
        clean(path)
        saver(state, path, False)
    out: dict[str, dict[str, float]] = {"no fsync": {}, "fsync": {}}
    for mode, row in out.items():
        for name, saver in SAVERS.items():
            fn = partial(saver, state, path, mode == "fsync")
            row[name] = median_time(fn, repeats, partial(clean, path))
            log(f"save {mode} {name}: {row[name]:.3f}s")
    clean(path)
    return out


def bench_restore(state: State, path: Path, repeats: int, caches: list[str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {cache: {} for cache in caches}
    reference = fingerprint(state)
    for name, (saver, restore) in LOADERS.items():
        clean(path)
        SAVERS[saver](state, path, False)
        for t in flat_tensors(state).values():
            t.detach().zero_()
        restore(state, path)  # also the warm-up
        if fingerprint(state) != reference:
            raise AssertionError(f"{name} did not restore the saved state")
        for cache, row in out.items():
            row[name] = median_time(partial(restore, state, path), repeats, CACHE_PREP[cache])
            log(f"restore {cache} {name}: {row[name]:.3f}s")
    clean(path)
    return out


def bench_open(states: list[State], path: Path, repeats: int, caches: list[str]) -> dict[str, dict[str, float]]:
    """Rows named "method, size" so the table shows whether the time grows with the checkpoint."""
    out: dict[str, dict[str, float]] = {cache: {} for cache in caches}
    for state in states:
        size, expect = state_gb(state), state["model"].h[0].mlp.c_fc.weight.detach()
        for name, read in OPENERS.items():
            clean(path)
            SAVERS[name](state, path, False)
            if not np.array_equal(np.asarray(read(path)), expect.numpy()):
                raise AssertionError(f"{name} read the wrong bytes for {PROBE}")
            for cache, row in out.items():
                key = f"{name}, {size:.2f} GB state"
                row[key] = median_time(partial(read, path), repeats, CACHE_PREP[cache])
    clean(path)
    return out


CACHE_PREP: dict[str, Callable[[], Any]] = {"warm": lambda: None, "cold": drop_caches}


def bench_memory(quick: bool, root: Path, repeats: int) -> dict[str, float]:
    """Peak extra RSS in bytes per saver, each measured in a fresh child process."""
    out = {}
    for name in SAVERS:
        cmd = [
            sys.executable,
            __file__,
            "--child-mem",
            name,
            "--dir",
            str(root),
            "--repeats",
            str(repeats),
            *(["--quick"] if quick else []),
        ]
        out[name] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        log(f"memory {name}: {out[name] / 1e6:.1f} MB")
    return out


def sample_rss(proc: psutil.Process, done: threading.Event, peak: list[int]) -> None:
    while not done.wait(0.005):
        peak[0] = max(peak[0], proc.memory_info().rss)


def child_memory(name: str, quick: bool, root: Path, repeats: int) -> None:
    state, proc, path = build_state(QUICK if quick else FULL), psutil.Process(), root / f"mem-{os.getpid()}"
    peaks = []
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    for _ in range(repeats):
        clean(path)
        gc.collect()
        libc.malloc_trim(0)  # freed heap still counts as RSS and would hide new allocations
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM, the kernel's peak RSS
        base, peak, done = proc.memory_info().rss, [0], threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(proc, done, peak))
        sampler.start()
        SAVERS[name](state, path, False)
        done.set()
        sampler.join()
        status = Path("/proc/self/status").read_text().splitlines()
        hwm = [int(x.split()[1]) * 1024 for x in status if x.startswith("VmHWM")]
        peaks.append(max([peak[0], *hwm]) - base)
    clean(path)
    print(json.dumps(statistics.median(peaks)))


def state_gb(state: State) -> float:
    return sum(t.nbytes for t in flat_tensors(state).values()) / GB


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


# -- report --------------------------------------------------------------------------------------


def machine(root: Path) -> dict[str, Any]:
    cpu = [
        x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name")
    ]
    real, mount = os.path.realpath(root), ("?", "?", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        if (real + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(mount[2]):
            mount = (fstype, dev, mnt)
    return {
        "cpu": cpu[0] if cpu else platform.processor(),
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "dir": str(root),
        "filesystem": f"{mount[0]} ({mount[1]} on {mount[2]})",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "trainstate": trainstate.__version__,
    }


def table(title: str, rows: dict[str, float], nbytes: float) -> list[str]:
    base = next(s for name, s in rows.items() if name.startswith("trainstate"))
    out = [f"### {title}", "", "| method | median seconds | GB/s | ratio vs trainstate |", "|---|---:|---:|---|"]
    for name, s in rows.items():
        ratio = f"{name.split(',')[0]} / trainstate = {s / base:.2f}x"
        ratio = "1.00x (baseline)" if name.startswith("trainstate") else ratio
        out.append(f"| {name} | {s:.4f} | {nbytes / s / GB:.2f} | {ratio} |")
    return [*out, ""]


def targets(r: dict[str, Any]) -> list[str]:
    checks = []
    for mode, t in r["save"].items():
        ts = t["trainstate"]
        st, pt, raw = t["safetensors"], t["torch.save"], t["raw write"]
        checks += [
            (f"save ({mode}) >= safetensors: {st / ts:.2f}x", ts <= st),
            (f"save ({mode}) >= 1.5x faster than torch.save: {pt / ts:.2f}x", pt >= 1.5 * ts),
            (f"save ({mode}) within 1.25x of raw write: {ts / raw:.2f}x", ts <= 1.25 * raw),
        ]
    for cache, t in r["restore"].items():
        ts, st, pt = t["trainstate"], t["safetensors+copy_"], t["torch.load"]
        checks += [
            (f"restore ({cache}) >= safetensors+copy_: {st / ts:.2f}x", ts <= st),
            (f"restore ({cache}) >= 2x faster than torch.load: {pt / ts:.2f}x", pt >= 2 * ts),
        ]
    for cache, t in r["open"].items():
        checks += [
            (f"open+read one tensor < 50 ms ({cache}, {k.split(', ')[1]}): {s * 1e3:.1f} ms", s < 0.05)
            for k, s in t.items()
            if k.startswith("trainstate")
        ]
    pct = 100 * r["memory"]["trainstate"] / r["state_bytes"]
    checks.append((f"peak extra memory during save < 10% of the state: {pct:.1f}%", pct < 10))
    return [f"- {'PASS' if ok else 'MISS'}  {text}" for text, ok in checks]


def report(r: dict[str, Any]) -> str:
    m, n = r["machine"], r["state_bytes"]
    kind = "quick" if r["quick"] else "full"
    lines = [
        f"# trainstate core benchmark ({kind} state, median of {r['repeats']})",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}",
        f"- disk: {m['dir']} on {m['filesystem']}",
        f"- versions: python {m['python']}, torch {m['torch']}, safetensors {m['safetensors']}, "
        + f"trainstate {m['trainstate']}",
        f"- state: {r['tensors']} tensors, {n / GB:.3f} GB (GB = 1e9 B)",
        (
            f"- 1-min load average at start / end: {r['load'][0]:.2f} / {r['load'][1]:.2f} "
            "(other work on the machine skews every number)"
        ),
    ]
    lines += [f"- {r['note']}", ""] if r["note"] else [""]
    for mode, t in r["save"].items():
        lines += table(f"1. save, {mode}", t, n)
    for cache, t in r["restore"].items():
        lines += table(f"2. restore in place, {cache} page cache", t, n)
    for cache, t in r["open"].items():
        lines += table(
            f"3. open + read one 768x3072 tensor, {cache} page cache (GB/s of that tensor; "
            "trainstate hashes it to verify, safetensors has no checksum)",
            t,
            768 * 3072 * 4,
        )
    base = r["memory"]["trainstate"]
    lines += [
        "### 4. peak extra RSS during save",
        "",
        "| method | peak extra MB | % of state | ratio vs trainstate |",
        "|---|---:|---:|---|",
    ]
    for name, b in r["memory"].items():
        ratio = (
            "n/a (trainstate's peak < 1 MB)"
            if base < 1e6
            else ("1.00x (baseline)" if name == "trainstate" else f"{name} / trainstate = {b / base:.2f}x")
        )
        lines.append(f"| {name} | {b / 1e6:.1f} | {100 * b / n:.1f}% | {ratio} |")
    return "\n".join([*lines, "", "### targets", "", *targets(r)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, help="parent for the checkpoints (default /tmp; not tmpfs)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a ~1/17-size state, for a smoke run")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child-mem", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_mem:
        return child_memory(args.child_mem, args.quick, args.dir, args.repeats)

    root = Path(tempfile.mkdtemp(prefix="trainstate-bench-", dir=args.dir or "/tmp"))
    shape, caches, note = QUICK if args.quick else FULL, ["warm"], ""
    try:
        drop_caches()
        caches.append("cold")
    except OSError:
        note = "cold page cache skipped: dropping caches needs root (/proc/sys/vm/drop_caches)"
    r: dict[str, Any] = {
        "quick": args.quick,
        "repeats": args.repeats,
        "machine": machine(root),
        "note": note,
        "load": os.getloadavg()[0],
    }
    if r["machine"]["filesystem"].startswith("tmpfs"):
        log(f"warning: {root} is on tmpfs, so nothing reaches a disk; pass --dir")
    t0 = time.perf_counter()
    try:
        state = build_state(shape)
        r["state_bytes"] = sum(t.nbytes for t in flat_tensors(state).values())
        r["tensors"] = len(flat_tensors(state))
        log(f"state: {r['tensors']} tensors, {state_gb(state):.2f} GB, built in {time.perf_counter() - t0:.1f}s")
        r["save"] = bench_save(state, root / "ckpt", args.repeats)
        r["restore"] = bench_restore(state, root / "ckpt", args.repeats, caches)
        states = [state] if args.quick else [state, build_state(SMALL)]
        r["open"] = bench_open(states, root / "ckpt", max(args.repeats, 5), caches)
        del state, states
        gc.collect()
        r["memory"] = bench_memory(args.quick, root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r["seconds"], r["load"] = time.perf_counter() - t0, [r["load"], os.getloadavg()[0]]
    print(report(r) + f"\n\n(total {r['seconds']:.0f}s)")
    if args.json:
        args.json.write_text(json.dumps({**r, "targets": targets(r)}, indent=2))


if __name__ == "__main__":
    main()
