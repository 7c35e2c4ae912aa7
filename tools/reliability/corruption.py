"""Corruption campaign: flip one byte of a committed checkpoint, check the damage is caught cleanly.

Each trial changes one byte of either a data file or ``manifest.json`` — half the trials flip a single
random bit, half xor the byte with a random non-zero value — then reads the checkpoint two ways:

- ``trainstate.load(path)`` (every tensor, checksums verified), and
- ``with trainstate.open(path) as ck: ck.verify()`` (data-file headers and every tensor).

The flip is **detected** when either raises a ``trainstate.CheckpointError`` and neither raises anything
else. Any other exception (a raw ``ValueError``, ``KeyError``, ``UnicodeDecodeError`` ... from inside) is
an **unclean error**, a failure of its own kind, reported with its position. A flip neither path notices
is **undetected**, reported with the file, offset, the bytes there, the region of the file it fell in
and whether the state still loads bit-identical (which would mean the byte cannot matter). The original
byte is put back after every trial.

Data-file trials hit the header region (length prefix, JSON, padding) half the time and a uniform
position in the whole file the other half: the header is a few hundred bytes of a file that is mostly
tensor bytes, and it is where the parsing happens.

Run: ``python -m tools.reliability.corruption --trials 5000`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import trainstate

from .common import Row, numpy_state

MANIFEST = "manifest.json"
NOTE_CAP = 25  # listed cases per category and row; the rest are counted


@dataclass
class Target:
    """One file of a saved checkpoint, with its pristine bytes and a map of what lives where."""

    ckpt: Path
    name: str
    original: bytes
    regions: list[tuple[int, int, str]] = field(default_factory=list)  # (begin, end, label), data files only

    @property
    def kind(self) -> str:
        return "manifest" if self.name == MANIFEST else "data"

    @property
    def path(self) -> Path:
        return self.ckpt / self.name

    @property
    def header_end(self) -> int:
        return self.regions[2][1] if self.kind == "data" else 0

    def region(self, offset: int) -> str:
        if self.kind == "manifest":
            return "manifest"
        for begin, end, label in self.regions:
            if begin <= offset < end:
                return label
        return "after the last entry (no reader uses it)"


@dataclass
class Outcome:
    verdict: str  # "detected", "undetected" or "unclean"
    errors: list[str]  # one line per read path that raised
    same_state: bool | None = None  # undetected only: does the damaged checkpoint load bit-identical?


@dataclass
class Case:
    target: Target
    offset: int
    mask: int
    outcome: Outcome

    def describe(self) -> str:
        t, o = self.target, self.offset
        before, after = t.original[o], t.original[o] ^ self.mask
        lo, hi = max(0, o - 12), min(len(t.original), o + 13)
        context = t.original[lo:hi]
        text = (
            f"{t.ckpt.name}/{t.name} @ {o} ({t.region(o)}): 0x{before:02x} -> 0x{after:02x} "
            f"(xor 0x{self.mask:02x}), around it {context!r}"
        )
        if self.outcome.verdict == "unclean":
            text += " — " + "; ".join(self.outcome.errors)
        elif self.outcome.same_state is not None:
            text += " — still loads bit-identical" if self.outcome.same_state else " — LOADS DIFFERENT VALUES"
        return text


# -- checkpoints ----------------------------------------------------------------------------------------


def _torch_state() -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step()
    return {"model": model, "optim": opt, "step": 1}


def make_checkpoints(root: Path, *, with_torch: bool | None = None, size: int = 1 << 16) -> list[Path]:
    """Save the campaign's checkpoints under ``root``: a NumPy one and, when torch imports, a torch one."""
    made = []
    path = root / "numpy"
    trainstate.save(path, numpy_state(7, size=size), metadata={"campaign": "corruption", "step": 7}, fsync=False)
    made.append(path)
    if with_torch is not False:
        state = _torch_state()
        if state is None and with_torch:
            raise RuntimeError("with_torch=True but torch does not import")
        if state is not None:
            path = root / "torch"
            trainstate.save(path, state, metadata={"campaign": "corruption", "framework": "torch"}, fsync=False)
            made.append(path)
    return made


def targets_of(ckpt: Path) -> list[Target]:
    """Every file of ``ckpt``, data files with their regions labelled."""
    out = []
    for p in sorted(ckpt.iterdir()):
        raw = p.read_bytes()
        t = Target(ckpt, p.name, raw)
        if p.name != MANIFEST:
            (n,) = struct.unpack("<Q", raw[:8])
            blob = raw[8 : 8 + n]
            json_end = 8 + len(blob.rstrip(b" "))
            t.regions = [
                (0, 8, "header length prefix"),
                (8, json_end, "header JSON"),
                (json_end, 8 + n, "header padding"),
            ]
            header = json.loads(blob)
            entries = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
            for (begin, end), name in entries:
                t.regions.append((8 + n + begin, 8 + n + end, f"tensor bytes of {name}"))
        out.append(t)
    return out


# -- one trial ------------------------------------------------------------------------------------------


def _load(path: Path) -> Any:
    return trainstate.load(path)


def _verify(path: Path) -> None:
    with trainstate.open(path) as ck:
        ck.verify()


