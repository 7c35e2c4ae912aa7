"""Core benchmark: trainstate against the tools users would otherwise reach for, side by side, as ratios.

The state is GPT-2-small shaped and built on CPU without downloads: 124M float32 parameters (tied
lm_head) plus AdamW moments after one step on a fake gradient -- about 1.5 GB in ~600 tensors, held as
``{"model": model, "optim": opt, "step": 1}``. Sections (each number is the median of --repeats runs):

1. save, with and without fsync: trainstate.save, safetensors save_file (flat dict built inside the
   timing), torch.save, torch.distributed.checkpoint.save, and a raw os.write of the same bytes (the
   floor). The others get os.fsync on every file and directory after they return, as trainstate does.
2. restore in place into the live model and optimizer, warm and (as root) cold page cache.
3. open + read + verify one 768x3072 tensor, on the full state and on one ~1/10 its size.
4. peak extra RSS during save, each saver in a fresh child process (RSS sampled every 5 ms, plus the
   kernel's high-water mark); page cache is not RSS.

Every restore is checked once against a fingerprint of the state before its timings count.

Run (from the repo root):
    .venv/bin/python bench/bench_core.py                  # full state, ~10 minutes on 2 cores
    .venv/bin/python bench/bench_core.py --quick          # ~1/17 size, smoke run
    .venv/bin/python bench/bench_core.py --dir /data/tmp --repeats 5 --json results.json
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import safetensors
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import trainstate

State = dict[str, Any]
GB = 1e9


# -- the state ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    n_layer: int
    vocab: int
    n_pos: int
    d: int = 768


FULL, SMALL, QUICK = Shape(12, 50257, 1024), Shape(1, 5000, 1024), Shape(1, 256, 128)
PROBE = "model.h.0.mlp.c_fc.weight"  # the 768x3072 tensor section 3 reads


class Conv1D(nn.Module):  # GPT-2's linear layer: weight is (in, out)
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out).normal_(std=0.02))
        self.bias = nn.Parameter(torch.zeros(n_out))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn, self.attn.c_proj = Conv1D(d, 3 * d), Conv1D(d, d)
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = Conv1D(d, 4 * d), Conv1D(4 * d, d)


class GPT2(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(s.vocab, s.d), nn.Embedding(s.n_pos, s.d)
        self.h = nn.ModuleList(Block(s.d) for _ in range(s.n_layer))
        self.ln_f = nn.LayerNorm(s.d)
        self.lm_head = nn.Linear(s.d, s.vocab, bias=False, device="meta")
        self.lm_head.weight = self.wte.weight  # tied


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
    """name -> live tensor for every distinct tensor (the tied lm_head is dropped)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for k, t in state["model"].state_dict().items():
        if (t.data_ptr(), tuple(t.shape)) not in seen:
            seen.add((t.data_ptr(), tuple(t.shape)))
            out[f"model.{k}"] = t
    for i, per_param in state["optim"].state_dict()["state"].items():
        for k, t in per_param.items():
            out[f"optim.state.{i}.{k}"] = t
    return out


def byte_view(t: torch.Tensor) -> memoryview:  # writable: it aliases the live tensor
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def fingerprint(state: State) -> str:
    h = xxhash.xxh3_64()
    for t in flat_tensors(state).values():
        h.update(byte_view(t))
    return h.hexdigest()


def state_bytes(state: State) -> int:
    return sum(t.nbytes for t in flat_tensors(state).values())


# -- the methods: save(state, path, fsync) and restore(state, path) ----------------------------------

def fsync_tree(root: Path) -> None:
    """What trainstate does for durability: every file, every directory, and the parent."""
    for p in [*sorted(root.rglob("*")), root, root.parent]:
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_trainstate(state: State, path: Path, fsync: bool) -> None:
    trainstate.save(path, state, overwrite=True, fsync=fsync, threads=2)


def save_safetensors(state: State, path: Path, fsync: bool) -> None:
    meta = {"step": json.dumps(state["step"]),
            "param_groups": json.dumps(state["optim"].state_dict()["param_groups"], default=str)}
    path.mkdir()
    save_file(flat_tensors(state), path / "state.safetensors", metadata=meta)
    if fsync:
        fsync_tree(path)


