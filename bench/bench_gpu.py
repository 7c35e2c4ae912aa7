"""GPU benchmark: a training state on a CUDA device, saved and restored by trainstate and by the tools users
would otherwise use, in one run, as ratios.

State: bench_core's GPT-2-small shape (124M float32 parameters + AdamW moments, ~1.5 GB, ~600 tensors) moved
to the GPU. Every number is the median of --repeats runs, after one warm-up of each method.

1. save with fsync: trainstate.save; safetensors save_file (copies each tensor to host); torch.save;
   torch.distributed.checkpoint.save (no process group); the floor: one device-to-host copy into pinned
   memory plus a raw os.write and fsync.
2. restore into the live CUDA model and optimizer (warm page cache): trainstate.load; safetensors load_file
   straight to the device + copy_; torch.load(map_location="cuda") + load_state_dict; dcp.load; the floor:
   a read into pinned memory plus one host-to-device copy.
3. async: how long save() blocks the training loop -- trainstate's CheckpointManager(async_save=True)
   (staging into its reused pinned buffer) beside dcp.async_save (no_dist=True) -- and the whole save.

Run on a machine with a CUDA device, from the repo root:
    python bench/bench_gpu.py                 # ~1.5 GB state
    python bench/bench_gpu.py --quick         # ~0.09 GB, smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed import checkpoint as dcp

import trainstate

sys.path.insert(0, str(Path(__file__).parent))
import bench_core as core  # noqa: E402 - the shared state builder and the CPU methods

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
State = dict[str, Any]


def to_cuda(state: State) -> State:
    state["model"].cuda()
    for per_param in state["optim"].state.values():
        for k, v in per_param.items():
            if torch.is_tensor(v) and v.dim():
                per_param[k] = v.cuda()
    torch.cuda.synchronize()
    return state


def host_copy(state: State) -> dict[str, torch.Tensor]:
    """One pinned host buffer per tensor, filled from the device (the floor's staging)."""
    out = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in core.flat_tensors(state).items()}
    return out


def save_floor(state: State, path: Path, fsync: bool, pinned: dict[str, torch.Tensor]) -> None:
    for k, t in core.flat_tensors(state).items():
        pinned[k].copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    path.mkdir()
    with open(path / "raw.bin", "wb", buffering=0) as f:
        for t in pinned.values():
            view, pos = core.byte_view(t), 0
            while pos < len(view):
                pos += f.write(view[pos:])
    core.durable(path, fsync)


def load_floor(state: State, path: Path, pinned: dict[str, torch.Tensor]) -> None:
    with open(path / "raw.bin", "rb", buffering=0) as f:
        for t in pinned.values():
            f.readinto(core.byte_view(t))
    for k, t in core.flat_tensors(state).items():
        t.copy_(pinned[k], non_blocking=True)
    torch.cuda.synchronize()


def load_safetensors_cuda(state: State, path: Path) -> None:
    loaded = load_file(path / "state.safetensors", device="cuda")
    with torch.no_grad():
        for name, live in core.flat_tensors(state).items():
            live.copy_(loaded[name])
    torch.cuda.synchronize()


def load_torch_cuda(state: State, path: Path) -> None:
    sd = torch.load(path / "state.pt", weights_only=True, map_location="cuda")
    state["model"].load_state_dict(sd["model"])
    state["optim"].load_state_dict(sd["optim"])
    torch.cuda.synchronize()


def synced(fn: Any) -> Any:
    def run(*args: Any) -> None:
        fn(*args)
        torch.cuda.synchronize()

    return run


def timed(fn: Any, repeats: int, before: Any) -> float:
    before()
    fn()  # warm-up: first-call costs stay out of the timings
    return core.median_time(fn, repeats, before)


