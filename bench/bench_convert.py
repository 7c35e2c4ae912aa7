"""Export and import beside what a user writes by hand today, in one run, as ratios (issue 11, item 7).

State: a GPT-2-shaped model (bench_core's, 30 layers of 768: ~250M float32 parameters, ~1.0 GB, lm_head
tied to the token embedding) saved by trainstate as {"model": model, "optim": SGD, "step": 1}. Each
conversion runs in a fresh child process; the parent samples the child's anonymous memory (resident minus
file-backed pages, /proc/PID/statm) every 0.5 ms, so a file's page cache, mapped or written, is not
counted and the sampling costs the child nothing. Times are the conversion alone (imports excluded),
median of --repeats; every method's output files are fsynced (trainstate does it itself; the others get
os.fsync after they return). Sources are in the page cache (warm).

1. export to model.safetensors: trainstate.export vs trainstate.load + safetensors save_file
   (the tied lm_head dropped by hand, as save_file refuses shared tensors).
2. export to a torch.save file: trainstate.export(format="torch") vs trainstate.load + torch.save.
3. import model.safetensors: trainstate.import_checkpoint vs safetensors load_file + trainstate.save.
4. import a torch.distributed.checkpoint directory: trainstate.import_checkpoint vs DCP's own
   dcp_to_torch_save (DCP -> one torch.save file, what DCP offers for leaving DCP).

Run from the repo root:
    .venv/bin/python bench/bench_convert.py               # ~1 GB, ~3 min on 2 busy cores
    .venv/bin/python bench/bench_convert.py --gb 0.2      # a smaller model (fewer layers)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_core as core  # noqa: E402

import trainstate  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
PAGE = os.sysconf("SC_PAGE_SIZE")
LAYER_PARAMS = 12 * 768 * 768 + 13 * 768  # one GPT-2 block of width 768


def anonymous(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


def fsync_tree(path: Path) -> None:
    for p in [*sorted(path.rglob("*")), path] if path.is_dir() else [path]:
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() else 0))
        os.fsync(fd)
        os.close(fd)


def _weights(root: Path) -> dict[str, torch.Tensor]:
    """The model's tensors as trainstate.load gives them, the tied lm_head dropped (save_file refuses it)."""
    model = trainstate.load(root / "ckpt", framework="torch", include="model.*")["model"]
    return {k: v for k, v in model.items() if k != "lm_head.weight"}


def _load_save_file(root: Path) -> None:
    from safetensors.torch import save_file

    save_file(_weights(root), root / "out" / "model.safetensors", metadata={"format": "pt"})


def _load_torch_save(root: Path) -> None:
    torch.save(trainstate.load(root / "ckpt", framework="torch", include="model.*")["model"], root / "out" / "w.pt")


def _load_file_save(root: Path) -> None:
    from safetensors.torch import load_file

    trainstate.save(root / "out" / "ckpt", {"model": load_file(root / "src" / "model.safetensors")})


def _dcp_to_torch_save(root: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(root / "dcp", root / "out" / "w.pt")


METHODS: dict[str, Callable[[Path], None]] = {
    "trainstate.export": lambda r: trainstate.export(r / "ckpt", r / "out" / "hf"),
    "load + save_file": _load_save_file,
    "trainstate.export torch": lambda r: trainstate.export(r / "ckpt", r / "out" / "w.pt", format="torch"),
    "load + torch.save": _load_torch_save,
    "trainstate.import safetensors": lambda r: trainstate.import_checkpoint(
        r / "src" / "model.safetensors", r / "out" / "c"
    ),
    "load_file + trainstate.save": _load_file_save,
    "trainstate.import DCP": lambda r: trainstate.import_checkpoint(r / "dcp", r / "out" / "c"),
    "dcp_to_torch_save": _dcp_to_torch_save,
}
ROWS = [
    ("export -> model.safetensors", "trainstate.export", "load + save_file"),
    ("export -> torch.save file", "trainstate.export torch", "load + torch.save"),
    ("import model.safetensors", "trainstate.import safetensors", "load_file + trainstate.save"),
    ("import a DCP directory", "trainstate.import DCP", "dcp_to_torch_save"),
]


def child(name: str, root: Path) -> None:
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint.format_utils  # noqa: F401 - imports before the baseline

    print(anonymous(), flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    METHODS[name](root)
    out = root / "out"
    fsync_tree(out)
    print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


def measure(name: str, root: Path) -> tuple[float, int]:
    """(seconds, peak anonymous bytes) of one method in a fresh child."""
    shutil.rmtree(root / "out", ignore_errors=True)
    (root / "out").mkdir()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", name, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    base = int(proc.stdout.readline())
    peak = base
    proc.stdin.write("go\n")
    proc.stdin.flush()
    os.set_blocking(proc.stdout.fileno(), False)
    line = ""
    while not line and proc.poll() is None:
        peak = max(peak, anonymous(proc.pid))
        time.sleep(0.0005)
        line = proc.stdout.readline()
    os.set_blocking(proc.stdout.fileno(), True)
    line = line or proc.stdout.readline()
    proc.wait()
    if proc.returncode != 0 or not line:
        raise SystemExit(f"{name} failed in its child process")
    return json.loads(line)["seconds"], peak - base


def prepare(root: Path, gb: float) -> float:
    """The checkpoint, a model.safetensors and a DCP directory of the same model; returns the model's GB."""
    layers = max(1, round((gb * 1e9 / 4 - 50257 * 768 - 1024 * 768) / LAYER_PARAMS))
    torch.manual_seed(0)
    model = core.GPT2(core.Shape(layers, 50257, 1024))
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "step": 1}
    trainstate.save(root / "ckpt", state)
    trainstate.export(root / "ckpt", root / "src")
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=root / "dcp", no_dist=True)
    return sum(t.nbytes for k, t in model.state_dict().items() if k != "lm_head.weight") / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="model size in GB (default 1.0)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    root = Path(tempfile.mkdtemp(prefix="bench_convert-", dir=args.dir))
    try:
        gb = prepare(root, args.gb)
        print(f"model: {gb:.2f} GB; torch {torch.__version__}; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f}")
        results = {}
        for _ in range(args.repeats):
            for name in METHODS:
                results.setdefault(name, []).append(measure(name, root))
        print()
        print("| conversion | trainstate s | GB/s | peak MiB | other | s | GB/s | peak MiB | time other/trainstate |")
        print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
        for label, ours, theirs in ROWS:
            (s1, m1), (s2, m2) = (_median(results[ours]), _median(results[theirs]))
            print(
                f"| {label} | {s1:.2f} | {gb / s1:.2f} | {m1 / 2**20:.0f} | {theirs} | {s2:.2f} | {gb / s2:.2f} | "
                f"{m2 / 2**20:.0f} | {s2 / s1:.2f}x |"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _median(runs: list[tuple[float, int]]) -> tuple[float, int]:
    return statistics.median(r[0] for r in runs), int(statistics.median(r[1] for r in runs))


if __name__ == "__main__":
    main()
