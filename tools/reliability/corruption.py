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

Each run is for a flavor (common.FLAVORS): compressed and encrypted checkpoints are flipped the same way;
an encrypted one is read with its key, and a third read, ``load(verify=False)``, skips every checksum so
that a flip in a chunk's stored bytes must be caught by the chunk's AES-GCM tag alone. A flip in an
encrypted manifest that leaves it a well-formed encrypted manifest (valid JSON, the same ``encryption``
object and checksum form) must be reported as ``TamperedCheckpointError`` by the MAC; any other error
there is **misclassified**, as is damage anywhere reported as a key that does not fit (an
``EncryptionKeyError``: the key given is always the right one, and a manager stops on such an error
instead of falling back to an older checkpoint). An incremental flavor saves a run of two checkpoints through a manager (a
frozen tensor shared through the pool, the rest written again): its data files are the pool files, and a
flip is probed through a checkpoint that uses the flipped byte (bytes of a pool file that only the other
checkpoint uses are drawn again).

Run: ``python -m tools.reliability.corruption --trials 5000 [--flavor NAME]`` from the repository root.
"""

from __future__ import annotations

import argparse
import copy
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

from .common import FLAVORS, PLAIN, Flavor, Row, must_be_tampered, numpy_state, save_steps

MANIFEST = "manifest.json"
NOTE_CAP = 25  # listed cases per category and row; the rest are counted


@dataclass
class Target:
    """One file of a saved checkpoint, with its pristine bytes and a map of what lives where."""

    ckpt: Path
    name: str
    original: bytes
    regions: list[tuple[int, int, str]] = field(default_factory=list)  # (begin, end, label), data files only
    pool: bool = False  # a pool file of an incremental run: in ckpt/../_shared, not in the checkpoint
    used: list[tuple[int, int]] = field(default_factory=list)  # stored byte ranges of the chunks ckpt reads

    @property
    def kind(self) -> str:
        return "manifest" if self.name == MANIFEST else "data"

    @property
    def path(self) -> Path:
        return self.ckpt.parent / "_shared" / self.name if self.pool else self.ckpt / self.name

    def unused(self, offset: int) -> bool:
        """A byte of the data section that no chunk of ``ckpt`` reads (a pool file shared with another
        checkpoint holds tensors only that one uses): no read of ``ckpt`` can notice a flip there."""
        return self.kind == "data" and offset >= self.header_end and not any(b <= offset < e for b, e in self.used)

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
    verdict: str  # "detected", "undetected", "unclean" or "misclassified" (a clean error of the wrong class)
    errors: list[str]  # one line per read path that raised
    same_state: bool | None = None  # undetected only: does the damaged checkpoint load bit-identical?
    tag: str | None = None  # encrypted flavors: the error load(verify=False) raised (the AES-GCM tag's)


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
        where = (
            f"{t.ckpt.parent.name}/_shared/{t.name} (read through {t.ckpt.name})"
            if t.pool
            else f"{t.ckpt.name}/{t.name}"
        )
        text = (
            f"{where} @ {o} ({t.region(o)}): 0x{before:02x} -> 0x{after:02x} "
            f"(xor 0x{self.mask:02x}), around it {context!r}"
        )
        if self.outcome.verdict in ("unclean", "misclassified"):
            text += " — " + "; ".join(self.outcome.errors)
        elif self.outcome.same_state is not None:
            text += " — still loads bit-identical" if self.outcome.same_state else " — LOADS DIFFERENT VALUES"
        return text


# -- checkpoints ----------------------------------------------------------------------------------------


def _torch_state(steps: int = 1) -> dict[str, Any] | None:
    """A small model and its AdamW state after ``steps`` steps; its first layer is frozen from the second step
    on (an incremental run shares it)."""
    try:
        import torch
    except ImportError:
        return None
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step()
    if steps == 1:
        return {"model": model, "optim": opt, "step": 1}
    head = torch.nn.Linear(4, 2)
    head_opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    states = []
    for step in range(1, steps + 1):
        head(model(torch.randn(5, 8)).detach()).pow(2).mean().backward()
        head_opt.step()
        head_opt.zero_grad()
        live = {"model": model, "head": head, "optim": opt, "head_optim": head_opt, "step": step}
        states.append(copy.deepcopy(live))  # this step's values: the objects train on
    return {"steps": states}


def make_checkpoints(
    root: Path, *, with_torch: bool | None = None, size: int = 1 << 16, flavor: Flavor = PLAIN
) -> list[Path]:
    """Save the campaign's checkpoints under ``root``: a NumPy one and, when torch imports, a torch one.

    An incremental flavor saves each as a run of two checkpoints that share their frozen tensors, and
    returns both.
    """
    if flavor.incremental:
        return _make_runs(root, with_torch=with_torch, size=size, flavor=flavor)
    made = []
    path = root / "numpy"
    trainstate.save(
        path,
        numpy_state(7, size=size),
        metadata={"campaign": "corruption", "step": 7},
        fsync=False,
        **flavor.save_kwargs(),
    )
    made.append(path)
    if with_torch is not False:
        state = _torch_state()
        if state is None and with_torch:
            raise RuntimeError("with_torch=True but torch does not import")
        if state is not None:
            path = root / "torch"
            trainstate.save(
                path,
                state,
                metadata={"campaign": "corruption", "framework": "torch"},
                fsync=False,
                **flavor.save_kwargs(),
            )
            made.append(path)
    return made


def _make_runs(root: Path, *, with_torch: bool | None, size: int, flavor: Flavor) -> list[Path]:
    """The incremental flavor's checkpoints: two saves of a run per framework, sharing what did not change."""
    made = save_steps(
        root / "numpy",
        [(step, numpy_state(step, size=size, frozen=True)) for step in (6, 7)],
        flavor,
        {"campaign": "corruption"},
    )
    if with_torch is not False:
        states = _torch_state(steps=2)
        if states is None and with_torch:
            raise RuntimeError("with_torch=True but torch does not import")
        if states is not None:
            steps = [(s["step"], s) for s in states["steps"]]
            made += save_steps(root / "torch", steps, flavor, {"campaign": "corruption", "framework": "torch"})
    return made