def _same(a: Any, b: Any) -> bool:
    """Bit-identical trees: same types, same keys in the same order, same array bytes, dtypes and shapes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and a.shape == b.shape and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


def probe(path: Path, reference: Any = None) -> Outcome:
    """Read ``path`` both ways and classify what happened."""
    errors, clean, unclean = [], 0, 0
    for how, fn in (("load", _load), ("verify", _verify)):
        try:
            fn(path)
        except trainstate.CheckpointError as e:
            clean += 1
            errors.append(f"{how}: {type(e).__name__}: {str(e)[:160]}")
        except Exception as e:  # noqa: BLE001 - this is exactly what the campaign looks for
            unclean += 1
            errors.append(f"{how}: UNCLEAN {type(e).__name__}: {str(e)[:160]}")
    if unclean:
        return Outcome("unclean", errors)
    if clean:
        return Outcome("detected", errors)
    same = None
    if reference is not None:
        try:
            same = _same(_load(path), reference)
        except Exception:  # noqa: BLE001 - a flaky second read is itself worth seeing as "different"
            same = False
    return Outcome("undetected", errors, same)


def flip_and_probe(target: Target, offset: int, mask: int, reference: Any = None) -> Outcome:
    """xor the byte at ``offset`` of ``target`` with ``mask``, probe, and put the original byte back."""
    assert 0 < mask < 256
    fd = os.open(target.path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([target.original[offset] ^ mask]), offset)
        try:
            return probe(target.ckpt, reference)
        finally:
            os.pwrite(fd, target.original[offset : offset + 1], offset)
    finally:
        os.close(fd)


# -- the campaign ---------------------------------------------------------------------------------------


def run(trials: int = 5000, seed: int = 0, *, with_torch: bool | None = None) -> list[Row]:
    """Run ``trials`` single-byte flips; one Row per file kind ("data files", "manifest")."""
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="trainstate-corruption-") as tmp:
        ckpts = make_checkpoints(Path(tmp), with_torch=with_torch)
        references = {c: _load(c) for c in ckpts}
        for c in ckpts:  # the pristine checkpoints read cleanly, or every verdict below is meaningless
            if probe(c).verdict != "undetected":
                raise RuntimeError(f"pristine checkpoint {c} does not read cleanly: {probe(c).errors}")
        by_kind: dict[str, list[Target]] = {"data": [], "manifest": []}
        for c in ckpts:
            for t in targets_of(c):
                by_kind[t.kind].append(t)

        counts: dict[str, Counter[Any]] = {k: Counter() for k in by_kind}
        cases: dict[str, list[Case]] = {k: [] for k in by_kind}
        for i in range(trials):
            kind = "manifest" if rnd.random() < 0.5 else "data"
            target = rnd.choice(by_kind[kind])
            if kind == "data" and rnd.random() < 0.5:
                offset = rnd.randrange(target.header_end)
            else:
                offset = rnd.randrange(len(target.original))
            mask = 1 << rnd.randrange(8) if i % 2 == 0 else rnd.randrange(1, 256)
            outcome = flip_and_probe(target, offset, mask, references[target.ckpt])
            region = target.region(offset).split(" of ")[0]  # "tensor bytes of x" -> "tensor bytes"
            counts[kind][("trials", region)] += 1
            counts[kind][(outcome.verdict, region)] += 1
            if outcome.verdict == "detected" and not outcome.errors[0].startswith("load:"):
                counts[kind]["verify only"] += 1
            if outcome.verdict != "detected":
                cases[kind].append(Case(target, offset, mask, outcome))

        for t in (t for ts in by_kind.values() for t in ts):  # every byte went back
            if t.path.read_bytes() != t.original:
                raise RuntimeError(f"{t.path} was not restored")

    rows = []
    for kind, label in (("data", "data files"), ("manifest", "manifest.json")):
        c = counts[kind]
        verify_only = c.pop("verify only", 0)
        n = sum(v for (what, _), v in c.items() if what == "trials")
        detected = sum(v for (what, _), v in c.items() if what == "detected")
        regions = sorted({r for (_, r) in c})
        notes = [
            f"{len(ckpts)} checkpoints ({', '.join(p.name for p in ckpts)}); flips per region: "
            + ", ".join(f"{r} {c[('trials', r)]}" for r in regions),
            f"caught by load(): {detected - verify_only}; only by verify(): {verify_only}",
        ]
        for verdict in ("undetected", "unclean"):
            found = [k for k in cases[kind] if k.outcome.verdict == verdict]
            if not found:
                notes.append(f"{verdict}: 0")
                continue
            notes.append(
                f"{verdict}: {len(found)} ("
                + ", ".join(f"{r} {c[(verdict, r)]}" for r in regions if c[(verdict, r)])
                + ")"
            )
            notes += [f"  {k.describe()}" for k in found[:NOTE_CAP]]
            if len(found) > NOTE_CAP:
                notes.append(f"  ... and {len(found) - NOTE_CAP} more {verdict}")
        rows.append(Row(f"corruption: one flipped byte in {label}", n, detected, "detected", notes))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| campaign | trials | detected | rate |", "|---|---:|---:|---:|"]
    lines += [f"| {r.campaign} | {r.trials} | {r.passed} | {r.rate} |" for r in rows]
    for r in rows:
        lines.append("")
        lines.append(f"{r.campaign}:")
        lines += [f"- {n}" if not n.startswith("  ") else f"  - {n.strip()}" for n in r.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.reliability.corruption", description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch checkpoint")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rows = run(args.trials, args.seed, with_torch=False if args.no_torch else None)
    print(markdown(rows))
    print(f"\n{args.trials} trials in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
