"""Restore at line rate (issue 27): trainstate beside what users would otherwise use, in one run, as ratios.

Every comparison runs in interleaved rounds (each round runs every method once, in turn), so a busy machine
slows all of them alike; tables give medians, and ratios are the median of the per-round ratios with their
range. trainstate runs with its defaults (threads: this process's share of its cores), checksums on unless a
row says otherwise.

Sections (``--only`` picks some; all by default, ``gpu`` only where CUDA is present):

- ``cpu``: an LLM-shaped state (pairs of 2048x4096 and 4096x2048 fp32 matrices plus LayerNorms: 1.6 GB, 144
  tensors; ``--quick``: 0.2 GB) restored into the live CPU tensors: trainstate.load (verify on / off) vs
  safetensors ``load_file`` + ``copy_`` vs ``torch.load(mmap=True)`` + ``copy_``.
- ``gpu``: the same shapes with AdamW's two moments (4.8 GB, 432 tensors; ``--gpu-gb``) living on the GPU:
  trainstate.load vs safetensors ``load_file(device="cuda")`` + ``copy_`` vs
  ``torch.load(mmap=True, map_location="cuda")`` + ``copy_``, with GB/s and the host memory the ring took.
- ``open``: ``trainstate.open(p).read(name)`` vs ``safe_open(p).get_tensor(name)`` on a 600-tensor checkpoint.
- ``amplification``: 4 ranks (gloo) restore a replicated (DDP) state through a Storage that counts the bytes
  it serves (no memory map, so every byte is counted): bytes read / bytes in the checkpoint, shared reads
  (the default) vs ``collective=False``; on the local disk, and on S3 (a moto server on loopback) where
  moto and s3fs are installed.
- ``cold``: the page cache dropped before every run (needs root): trainstate.load vs one thread reading the
  checkpoint's files front to back.
- ``save``: the CPU state saved with and without fsync: trainstate.save vs safetensors ``save_file`` (no
  regression: saving must stay ahead).
- ``tiny``: 50,000 tensors of 4 floats (``--quick``: 5,000): save and in-place load, microseconds per tensor.

Run from the repo root:
    python bench/bench_restore.py                 # ~4 min on a 2-core machine
    python bench/bench_restore.py --quick         # small states, ~1 min
    python bench/bench_restore.py --only gpu      # on a GPU host (bench/device_suite.sh runs it)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors.torch import load_file, save_file

import trainstate
from trainstate import _cores

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools.s3_server, from the repo root
GB = 1e9
SECTIONS = ("cpu", "gpu", "open", "amplification", "cold", "save", "tiny")


# -- timing --------------------------------------------------------------------------------------------


def rounds(
    methods: dict[str, Callable[[], Any]], n: int, before: Callable[[], Any] = lambda: None
) -> dict[str, list[float]]:
    """Seconds per method per round; the methods run in turn within each round, after one warm-up each."""
    for fn in methods.values():
        before()
        fn()
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(n):
        for k, fn in methods.items():
            before()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def ratio(times: dict[str, list[float]], num: str, den: str) -> tuple[float, float, float]:
    """Median and range over rounds of num / den: how many times faster ``den`` ran."""
    r = sorted(a / b for a, b in zip(times[num], times[den]))
    return statistics.median(r), r[0], r[-1]


def table(title: str, times: dict[str, list[float]], base: str, nbytes: float | None = None) -> list[str]:
    gbs = " | GB/s" if nbytes else ""
    out = [f"### {title}", "", f"| method | median ms | range{gbs} | method / {base}: median [range] |"]
    out.append("|---|---:|---:|" + ("---:|" if nbytes else "") + "---|")
    for k, v in times.items():
        med, lo, hi = ratio(times, k, base)
        rate = f" | {nbytes / statistics.median(v) / GB:.1f}" if nbytes else ""
        out.append(
            f"| {k} | {statistics.median(v) * 1e3:.2f} | {min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}{rate} "
            f"| {med:.2f}x [{lo:.2f}-{hi:.2f}] |"
        )
    return [*out, ""]


class Report:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.targets: list[str] = []

    def target(self, text: str, value: tuple[float, float, float], ok: bool) -> None:
        med, lo, hi = value
        self.targets.append(f"- {'PASS' if ok else 'MISS'}  {text}: {med:.2f}x [{lo:.2f}-{hi:.2f}]")


# -- states --------------------------------------------------------------------------------------------


def llm_state(layers: int, moments: bool, device: str = "cpu") -> dict[str, dict[str, torch.Tensor]]:
    """``layers`` pairs of 2048x4096 / 4096x2048 fp32 matrices with four LayerNorm vectors each (6 tensors a
    layer, 67 MB), plus AdamW's exp_avg and exp_avg_sq of each when ``moments``."""
    g = torch.Generator(device=device).manual_seed(0)
    weights: dict[str, torch.Tensor] = {}
    for i in range(layers):
        weights[f"h{i}.up"] = torch.randn(2048, 4096, generator=g, device=device)
        weights[f"h{i}.down"] = torch.randn(4096, 2048, generator=g, device=device)
        for ln in ("ln1", "ln2"):
            weights[f"h{i}.{ln}.w"] = torch.randn(2048, generator=g, device=device)
            weights[f"h{i}.{ln}.b"] = torch.randn(2048, generator=g, device=device)
    state = {"model": weights}
    if moments:
        state["exp_avg"] = {k: torch.randn_like(v) for k, v in weights.items()}
        state["exp_avg_sq"] = {k: torch.rand_like(v) for k, v in weights.items()}
    return state