def targets_of(ckpt: Path) -> list[Target]:
    """Every file of ``ckpt`` (its pool files included), data files with their regions labelled and the
    byte ranges its chunks read listed."""
    body = json.loads((ckpt / MANIFEST).read_bytes())
    pooled = {f["path"] for f in body["files"] if f.get("pool")}
    used: dict[str, list[tuple[int, int]]] = {}
    for entry in body["tensors"].values():
        for c in entry["chunks"]:
            used.setdefault(c["file"], []).append((c["byte_range"][0], c["byte_range"][1]))
    out = []
    paths = [ckpt / MANIFEST] + [
        (ckpt.parent / "_shared" / f["path"]) if f["path"] in pooled else ckpt / f["path"] for f in body["files"]
    ]
    for p in sorted(paths, key=lambda p: p.name):
        raw = p.read_bytes()
        t = Target(ckpt, p.name, raw, pool=p.name in pooled, used=used.get(p.name, []))
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


def _load(path: Path, **kwargs: Any) -> Any:
    return trainstate.load(path, **kwargs)


def _verify(path: Path, **kwargs: Any) -> None:
    with trainstate.open(path, **kwargs) as ck:
        ck.verify()


def _tag_only(path: Path, **kwargs: Any) -> Any:
    """Read every tensor with no checksum checked: only an encrypted chunk's AES-GCM tag can object."""
    return trainstate.load(path, verify=False, **kwargs)


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


