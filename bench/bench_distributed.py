"""Many ranks (issue 10): trainstate's collective save and load beside torch.distributed.checkpoint.

``--simulate``: rank 0's whole part of a save of R ranks x T tensors, no processes. Each rank holds one
row-shard of every tensor (FSDP) — or, in the second layout, every tensor whole (DDP: each box replicated
on every rank) — plus its own RNG state (three per-rank tensors). The stages are what rank 0 does between
the ranks' messages and the commit: unpickle the ranks' plans, plan (who writes what, checked), unpickle
what they wrote, merge it into one tensor table and tree, and encode the manifest; then what every rank of
a restore does first: parse the manifest, and check every tensor's entry (a rank holding a shard of each
tensor looks up all of them).

    .venv/bin/python bench/bench_distributed.py --simulate --ranks 1024 --tensors 1000
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import trainstate
from trainstate import _gc
from trainstate._distributed import per_rank
from trainstate._distributed.plan import RankPlan, assign
from trainstate._distributed.save import Written, merge
from trainstate._format import manifest
from trainstate._save.encode import encode_state
from trainstate._save.write import PIECE_BYTES, manifest_bytes

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simulate", action="store_true", required=True)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    report_simulation(args.ranks, args.tensors, args.repeats)


if __name__ == "__main__":
    main()