def flat(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{g}.{k}": t for g, d in state.items() for k, t in d.items()}


def nbytes_of(state: dict[str, dict[str, torch.Tensor]]) -> int:
    return sum(t.nbytes for t in flat(state).values())


def save_all(state: dict[str, dict[str, torch.Tensor]], root: Path) -> tuple[Path, Path, Path]:
    """The state as a trainstate checkpoint, a safetensors file and a torch.save file."""
    ts, st, pt = root / "ts", root / "state.safetensors", root / "state.pt"
    trainstate.save(ts, state, fsync=False, overwrite=True)
    host = {k: t.cpu() for k, t in flat(state).items()}
    save_file(host, st)
    torch.save(host, pt)
    return ts, st, pt


def copy_into(live: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, t in live.items():
            t.copy_(loaded[k], non_blocking=True)
    if any(t.is_cuda for t in live.values()):
        torch.cuda.synchronize()


def check_equal(live: dict[str, torch.Tensor], want: dict[str, torch.Tensor], who: str) -> None:
    for k, t in live.items():
        if not torch.equal(t.cpu(), want[k]):
            raise SystemExit(f"{who} did not restore {k}")


# -- sections ------------------------------------------------------------------------------------------


def section_cpu(r: Report, root: Path, args: argparse.Namespace) -> None:
    state = llm_state(3 if args.quick else 24, moments=False)
    live, n = flat(state), nbytes_of(state)
    ts, st, pt = save_all(state, root)
    want = {k: t.clone() for k, t in live.items()}
    methods = {
        "trainstate.load": lambda: trainstate.load(ts, state),
        "trainstate.load verify=False": lambda: trainstate.load(ts, state, verify=False),
        "safetensors load_file + copy_": lambda: copy_into(live, load_file(st)),
        "torch.load(mmap) + copy_": lambda: copy_into(live, torch.load(pt, mmap=True, weights_only=True)),
        f"memory copy, {_cores.DEFAULT_THREADS} threads (the floor)": memcpy(live),
    }
    for name, fn in methods.items():
        for t in live.values():
            t.zero_()
        fn()
        check_equal(live, want, name)
    times = rounds(methods, args.rounds)
    title = f"CPU restore into the live state: {n / GB:.2f} GB, {len(live)} tensors, {_cores.DEFAULT_THREADS} threads"
    r.lines += table(title, times, "trainstate.load", n)
    need = 1.0 if _cores.DEFAULT_THREADS >= 8 else 0.9
    on = ratio(times, "safetensors load_file + copy_", "trainstate.load")
    off = ratio(times, "safetensors load_file + copy_", "trainstate.load verify=False")
    r.target(
        f"CPU restore, verify on, >= {need}x safetensors + copy_ ({_cores.DEFAULT_THREADS} threads)", on, on[0] >= need
    )
    if need == 1.0:
        r.target("CPU restore, verify off, >= 1.3x safetensors + copy_", off, off[0] >= 1.3)
    else:
        r.lines.append(f"(verify off: {off[0]:.2f}x safetensors + copy_; the 1.3x target is for a 16-core host)\n")
    for p in (ts, st, pt):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def memcpy(live: dict[str, torch.Tensor]) -> Callable[[], None]:
    """A plain copy of the same bytes from a second copy of the state, split by bytes over the default threads."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    pairs = [(t.clone().numpy(), t.numpy()) for t in live.values()]
    lanes = max(1, _cores.DEFAULT_THREADS)
    total = sum(a.nbytes for a, _ in pairs)
    cuts, acc = [[] for _ in range(lanes)], 0  # type: list[list[tuple[Any, Any]]], int
    for a, b in pairs:
        cuts[min(lanes - 1, acc * lanes // max(1, total))].append((a, b))
        acc += a.nbytes
    pool = ThreadPoolExecutor(lanes)

    def lane(work: list[tuple[Any, Any]]) -> None:
        for a, b in work:
            np.copyto(b, a)

    return lambda: [f.result() for f in [pool.submit(lane, w) for w in cuts]] and None


def section_gpu(r: Report, root: Path, args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        r.lines += ["### GPU restore: skipped, no CUDA device", ""]
        return
    from trainstate._frameworks import torch as torch_adapter

    layers = max(1, round(args.gpu_gb * GB / (3 * 67.2e6)))
    state = llm_state(layers, moments=True, device="cuda")
    live, n = flat(state), nbytes_of(state)
    ts, st, pt = save_all(state, root)
    want = {k: t.cpu() for k, t in live.items()}
    pinned: list[int] = []
    real = torch_adapter.staging
    torch_adapter.staging = lambda size, like: pinned.append(size) or real(size, like)  # type: ignore[assignment]

    def ts_load(verify: bool = True) -> None:
        trainstate.load(ts, state, verify=verify)
        torch.cuda.synchronize()

    methods = {
        "trainstate.load": ts_load,
        "trainstate.load verify=False": lambda: ts_load(False),
        'safetensors load_file(device="cuda") + copy_': lambda: copy_into(live, load_file(st, device="cuda")),
        'torch.load(mmap, map_location="cuda") + copy_': lambda: copy_into(
            live, torch.load(pt, mmap=True, weights_only=True, map_location="cuda")
        ),
    }
    for name, fn in methods.items():
        for t in live.values():
            t.zero_()
        pinned.clear()
        fn()
        check_equal(live, want, name)
        if name == "trainstate.load":
            r.lines.append(
                f"- host staging of one trainstate.load onto the GPU: {sum(pinned) / 2**20:.0f} MiB pinned\n"
            )
    torch_adapter.staging = real  # type: ignore[assignment]
    times = rounds(methods, args.rounds)
    r.lines += table(
        f"GPU restore into the live CUDA state: {n / GB:.2f} GB, {len(live)} tensors", times, "trainstate.load", n
    )
    s = ratio(times, 'safetensors load_file(device="cuda") + copy_', "trainstate.load")
    t = ratio(times, 'torch.load(mmap, map_location="cuda") + copy_', "trainstate.load")
    rate = n / statistics.median(times["trainstate.load"]) / GB
    r.target("GPU restore >= 2x safetensors(device=cuda)", s, s[0] >= 2)
    r.target("GPU restore >= 1.5x torch.load(mmap, cuda)", t, t[0] >= 1.5)
    r.targets.append(f"- {'PASS' if rate >= 20 else 'MISS'}  GPU restore >= 20 GB/s: {rate:.1f} GB/s")
    live.clear()
    state.clear()
    torch.cuda.empty_cache()


def section_open(r: Report, root: Path, args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.w": torch.randn(64, 64, generator=g) for i in range(600)}
    trainstate.save(root / "open-ts", {"model": tensors}, fsync=False, overwrite=True)
    save_file(tensors, root / "open.safetensors")

    def ts() -> Any:
        with trainstate.open(root / "open-ts") as ck:
            return ck.read("model.layer300.w")

    def st() -> Any:
        with safetensors.safe_open(root / "open.safetensors", framework="pt") as f:
            return f.get_tensor("layer300.w")

    assert torch.equal(torch.from_numpy(ts().copy()), st())
    times = rounds({"trainstate open + read": ts, "safe_open + get_tensor": st}, max(30, args.rounds * 5))
    r.lines += table(
        "open + read one 64x64 tensor of a 600-tensor checkpoint (checksum verified)", times, "safe_open + get_tensor"
    )
    v = ratio(times, "trainstate open + read", "safe_open + get_tensor")
    r.target("open + read one tensor <= 2x safe_open", v, v[0] <= 2)


def section_amplification(r: Report, root: Path, args: argparse.Namespace) -> None:
    import multiprocessing as mp

    world = 4
    places: list[tuple[str, str, str | None]] = [("local disk", str(root / "amp"), None)]
    server = None
    try:
        from tools.s3_server import MotoServer

        server = MotoServer().__enter__()
        server.create_bucket("bench")
        places.append(("s3 (moto on loopback)", f"s3://bench/{uuid.uuid4().hex[:8]}/amp", server.endpoint))
    except Exception as e:  # noqa: BLE001 - moto or s3fs missing: the local rows only
        r.lines.append(f"(s3 rows skipped: {type(e).__name__}: {e})\n")
    try:
        out = ["### Read amplification: 4 ranks (gloo) restoring a replicated state", ""]
        out += [
            "| storage | bytes in the checkpoint | shared reads (default) | collective=False |",
            "|---|---:|---:|---:|",
        ]
        for label, url, endpoint in places:
            ctx = mp.get_context("spawn")
            store = root / f"store-{uuid.uuid4().hex[:6]}"
            with ctx.Pool(world) as pool:
                got = pool.starmap(
                    _amp_rank, [(rank, world, str(store), url, endpoint, args.quick) for rank in range(world)]
                )
            total = got[0][0]
            shared = sum(g[1] for g in got) / total
            alone = sum(g[2] for g in got) / total
            out.append(f"| {label} | {total / 1e6:.1f} MB | {shared:.3f} | {alone:.3f} |")
            r.targets.append(
                f"- {'PASS' if shared <= 1.05 else 'MISS'}  read amplification, 4 ranks, {label} <= 1.05: {shared:.3f}"
            )
        r.lines += [*out, ""]
    finally:
        if server is not None:
            server.__exit__()


def _amp_rank(rank: int, world: int, store: str, url: str, endpoint: str | None, quick: bool) -> tuple[int, int, int]:
    """One rank: a collective save of a replicated state, then a shared and an unshared restore through a
    counting storage. Returns (tensor bytes in the checkpoint, bytes this rank read shared, and alone)."""
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent.parent))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        state = {"model": {f"w{i}": torch.randn(256 if quick else 1024, 256, generator=g) for i in range(24)}}
        trainstate.save(url, state, storage=_storage(endpoint), fsync=False)
        counted = _storage(endpoint)
        read = _counting(counted)
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        trainstate.load(url, target, storage=counted)
        shared = read[0]
        read[0] = 0
        trainstate.load(url, target, storage=counted, collective=False)
        alone = read[0]
        for k, v in state["model"].items():
            assert torch.equal(target["model"][k], v)
        return sum(v.nbytes for v in state["model"].values()), shared, alone
    finally:
        dist.destroy_process_group()


def _storage(endpoint: str | None) -> trainstate.Storage:
    if endpoint is None:
        return trainstate.LocalStorage()
    import s3fs
    from tools.s3_server import S3_KEY, S3_REGION, S3_SECRET

    from trainstate._storage.fsspec import FsspecStorage

    fs = s3fs.S3FileSystem(
        key=S3_KEY, secret=S3_SECRET, endpoint_url=endpoint, client_kwargs={"region_name": S3_REGION}
    )
    return FsspecStorage(fs)


def _counting(storage: Any) -> list[int]:
    """Make ``storage`` count the tensor bytes it reads (a header read starts at 0) and map nothing, so that
    every byte read goes through ``read_into``; returns the counter."""
    read = storage.read_into
    counted = [0]

    def read_into(path: str, offset: int, out: memoryview) -> int:
        n = int(read(path, offset, out))
        if path.endswith(".safetensors") and offset > 0:
            counted[0] += n
        return n

    storage.read_into = read_into
    storage.map = lambda path: None
    return counted


def section_cold(r: Report, root: Path, args: argparse.Namespace) -> None:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        r.lines += ["### Cold restore: skipped (dropping the page cache needs root)", ""]
        return
    state = llm_state(2 if args.quick else 12, moments=False)
    ts = root / "cold-ts"
    trainstate.save(ts, state, fsync=True, overwrite=True)
    buf = memoryview(bytearray(16 << 20))

    def sequential() -> None:
        for f in sorted(ts.iterdir()):
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass

    def drop() -> None:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")

    times = rounds(
        {"trainstate.load": lambda: trainstate.load(ts, state), "sequential read of its files": sequential},
        max(3, args.rounds // 2),
        drop,
    )
    r.lines += table(
        f"Cold restore (page cache dropped before each run), {nbytes_of(state) / GB:.2f} GB",
        times,
        "trainstate.load",
        nbytes_of(state),
    )
    v = ratio(times, "sequential read of its files", "trainstate.load")
    r.target("cold restore >= 0.9x a plain sequential read", v, v[0] >= 0.9)


def section_save(r: Report, root: Path, args: argparse.Namespace) -> None:
    state = llm_state(3 if args.quick else 24, moments=False)
    host = flat(state)
    out = root / "saved"

    def fresh() -> None:  # nothing to replace, and no dirty pages carried into the next save
        shutil.rmtree(out, ignore_errors=True)
        os.sync()

    def st(fsync: bool) -> None:
        out.mkdir(exist_ok=True)
        save_file(host, out / "state.safetensors")
        if fsync:
            fd = os.open(out / "state.safetensors", os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    for fsync in (False, True):
        times = rounds(
            {
                "trainstate.save": lambda f=fsync: trainstate.save(out, state, fsync=f),
                "safetensors save_file": lambda f=fsync: st(f),
            },
            max(3, args.rounds // 2),
            fresh,
        )
        r.lines += table(
            f"save {nbytes_of(state) / GB:.2f} GB, {'with' if fsync else 'no'} fsync",
            times,
            "trainstate.save",
            nbytes_of(state),
        )
        v = ratio(times, "safetensors save_file", "trainstate.save")
        r.target(f"save ({'fsync' if fsync else 'no fsync'}) at or above safetensors", v, v[0] >= 1)


def section_tiny(r: Report, root: Path, args: argparse.Namespace) -> None:
    count = 5_000 if args.quick else 50_000
    tiny = {f"g{g}": {f"t{i}": torch.full((4,), float(g * 100 + i)) for i in range(100)} for g in range(count // 100)}
    live = flat(tiny)
    tts, tst = root / "tiny-ts", root / "tiny.safetensors"
    methods = {
        "trainstate.save": lambda: trainstate.save(tts, tiny, fsync=False, overwrite=True),
        "safetensors save_file": lambda: save_file(live, tst),
        "trainstate.load": lambda: trainstate.load(tts, tiny),
        "safetensors load_file + copy_": lambda: copy_into(live, load_file(tst)),
    }
    times = rounds(methods, max(3, args.rounds // 2))
    per = {k: [x / count for x in v] for k, v in times.items()}
    r.lines += table(
        f"{count:,} tiny tensors (ms per 1,000 tensors = us per tensor)",
        {k: [x * 1e3 for x in v] for k, v in per.items()},
        "trainstate.load",
    )
    for what, a, b in (
        ("save", "trainstate.save", "safetensors save_file"),
        ("load", "trainstate.load", "safetensors load_file + copy_"),
    ):
        v = ratio(times, a, b)
        r.target(f"tiny tensors: {what} within 2x of safetensors (trainstate / safetensors)", v, v[0] <= 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, help="parent for the checkpoints (default /tmp; not tmpfs)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small states")
    ap.add_argument("--gpu-gb", type=float, default=4.8, help="size of the GPU state (default 4.8 GB)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    args = ap.parse_args()
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    root = Path(tempfile.mkdtemp(prefix="trainstate-bench-rate-", dir=args.dir or "/tmp"))
    r = Report()
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    r.lines += [
        f"# trainstate restore at line rate ({'quick' if args.quick else 'full'}, {args.rounds} interleaved rounds)",
        "",
        f"- machine: {_cores.usable_cores()} usable cores, {cuda}; torch {torch.__version__}, safetensors "
        f"{safetensors.__version__}, trainstate {trainstate.__version__}; default threads {_cores.DEFAULT_THREADS}",
        f"- 1-min load average at start: {os.getloadavg()[0]:.2f}",
        "",
    ]
    try:
        for name in wanted:
            globals()[f"section_{name}"](r, root, args)
            print(f"[{name} done]", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r.lines.append(f"- 1-min load average at end: {os.getloadavg()[0]:.2f}\n")
    print("\n".join([*r.lines, "### targets", "", *r.targets]))


if __name__ == "__main__":
    main()