def probe(path: Path, reference: Any = None, flavor: Flavor = PLAIN, expect: str | None = None) -> Outcome:
    """Read ``path`` both ways (three for an encrypted flavor) and classify what happened.

    ``expect``: the error class every read must raise (an encrypted manifest's MAC: Tampered...), if known.
    """
    errors, clean, unclean, wrong = [], 0, 0, 0
    kwargs = flavor.open_kwargs()
    reads: list[tuple[str, Any]] = [("load", _load), ("verify", _verify)]
    if flavor.key is not None:
        reads.append(("tag", _tag_only))
    tag: str | None = None
    for how, fn in reads:
        try:
            fn(path, **kwargs)
        except trainstate.CheckpointError as e:
            clean += 1
            errors.append(f"{how}: {type(e).__name__}: {str(e)[:160]}")
            if how == "tag":
                tag = type(e).__name__
            if isinstance(e, trainstate.EncryptionKeyError):  # the key is right: a manager would stop on it
                wrong += 1
                errors[-1] += " (damage read as a key that does not fit)"
            elif expect is not None and type(e).__name__ != expect:
                wrong += 1
                errors[-1] += f" (expected {expect})"
        except Exception as e:  # noqa: BLE001 - this is exactly what the campaign looks for
            unclean += 1
            errors.append(f"{how}: UNCLEAN {type(e).__name__}: {str(e)[:160]}")
        else:
            if expect is not None:
                wrong += 1
                errors.append(f"{how}: no error (expected {expect})")
    if unclean:
        return Outcome("unclean", errors)
    if wrong and clean:
        return Outcome("misclassified", errors)
    if clean:
        return Outcome("detected", errors, tag=tag)
    same = None
    if reference is not None:
        try:
            same = _same(_load(path, **kwargs), reference)
        except Exception:  # noqa: BLE001 - a flaky second read is itself worth seeing as "different"
            same = False
    return Outcome("undetected", errors, same)


def expected_error(target: Target, offset: int, mask: int, flavor: Flavor) -> str | None:
    """The error a flip must give when it can be told in advance: a flip in an encrypted manifest that
    leaves it well-formed gets past every check before the MAC, so the MAC must report it."""
    if flavor.key is None or target.kind != "manifest":
        return None
    damaged = bytearray(target.original)
    damaged[offset] ^= mask
    return "TamperedCheckpointError" if must_be_tampered(bytes(damaged), target.original) else None


def flip_and_probe(target: Target, offset: int, mask: int, reference: Any = None, flavor: Flavor = PLAIN) -> Outcome:
    """xor the byte at ``offset`` of ``target`` with ``mask``, probe, and put the original byte back."""
    assert 0 < mask < 256
    expect = expected_error(target, offset, mask, flavor)
    fd = os.open(target.path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([target.original[offset] ^ mask]), offset)
        try:
            return probe(target.ckpt, reference, flavor, expect)
        finally:
            os.pwrite(fd, target.original[offset : offset + 1], offset)
    finally:
        os.close(fd)


# -- the campaign ---------------------------------------------------------------------------------------