def save_torch(state: State, path: Path, fsync: bool) -> None:
    path.mkdir()
    torch.save({"model": state["model"].state_dict(), "optim": state["optim"].state_dict(),
                "step": state["step"]}, path / "state.pt")
    if fsync:
        fsync_tree(path)


def save_dcp(state: State, path: Path, fsync: bool) -> None:
    msd, osd = get_state_dict(state["model"], state["optim"])
    writer = dcp.FileSystemWriter(path, sync_files=fsync)  # it would fsync files by default
    dcp.save({"model": msd, "optim": osd, "step": state["step"]}, storage_writer=writer, no_dist=True)
    if fsync:
        fsync_tree(path)


def save_raw(state: State, path: Path, fsync: bool) -> None:
    path.mkdir()
    fd = os.open(path / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in flat_tensors(state).values():
            view, pos = byte_view(t), 0
            while pos < len(view):
                pos += os.write(fd, view[pos:])
    finally:
        os.close(fd)
    if fsync:
        fsync_tree(path)


def load_trainstate(state: State, path: Path) -> None:
    trainstate.load(path, state)


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
    fd = os.open(path / "raw.bin", os.O_RDONLY)
    try:
        for t in flat_tensors(state).values():
            view, pos = byte_view(t), 0
            while pos < len(view):
                n = os.readv(fd, [view[pos:]])
                if n == 0:
                    raise EOFError(path)
                pos += n
    finally:
        os.close(fd)


SAVERS: dict[str, Callable[[State, Path, bool], None]] = {
    "trainstate": save_trainstate, "safetensors": save_safetensors, "torch.save": save_torch,
    "dcp": save_dcp, "raw write": save_raw}
LOADERS: dict[str, tuple[str, Callable[[State, Path], None]]] = {  # name -> (saver that writes it, loader)
    "trainstate": ("trainstate", load_trainstate), "safetensors+copy_": ("safetensors", load_safetensors),
    "torch.load": ("torch.save", load_torch), "dcp": ("dcp", load_dcp), "raw read": ("raw write", load_raw)}


# -- harness -------------------------------------------------------------------------------------

def clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()  # no dirty pages carried from one run into the next


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def can_drop_caches() -> bool:
    try:
        drop_caches()
        return True
    except OSError:
        return False


def median_time(fn: Callable[[], Any], repeats: int, before: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_save(state: State, root: Path, repeats: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for saver in SAVERS.values():  # warm-up: first-call costs (lazy imports, allocator) stay out
        path = root / "save"
        clean(path)
        saver(state, path, False)
    clean(root / "save")
    for fsync in (False, True):
        label = "fsync" if fsync else "no fsync"
        out[label] = {}
        for name, saver in SAVERS.items():
            path = root / "save"
            out[label][name] = median_time(lambda: saver(state, path, fsync), repeats, lambda: clean(path))
            clean(path)
            print(f"  save {label:8} {name:12} {out[label][name]:.3f}s", file=sys.stderr)
    return out


def bench_restore(state: State, root: Path, repeats: int, cold: bool) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"warm": {}, **({"cold": {}} if cold else {})}
    reference = fingerprint(state)
    for name, (saver, loader) in LOADERS.items():
        path = root / "restore"
        clean(path)
        SAVERS[saver](state, path, False)
        os.sync()
        for t in flat_tensors(state).values():  # check once that the restore really restores
            t.detach().zero_()
        loader(state, path)
        if fingerprint(state) != reference:
            raise AssertionError(f"{name}: the restored state differs from the saved one")
        out["warm"][name] = median_time(lambda: loader(state, path), repeats)
        if cold:
            out["cold"][name] = median_time(lambda: loader(state, path), repeats, drop_caches)
        print(f"  restore {name:18} " + " ".join(f"{k} {v[name]:.3f}s" for k, v in out.items()), file=sys.stderr)
        clean(path)
    return out


def bench_open(shapes: list[Shape], root: Path, repeats: int, cold: bool) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """Rows like 'trainstate 1.49 GB' -> {warm, cold} seconds; plus the bytes of each state."""
    out: dict[str, dict[str, float]] = {"warm": {}, **({"cold": {}} if cold else {})}
    sizes: dict[str, int] = {}
    for shape in shapes:
        state = build_state(shape)
        size = f"{state_bytes(state) / GB:.2f} GB"
        sizes[size] = state_bytes(state)
        for name, saver in (("trainstate", "trainstate"), ("safetensors", "safetensors")):
            path = root / "open"
            clean(path)
            SAVERS[saver](state, path, False)
            os.sync()
            fn = open_trainstate if name == "trainstate" else open_safetensors
            expect = state["model"].h[0].mlp.c_fc.weight.detach()
            if not torch.equal(torch.as_tensor(fn(path)), expect):
                raise AssertionError(f"{name}: read the wrong bytes for {PROBE}")
            for cache, values in out.items():
                values[f"{name} {size}"] = median_time(lambda: fn(path), repeats,
                                                        drop_caches if cache == "cold" else None)
            clean(path)
        del state
        gc.collect()
    return out, sizes


def open_trainstate(path: Path) -> Any:
    with trainstate.open(path) as ck:
        return ck.read(PROBE).copy()  # read() verified the checksum; copy so the map can close


def open_safetensors(path: Path) -> Any:
    with safe_open(path / "state.safetensors", framework="pt") as f:
        return f.get_tensor(PROBE)


def bench_memory(shape: Shape, root: Path, repeats: int) -> dict[str, float]:
    """Peak extra RSS (bytes) per saver, each in a fresh child process."""
    out = {}
    for name in SAVERS:
        cmd = [sys.executable, __file__, "--child-mem", name, "--dir", str(root), "--repeats", str(repeats),
               "--shape", json.dumps(shape.__dict__)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])["peak_extra"]
        print(f"  memory {name:12} {out[name] / 1e6:.0f} MB", file=sys.stderr)
    return out


def child_memory(name: str, shape: Shape, root: Path, repeats: int) -> None:
    state = build_state(shape)
    proc, path = psutil.Process(), root / f"mem-{os.getpid()}"
    peaks = []
    for _ in range(repeats):
        clean(path)
        gc.collect()
        hwm = Path("/proc/self/clear_refs")
        try:
            hwm.write_text("5")  # reset the kernel's peak-RSS counter (VmHWM)
        except OSError:
            pass
        base, peak, done = proc.memory_info().rss, [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        SAVERS[name](state, path, False)
        done.set()
        sampler.join()
        status = Path("/proc/self/status").read_text()
        vm_hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM")), 0)
        peaks.append(max(peak[0], vm_hwm) - base)
    clean(path)
    print(json.dumps({"peak_extra": statistics.median(peaks)}))


# -- report --------------------------------------------------------------------------------------

def machine(root: Path) -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    real, best = os.path.realpath(root), ("?", "?", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
            best = (fstype, dev, mnt)
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "dir": str(root), "filesystem": f"{best[0]} on {best[1]} (mounted at {best[2]})",
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "safetensors": safetensors.__version__, "trainstate": trainstate.__version__}


def table(title: str, times: dict[str, float], nbytes: int | dict[str, int]) -> str:
    base = times[next(k for k in times if k.startswith("trainstate"))]
    rows = [f"### {title}", "", "| method | median seconds | GB/s | ratio vs trainstate |", "|---|---:|---:|---|"]
    for name, s in times.items():
        n = nbytes if isinstance(nbytes, int) else nbytes[name.split(" ", 1)[1]]
        ratio = "1.00x (baseline)" if name.startswith("trainstate") else f"{name} / trainstate = {s / base:.2f}x"
        rows.append(f"| {name} | {s:.4f} | {n / s / GB:.2f} | {ratio} |")
    return "\n".join(rows)


def targets(r: dict[str, Any]) -> list[tuple[str, bool]]:
    out = []
    for mode, t in r["save"].items():
        ts = t["trainstate"]
        out += [(f"save ({mode}) >= safetensors: {t['safetensors'] / ts:.2f}x", ts <= t["safetensors"]),
                (f"save ({mode}) >= 1.5x faster than torch.save: {t['torch.save'] / ts:.2f}x", t["torch.save"] >= 1.5 * ts),
                (f"save ({mode}) within 1.25x of raw write: {ts / t['raw write']:.2f}x", ts <= 1.25 * t["raw write"])]
    for cache, t in r["restore"].items():
        ts = t["trainstate"]
        out += [(f"restore ({cache}) >= safetensors+copy_: {t['safetensors+copy_'] / ts:.2f}x", ts <= t["safetensors+copy_"]),
                (f"restore ({cache}) >= 2x faster than torch.load: {t['torch.load'] / ts:.2f}x", t["torch.load"] >= 2 * ts)]
    for cache, t in r["open"].items():
        out += [(f"open+read ({cache}, {k.split(' ', 1)[1]}) < 50 ms: {s * 1e3:.1f} ms", s < 0.05)
                for k, s in t.items() if k.startswith("trainstate")]
    pct = 100 * r["memory"]["trainstate"] / r["state_bytes"]
    out.append((f"peak extra memory during save < 10% of state: {pct:.1f}%", pct < 10))
    return out


def report(r: dict[str, Any]) -> str:
    m, n = r["machine"], r["state_bytes"]
    lines = [f"# trainstate core benchmark ({'quick' if r['quick'] else 'full'}, median of {r['repeats']})", "",
             f"machine: {m['cpu']}, {m['cores']} cores, {m['ram_gb']} GiB RAM, kernel {m['kernel']}",
             f"disk: {m['dir']} on {m['filesystem']}",
             f"versions: python {m['python']}, torch {m['torch']}, safetensors {m['safetensors']}, "
             f"trainstate {m['trainstate']}",
             f"state: {r['tensors']} tensors, {n / GB:.3f} GB (GB = 1e9 bytes)", ""]
    for mode, t in r["save"].items():
        lines += [table(f"1. save, {mode}", t, n), ""]
    for cache, t in r["restore"].items():
        lines += [table(f"2. restore in place, {cache} page cache", t, n), ""]
    for cache, t in r["open"].items():
        one = 768 * 3072 * 4
        lines += [table(f"3. open + read one 768x3072 tensor, {cache} page cache (GB/s of the tensor)", t,
                        {k: one for k in r["open_sizes"]}), ""]
    lines += [r["note"], ""] if r["note"] else []
    lines += ["### 4. peak extra RSS during save", "", "| method | peak extra MB | % of state | ratio vs trainstate |",
              "|---|---:|---:|---|"]
    base = max(r["memory"]["trainstate"], 1)
    for name, b in r["memory"].items():
        ratio = "1.00x (baseline)" if name == "trainstate" else f"{name} / trainstate = {b / base:.2f}x"
        lines.append(f"| {name} | {b / 1e6:.1f} | {100 * b / n:.1f}% | {ratio} |")
    lines += ["", "### targets", ""]
    lines += [f"- {'PASS' if ok else 'MISS'}  {text}" for text, ok in targets(r)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, help="where checkpoints go (default: a temp dir under /tmp)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small state, for a smoke run")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child-mem", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_mem:
        return child_memory(args.child_mem, Shape(**json.loads(args.shape)), args.dir, args.repeats)

    root = Path(tempfile.mkdtemp(prefix="trainstate-bench-", dir=args.dir or "/tmp"))
    shape = QUICK if args.quick else FULL
    cold = os.geteuid() == 0 and can_drop_caches()
    r: dict[str, Any] = {"quick": args.quick, "repeats": args.repeats, "machine": machine(root),
                         "note": "" if cold else "cold page cache: skipped (needs root and a writable "
                         "/proc/sys/vm/drop_caches)"}
    if r["machine"]["filesystem"].startswith("tmpfs"):
        print(f"warning: {root} is on tmpfs; pass --dir on a real disk", file=sys.stderr)
    try:
        t0 = time.perf_counter()
        state = build_state(shape)
        r["state_bytes"], r["tensors"] = state_bytes(state), len(flat_tensors(state))
        print(f"state: {r['tensors']} tensors, {r['state_bytes'] / GB:.2f} GB, built in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
        r["save"] = bench_save(state, root, args.repeats)
        r["restore"] = bench_restore(state, root, args.repeats, cold)
        del state
        gc.collect()
        r["open"], r["open_sizes"] = bench_open([shape] if args.quick else [FULL, SMALL], root,
                                                max(args.repeats, 5), cold)
        r["memory"] = bench_memory(shape, root, args.repeats)
        r["seconds"] = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(r))
    print(f"\n(total {r['seconds']:.0f}s)")
    if args.json:
        args.json.write_text(json.dumps({**r, "targets": targets(r)}, indent=2))


if __name__ == "__main__":
    main()