def bench_save_load(state: State, root: Path, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    pinned = host_copy(state)
    savers = {
        "trainstate": lambda p: trainstate.save(p, state, overwrite=True, fsync=True),
        "safetensors": lambda p: core.save_safetensors(state, p, True),
        "torch.save": lambda p: core.save_torch(state, p, True),
        "dcp": lambda p: core.save_dcp(state, p, True),
        "pinned copy + raw write": lambda p: save_floor(state, p, True, pinned),
    }
    loaders = {
        "trainstate": ("trainstate", lambda p: trainstate.load(p, state)),
        "safetensors (device=cuda) + copy_": ("safetensors", lambda p: load_safetensors_cuda(state, p)),
        "torch.load (map_location=cuda)": ("torch.save", lambda p: load_torch_cuda(state, p)),
        "dcp": ("dcp", lambda p: core.load_dcp(state, p)),
        "raw read + pinned copy": ("pinned copy + raw write", lambda p: load_floor(state, p, pinned)),
    }
    save: dict[str, float] = {}
    for name, fn in savers.items():
        path = root / name.replace(" ", "_")
        save[name] = timed(lambda fn=fn, path=path: synced(fn)(path), repeats, lambda path=path: core.clean(path))
        core.log(f"save {name}: {save[name]:.3f}s")  # the last run's checkpoint stays for the restores
    load: dict[str, float] = {}
    for name, (saved_by, fn) in loaders.items():
        path = root / saved_by.replace(" ", "_")
        load[name] = timed(lambda fn=fn, path=path: synced(fn)(path), repeats, lambda: None)
        core.log(f"load {name}: {load[name]:.3f}s")
    return save, load


def bench_async(state: State, root: Path, repeats: int) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    blocking, total = [], []
    with trainstate.CheckpointManager(root / "mgr", every_steps=1, keep_last=2, async_save=True) as mgr:
        for step in range(1, repeats + 3):
            t0 = time.perf_counter()
            mgr.save(step, state)
            t1 = time.perf_counter()
            mgr.wait()
            if step > 2:  # the first saves allocate the pinned buffer
                blocking.append(t1 - t0)
                total.append(time.perf_counter() - t0)
    out["trainstate CheckpointManager(async_save=True)"] = (statistics.median(blocking), statistics.median(total))
    blocking, total = [], []
    for i in range(repeats + 1):
        msd, osd = dcp.state_dict.get_state_dict(state["model"], state["optim"])
        t0 = time.perf_counter()
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=root / f"dcp{i}", no_dist=True)
        t1 = time.perf_counter()
        fut.result()
        if i:
            blocking.append(t1 - t0)
            total.append(time.perf_counter() - t0)
    out["dcp.async_save"] = (statistics.median(blocking), statistics.median(total))
    for name, (b, t) in out.items():
        core.log(f"async {name}: blocks {b:.3f}s, whole {t:.3f}s")
    return out


def table(title: str, rows: dict[str, float], nbytes: float) -> list[str]:
    base = rows["trainstate"]
    out = [f"### {title}", "", "| method | median s | GB/s | vs trainstate |", "|---|---:|---:|---|"]
    for name, s in rows.items():
        ratio = "1.00x (baseline)" if name == "trainstate" else f"{s / base:.2f}x the time"
        out.append(f"| {name} | {s:.3f} | {nbytes / s / core.GB:.2f} | {ratio} |")
    return [*out, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/trainstate-bench-gpu"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device")
    root = args.dir
    core.clean(root)
    root.mkdir(parents=True)
    state = to_cuda(core.build_state(core.QUICK if args.quick else core.FULL))
    nbytes = sum(t.nbytes for t in core.flat_tensors(state).values())
    save, load = bench_save_load(state, root, args.repeats)
    asyncs = bench_async(state, root / "async", args.repeats)
    m = core.machine(root)
    lines = [
        f"# trainstate GPU benchmark (median of {args.repeats})",
        "",
        f"- GPU: {torch.cuda.get_device_name()}, torch {torch.version.cuda and 'CUDA ' + torch.version.cuda}",
        f"- host: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; disk {m['filesystem']}",
        f"- versions: torch {m['torch']}, safetensors {m['safetensors']}, trainstate {m['trainstate']}",
        f"- state on the GPU: {len(core.flat_tensors(state))} tensors, {nbytes / core.GB:.3f} GB",
        "",
        *table("1. save, fsync", save, nbytes),
        *table("2. restore into the live CUDA state, warm page cache", load, nbytes),
        "### 3. async save: seconds the training loop is blocked / the whole save",
        "",
        "| method | blocks s | whole save s |",
        "|---|---:|---:|",
        *[f"| {name} | {b:.3f} | {t:.3f} |" for name, (b, t) in asyncs.items()],
    ]
    print("\n".join(lines))
    core.clean(root)


if __name__ == "__main__":
    main()