def run(trials: int = 5000, seed: int = 0, *, with_torch: bool | None = None, flavor: Flavor = PLAIN) -> list[Row]:
    """Run ``trials`` single-byte flips; one Row per file kind ("data files", "manifest"), and for an
    encrypted flavor one for the flips in tensor bytes read with no checksum (the AES-GCM tag alone)."""
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="trainstate-corruption-") as tmp:
        ckpts = make_checkpoints(Path(tmp), with_torch=with_torch, flavor=flavor)
        kwargs = flavor.open_kwargs()
        references = {c: _load(c, **kwargs) for c in ckpts}
        for c in ckpts:  # the pristine checkpoints read cleanly, or every verdict below is meaningless
            if probe(c, flavor=flavor).verdict != "undetected":
                raise RuntimeError(f"pristine checkpoint {c} does not read cleanly: {probe(c, flavor=flavor).errors}")
        by_kind: dict[str, list[Target]] = {"data": [], "manifest": []}
        for c in ckpts:
            for t in targets_of(c):
                by_kind[t.kind].append(t)

        counts: dict[str, Counter[Any]] = {k: Counter() for k in by_kind}
        cases: dict[str, list[Case]] = {k: [] for k in by_kind}
        tag: Counter[str] = Counter()  # encrypted: what load(verify=False) said of flips in stored chunk bytes
        errors: Counter[str] = Counter()  # encrypted: the error classes of manifest flips
        redrawn = 0
        for i in range(trials):
            kind = "manifest" if rnd.random() < 0.5 else "data"
            while True:
                target = rnd.choice(by_kind[kind])
                if kind == "data" and rnd.random() < 0.5:
                    offset = rnd.randrange(target.header_end)
                else:
                    offset = rnd.randrange(len(target.original))
                if not target.unused(offset):
                    break
                redrawn += 1  # only the other checkpoint of an incremental run reads it: drawn again
            mask = 1 << rnd.randrange(8) if i % 2 == 0 else rnd.randrange(1, 256)
            outcome = flip_and_probe(target, offset, mask, references[target.ckpt], flavor)
            region = target.region(offset).split(" of ")[0]  # "tensor bytes of x" -> "tensor bytes"
            counts[kind][("trials", region)] += 1
            counts[kind][(outcome.verdict, region)] += 1
            if outcome.verdict == "detected" and not outcome.errors[0].startswith("load:"):
                counts[kind]["verify only"] += 1
            if outcome.verdict != "detected":
                cases[kind].append(Case(target, offset, mask, outcome))
            if flavor.key is not None and kind == "data" and offset >= target.header_end:
                tag[outcome.tag or "none"] += 1
                if outcome.verdict == "detected" and outcome.tag is None:
                    cases["tag"] = [*cases.get("tag", []), Case(target, offset, mask, outcome)]
            if flavor.key is not None and kind == "manifest":
                errors[outcome.errors[0].split(":")[1].strip() if outcome.errors else "none"] += 1

        for t in (t for ts in by_kind.values() for t in ts):  # every byte went back
            if t.path.read_bytes() != t.original:
                raise RuntimeError(f"{t.path} was not restored")

    rows = []
    names = ", ".join(str(p.relative_to(p.parents[1] if flavor.incremental else p.parent)) for p in ckpts)
    data_label = "pool files" if flavor.incremental else "data files"
    for kind, label in (("data", data_label), ("manifest", "manifest.json")):
        c = counts[kind]
        verify_only = c.pop("verify only", 0)
        n = sum(v for (what, _), v in c.items() if what == "trials")
        detected = sum(v for (what, _), v in c.items() if what == "detected")
        regions = sorted({r for (_, r) in c})
        notes = [
            f"{len(ckpts)} checkpoints ({names}); flips per region: "
            + ", ".join(f"{r} {c[('trials', r)]}" for r in regions),
            f"caught by load(): {detected - verify_only}; only by verify(): {verify_only}",
        ]
        if kind == "data" and redrawn:
            notes.append(f"{redrawn} draws fell on pool bytes only the run's other checkpoint reads: drawn again")
        if kind == "manifest" and errors:
            notes.append("errors (the MAC's): " + ", ".join(f"{k} {v}" for k, v in errors.most_common()))
        for verdict in ("undetected", "unclean", "misclassified"):
            if (
                verdict == "misclassified"
                and flavor is PLAIN
                and not any(k.outcome.verdict == verdict for k in cases[kind])
            ):
                continue  # the plain rows' notes stay as they were
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
        rows.append(Row(f"corruption: one flipped byte in {label}{flavor.label}", n, detected, "detected", notes))
    if flavor.key is not None:
        n = sum(tag.values())
        caught = n - tag["none"]
        notes = ["load(verify=False) raised: " + ", ".join(f"{k} {v}" for k, v in tag.most_common())]
        notes += [f"  not caught by the tag: {k.describe()}" for k in cases.get("tag", [])[:NOTE_CAP]]
        rows.append(
            Row(
                f"corruption: flipped stored tensor bytes, checksums off (AES-GCM tag){flavor.label}",
                n,
                caught,
                "detected",
                notes,
            )
        )
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
    ap.add_argument("--flavor", choices=sorted(FLAVORS), default="plain")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rows = run(args.trials, args.seed, with_torch=False if args.no_torch else None, flavor=FLAVORS[args.flavor])
    print(markdown(rows))
    print(f"\n{args.trials} trials in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
