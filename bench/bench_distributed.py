"""Many ranks (issue 10): trainstate's collective save and load beside torch.distributed.checkpoint.

``--simulate``: rank 0's whole part of a save of R ranks x T tensors, no processes. Each rank holds one
row-shard of every tensor (FSDP) — or, in the second layout, every tensor whole (DDP: each box replicated
on every rank) — plus its own RNG state (three per-rank tensors). The stages are what rank 0 does between
the ranks' messages and the commit: unpickle the ranks' plans, plan (who writes what, checked), unpickle
what they wrote, merge it into one tensor table and tree, and encode the manifest; then what every rank of
a restore does first: parse the manifest, and check every tensor's entry (a rank holding a shard of each
tensor looks up all of them).

Default (no ``--simulate``): real ranks, one gloo process group per world size spawned on this machine
(CPU), each rank holding an FSDP2 model (``fully_shard`` on a CPU DeviceMesh) and its AdamW state. Side by
side in the same run and the same processes: ``trainstate.save`` vs ``torch.distributed.checkpoint.save``
(FileSystemWriter, which fsyncs its files by default: trainstate fsyncs too, its default) and
``trainstate.load`` vs ``dcp.load`` into the live model and optimizer (page cache warm: each load reads
what was just saved), then a resharding restore (saved on the largest world size, loaded on half of it).
Each time is the slowest rank's (barrier, operation, barrier), median of ``--rounds`` after one round
of warm-up; every load is checked against the saved values. Beside them, what the disk allows: a raw sequential write with fsync
and a read of the same bytes from one process (bench_core.save_raw / load_raw).

The features (compression, encryption, incremental) beside DCP: bench_distributed_features.py.

    .venv/bin/python bench/bench_distributed.py --simulate --ranks 1024 --tensors 1000
    .venv/bin/python bench/bench_distributed.py --ranks 1,2,4 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import trainstate
from trainstate import _gc
from trainstate._distributed import per_rank
from trainstate._distributed.plan import RankPlan, assign
from trainstate._distributed.save import Written, merge
from trainstate._format import manifest
from trainstate._save.encode import encode_state
from trainstate._save.files import PIECE_BYTES
from trainstate._save.write import manifest_bytes

# -- simulation -----------------------------------------------------------------------------------


def _layout(ranks: int, tensors: int, fsdp: bool) -> tuple[list[bytes], list[bytes], Any]:
    """The messages every rank sends rank 0 (pickled, as gather_object sends them), and rank 0's snapshot."""
    model = {f"layers.{t}.weight": np.zeros(1, np.float32) for t in range(tensors)}
    snapshot = encode_state({"model": model, "step": 1200, "rng": trainstate.RNGState()}, None, rank=0)
    names = [e.name for e in snapshot.entries if e.name.startswith("model.")]
    if fsdp:
        dtype, whole, part = "BF16", (4 * ranks, 4096), (4, 4096)
    else:
        dtype, whole, part = "F32", (1024, 1024), (1024, 1024)
    nbytes = part[0] * part[1] * (2 if fsdp else 4)
    plans, parts = [], []
    for r in range(ranks):
        own = encode_state({"rng": trainstate.RNGState()}, None, rank=r)  # this rank's RNG: its own tensors
        parts.append(per_rank.split(own.tree)[1])
        boxes = np.zeros((tensors + len(own.entries), 6), np.int64)
        boxes[:tensors, 0], boxes[:tensors, 3], boxes[:tensors, 4], boxes[:tensors, 5] = 2, *part, nbytes
        boxes[:tensors, 1] = part[0] * r if fsdp else 0
        kinds = [(dtype, "torch", whole)]
        kind = np.zeros(len(boxes), np.int64)
        for i, e in enumerate(own.entries):
            boxes[tensors + i, [0, 3, 5]] = 1, e.shape[0], e.nbytes
            kind[tensors + i] = len(kinds)
            kinds.append((e.dtype, e.kind, e.global_shape))
        plans.append(RankPlan(names + [e.name for e in own.entries], kinds, kind, boxes))
    digests = per_rank.split(snapshot.tree)[0]
    sent = [pickle.dumps((p, digests)) for p in plans]
    shares = assign(plans).shares
    rng = np.random.default_rng(0)
    written = []
    for r, (plan, share) in enumerate(zip(plans, shares)):
        files = [f"data-r{r:05d}-{i:05d}.safetensors" for i in range(2)]
        sizes = plan.boxes[share, -1]
        file = np.arange(len(share)) % 2
        ends = np.zeros(len(share), np.int64)
        for f in range(2):
            ends[file == f] = 4096 + np.cumsum(sizes[file == f])
        ranges = np.stack([ends - sizes, ends], axis=1)
        sums = np.array([f"xxh3_64:{x:016x}" for x in rng.integers(0, 2**63, len(share)).tolist()], dtype="S")
        pieces = {
            k: manifest.Pieces(PIECE_BYTES, tuple(f"xxh3_64:{x:016x}" for x in range(-(-int(n) // PIECE_BYTES))))
            for k, n in enumerate(sizes.tolist())
            if n > PIECE_BYTES
        }
        entries = tuple(
            manifest.FileEntry(name, int(ends[file == f].max(initial=4096)), "xxh3_64:0123456789abcdef")
            for f, name in enumerate(files)
        )
        written.append(pickle.dumps((Written(entries, file, ranges, sums, pieces), files, parts[r])))
    return sent, written, snapshot


def simulate(ranks: int, tensors: int, fsdp: bool, repeats: int) -> dict[str, Any]:
    sent, written, snapshot = _layout(ranks, tensors, fsdp)
    times: dict[str, list[float]] = {}

    def timed(stage: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        times.setdefault(stage, []).append(time.perf_counter() - start)
        return out

    for _ in range(repeats):
        with _gc.paused():  # as the library runs these: a collective save and a load pause the collector
            _one_round(timed, sent, written, snapshot)
    return _summary(times, sent, written)


def _one_round(
    timed: Callable[[str, Callable[[], Any]], Any], sent: list[bytes], written: list[bytes], snapshot: Any
) -> None:
    if True:
        plans = timed("receive plans", lambda: [pickle.loads(s) for s in sent])
        plan = timed("plan", lambda: assign([p[0] for p in plans]))
        got = timed("receive entries", lambda: [pickle.loads(w) for w in written])
        full, files, table = timed("merge", lambda: merge(got, plan, snapshot))
        raw = timed("encode manifest", lambda: manifest_bytes(full, files, table))
        opened = timed("open: parse", lambda: manifest.parse(raw))
        timed("open: every entry", lambda: [opened.tensors[n] for n in opened.tensors])
        _last["manifest"] = len(raw)
        _last["chunks"] = sum(len(opened.tensors[n].chunks) for n in opened.tensors)


_last: dict[str, int] = {}


def _summary(times: dict[str, list[float]], sent: list[bytes], written: list[bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    out["messages"] = sum(map(len, sent)) + sum(map(len, written))
    out.update(_last)
    return out


SAVE_STAGES = ["receive plans", "plan", "receive entries", "merge", "encode manifest"]
OPEN_STAGES = ["open: parse", "open: every entry"]


def report_simulation(ranks: int, tensors: int, repeats: int) -> None:
    rows = {
        "FSDP (every tensor sharded over every rank)": simulate(ranks, tensors, True, repeats),
        "DDP (every tensor whole on every rank)": simulate(ranks, tensors, False, repeats),
    }
    print(
        f"Rank 0's part of a save of {ranks:,} ranks x {tensors:,} tensors (+3 RNG tensors per rank), "
        f"seconds, median of {repeats}; no processes.\n"
    )
    head = ["layout", "chunks", *SAVE_STAGES, "save total", "manifest MB", *OPEN_STAGES]
    print("| " + " | ".join(head) + " |")
    print("|---" + "|---:" * (len(head) - 1) + "|")
    for label, r in rows.items():
        cells = [label, f"{r['chunks']:,}", *(f"{r[s]:.2f}" for s in SAVE_STAGES)]
        cells += [f"**{sum(r[s] for s in SAVE_STAGES):.2f}**", f"{r['manifest'] / 1e6:.0f}"]
        cells += [f"{r[s]:.2f}" for s in OPEN_STAGES]
        print("| " + " | ".join(cells) + " |")


# -- real ranks -----------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
OPS = ["save", "load"]
TOOLS = {"trainstate": "trainstate", "dcp": "DCP"}


def _state(world: int, width: int, layers: int) -> tuple[Any, Any]:
    """An FSDP2 model of ``layers`` width x width linear layers and its AdamW after one step, the same
    values at every world size (constant gradients: the step is elementwise)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def _locals(model: Any, optim: Any) -> list[Any]:
    """This rank's shards of every parameter and optimizer state tensor (live, not copies)."""
    out = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for per_param in optim.state.values():
        out += [t.to_local() if hasattr(t, "to_local") else t for t in per_param.values() if t.dim()]
    return [t.detach() for t in out]


def _dcp_save(model: Any, optim: Any, path: str) -> None:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(path))  # sync_files=True


def _dcp_load(model: Any, optim: Any, path: str) -> None:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(path))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)


def _worker(rank: int, world: int, root: str, rounds: int, width: int, layers: int, source: int) -> Any:
    """One rank: ``rounds`` of save and load with both tools; or, with ``source``, only loads of the
    checkpoints saved by ``source`` ranks (resharding)."""
    import torch
    import torch.distributed as dist

    model, optim = _state(world, width, layers)
    state = {"model": model, "optim": optim, "step": 1}
    expected = [t.clone() for t in _locals(model, optim)]
    nbytes = torch.tensor([sum(t.numel() * t.element_size() for t in expected)], dtype=torch.int64)
    dist.all_reduce(nbytes)

    def fresh(path: str) -> Callable[[], None]:
        def clear() -> None:  # nothing to replace, and no dirty pages carried into the timed save
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.sync()

        return clear

    def scramble() -> None:  # so a load that did nothing shows
        for t in _locals(model, optim):
            t.zero_()

    def check(tool: str) -> None:
        live = _locals(model, optim)  # looked up again: a load may replace the optimizer's tensors
        bad = len(live) != len(expected) or sum(not torch.equal(a, b) for a, b in zip(live, expected))
        if bad:
            raise AssertionError(f"rank {rank}: after the {tool} load, {bad} of {len(expected)} tensors differ")

    paths = {tool: f"{root}/{tool}-{source or world}" for tool in TOOLS}
    times: dict[str, list[float]] = {}
    for round_ in range(rounds + 1):  # the first round warms up (imports, first-call costs): not counted
        if round_ == 1:
            times.clear()
        if not source:
            times.setdefault("trainstate save", []).append(
                barrier_timed(lambda: trainstate.save(paths["trainstate"], state), fresh(paths["trainstate"]))
            )
            times.setdefault("dcp save", []).append(
                barrier_timed(lambda: _dcp_save(model, optim, paths["dcp"]), fresh(paths["dcp"]))
            )
        times.setdefault("trainstate load", []).append(
            barrier_timed(lambda: trainstate.load(paths["trainstate"], state), scramble)
        )
        check("trainstate")
        times.setdefault("dcp load", []).append(barrier_timed(lambda: _dcp_load(model, optim, paths["dcp"]), scramble))
        check("DCP")
    return {"times": times, "nbytes": int(nbytes.item())} if rank == 0 else None


def barrier_timed(fn: Callable[[], Any], before: Callable[[], Any] = lambda: None) -> float:
    """The slowest rank's seconds: ``before``, barrier, ``fn``, barrier."""
    import torch.distributed as dist

    before()
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _raw_disk(root: str, width: int, layers: int, rounds: int) -> dict[str, list[float]]:
    """A raw sequential write (with fsync) and read of the same state's bytes from one process."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import bench_core as core

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()
    state = {"model": model, "optim": optim, "step": 1}
    path = Path(root) / "raw"
    out: dict[str, list[float]] = {"raw write + fsync": [], "raw read": []}
    for _ in range(rounds):
        core.clean(path)
        start = time.perf_counter()
        core.save_raw(state, path, True)
        out["raw write + fsync"].append(time.perf_counter() - start)
        start = time.perf_counter()
        core.load_raw(state, path)
        out["raw read"].append(time.perf_counter() - start)
    core.clean(path)
    return out


def _run(world: int, *args: Any, worker: Callable[..., Any] = _worker) -> Any:
    sys.path.insert(0, str(ROOT / "tests"))
    import ranks  # tests/ranks.py: N spawned ranks in one gloo group on loopback

    results = ranks.run(world, worker, *args, timeout=3600)
    failed = [r for r in results if isinstance(r, (ranks.RankError, str))]
    if failed:
        raise RuntimeError(f"{world} ranks: " + "\n".join(getattr(r, "trace", str(r)) for r in failed))
    return results[0]


def bench_ranks(worlds: list[int], rounds: int, width: int, layers: int, directory: str | None) -> None:
    root = tempfile.mkdtemp(prefix="trainstate-dist-", dir=directory)
    try:
        results = {}
        for world in worlds:
            log(f"{world} rank(s): {rounds} rounds of save and load, each tool")
            results[str(world)] = _run(world, root, rounds, width, layers, 0)
        big = max(worlds)
        if big > 1:
            log(f"resharding: the {big}-rank checkpoints loaded on {big // 2} ranks")
            results[f"{big} → {big // 2}"] = _run(big // 2, root, rounds, width, layers, big)
        log("the disk: raw write + fsync and read from one process")
        raw = _raw_disk(root, width, layers, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = next(iter(results.values()))["nbytes"]
    print(report_ranks(results, raw, nbytes, rounds, root))


def report_ranks(results: dict[str, Any], raw: dict[str, list[float]], nbytes: int, rounds: int, root: str) -> str:
    gb = nbytes / 1e9
    cores = os.cpu_count() or 1
    most = max(int(k.split()[0]) for k in results)
    lines = [
        f"FSDP2 state of {gb:.2f} GB (parameters + AdamW moments, fp32) on {_cpu()} ({cores} cores), "
        f"gloo on CPU; seconds, median of {rounds} after a warm-up round (slowest rank; range in brackets). Page cache warm for "
        "loads (each reads what was just saved); both tools fsync their files (DCP's FileSystemWriter "
        "default; trainstate also fsyncs its directories).",
    ]
    if most > cores:
        lines.append(f"{most} ranks on {cores} cores oversubscribe the CPU: absolute throughput does not scale here.")
    lines += ["", "| ranks | operation | trainstate s | DCP s | trainstate GB/s | DCP GB/s | trainstate vs DCP |"]
    lines.append("|---|---|---:|---:|---:|---:|---|")
    for label, r in results.items():
        for op in OPS:
            ts, dcp = r["times"].get(f"trainstate {op}"), r["times"].get(f"dcp {op}")
            if ts is None or dcp is None:
                continue
            a, b = statistics.median(ts), statistics.median(dcp)
            what = f"{op} (resharding)" if "→" in label else op
            ratio = f"{b / a:.2f}x faster" if b >= a else f"{a / b:.2f}x slower"
            lines.append(
                f"| {label} | {what} | {a:.2f} [{min(ts):.2f}-{max(ts):.2f}] | {b:.2f} [{min(dcp):.2f}-{max(dcp):.2f}] "
                f"| {gb / a:.2f} | {gb / b:.2f} | {ratio} |"
            )
    for name, t in raw.items():
        m = statistics.median(t)
        lines.append(f"| 1 process | {name} (what the disk allows) | {m:.2f} | | {gb / m:.2f} | | |")
    load = os.getloadavg()
    lines += [
        "",
        f"Load average during the run (1/5/15 min, at the end): {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}.",
    ]
    return "\n".join(lines)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simulate", action="store_true", help="rank 0's part of a save, no processes")
    ap.add_argument("--ranks", help="simulate: one number (default 1024); else world sizes (default 1,2,4)")
    ap.add_argument("--tensors", type=int, default=1000, help="simulate: tensors per rank")
    ap.add_argument("--repeats", type=int, default=3, help="simulate: rounds")
    ap.add_argument("--rounds", type=int, default=3, help="real ranks: rounds of each operation")
    ap.add_argument("--width", type=int, default=2048, help="real ranks: each linear layer is width x width")
    ap.add_argument("--layers", type=int, default=8, help="real ranks: linear layers (8 x 2048^2: 0.40 GB)")
    ap.add_argument("--dir", help="real ranks: where checkpoints go (default: the temporary directory)")
    args = ap.parse_args()
    if args.simulate:
        report_simulation(int(args.ranks or 1024), args.tensors, args.repeats)
        return
    worlds = [int(x) for x in (args.ranks or "1,2,4").split(",")]
    bench_ranks(worlds, args.rounds, args.width, args.layers, args.dir)


if __name__ == "__main__":
    main()
