"""``trainstate diff A B``: tensors added, removed or changed, and plain values changed.

Tensor values are compared block by block (memory stays bounded by the block size for tensors stored in
one piece), exactly on the bytes; for numeric dtypes the size of a change is reported as the largest
absolute difference, computed in float64 (complex128 for complex dtypes; bfloat16 and float8 through
their ml_dtypes cast, which is exact). Metadata differences are shown but do not count toward the exit
code: it says whether the saved *state* differs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainstate._cli._args import DIFFERENT, OK, Subparsers, command
from trainstate._cli._open import open_ckpt
from trainstate._cli._output import Printer, Progress, Table, short, size
from trainstate._cli._values import Changes, compare, state_values
from trainstate._restore.checkpoint import Checkpoint, TensorInfo
from trainstate._restore.plan import matches

BLOCK = 1 << 20  # elements per comparison block (8 MB per side in float64)


def add_parser(sub: Subparsers) -> None:
    p = command(sub, "diff", "compare two checkpoints: tensors and plain values (exit 1 if they differ)")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument(
        "--exclude",
        metavar="PATTERN",
        action="append",
        default=[],
        help="leave out keys matching this glob pattern and everything under them (repeatable), e.g. _rng: the "
        "RNG state a CheckpointManager captures on its own",
    )


def run(args: argparse.Namespace) -> int:
    return diff(Printer(args.json), args.a, args.b, key_env=args.key_env, exclude=args.exclude)


@dataclass
class ValueDiff:
    equal_bytes: bool
    numel: int
    different: int = 0  # elements whose values differ (NaN equals NaN)
    max_abs_diff: float | None = None  # over elements with a finite difference
    nan_mismatches: int = 0  # elements NaN on one side only


def _wide(x: np.ndarray) -> np.ndarray:
    """Values as float64 / complex128 (bool and integers too)."""
    return x.astype(np.complex128 if x.dtype.kind == "c" else np.float64)


def compare_values(a: np.ndarray, b: np.ndarray) -> ValueDiff:
    """Compare two arrays of the same shape block by block."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    same_dtype = a.dtype == b.dtype
    exact_ints = a.dtype.kind in "biu" and b.dtype.kind in "biu"
    result = ValueDiff(equal_bytes=same_dtype, numel=fa.size)
    for begin in range(0, fa.size, BLOCK):
        xa, xb = fa[begin : begin + BLOCK], fb[begin : begin + BLOCK]
        if same_dtype and np.array_equal(xa.view(np.uint8), xb.view(np.uint8)):
            continue
        result.equal_bytes = False
        wa, wb = _wide(xa), _wide(xb)
        if exact_ints:  # compare integers exactly; only the size of a change goes through float64
            differ = xa != xb
            nan_a = nan_b = np.zeros(xa.shape, bool)
        else:
            nan_a, nan_b = np.isnan(wa), np.isnan(wb)
            differ = ~((wa == wb) | (nan_a & nan_b))
        one_nan = differ & (nan_a | nan_b)
        result.nan_mismatches += int(one_nan.sum())
        result.different += int(differ.sum())
        finite = differ & ~one_nan
        if finite.any():
            biggest = float(np.max(np.abs(wa[finite] - wb[finite])))
            result.max_abs_diff = biggest if result.max_abs_diff is None else max(result.max_abs_diff, biggest)
    return result


def _describe(i: TensorInfo) -> dict[str, Any]:
    return {"name": i.name, "dtype": i.dtype, "shape": list(i.shape), "nbytes": i.nbytes}


def _tensor_changes(
    ca: Checkpoint, cb: Checkpoint, progress: Progress, kept: Callable[[str], bool]
) -> tuple[list[Any], list[Any], list[dict[str, Any]]]:
    names_a, names_b = [n for n in ca.keys() if kept(n)], [n for n in cb.keys() if kept(n)]
    in_a, in_b = set(names_a), set(names_b)
    removed = [_describe(ca.info(n)) for n in names_a if n not in in_b]
    added = [_describe(cb.info(n)) for n in names_b if n not in in_a]
    changed = []
    for name in names_a:
        if name not in in_b:
            continue
        ia, ib = ca.info(name), cb.info(name)
        reasons = [what for what, x, y in (("dtype", ia.dtype, ib.dtype), ("shape", ia.shape, ib.shape)) if x != y]
        entry: dict[str, Any] = {"name": name, "reasons": reasons, "a": _describe(ia), "b": _describe(ib)}
        if ia.shape == ib.shape:
            progress.step(name)
            d = compare_values(np.asarray(ca.read(name)), np.asarray(cb.read(name)))
            progress.advance(ia.nbytes)
            if d.equal_bytes and not reasons:
                continue
            if not d.equal_bytes and "dtype" not in reasons:
                reasons.append("values")
            entry.update(
                numel=d.numel, different=d.different, max_abs_diff=d.max_abs_diff, nan_mismatches=d.nan_mismatches
            )
        changed.append(entry)
    return added, removed, changed


def _detail(c: dict[str, Any]) -> str:
    a, b = c["a"], c["b"]
    parts = []
    if "dtype" in c["reasons"]:
        parts.append(f"dtype {a['dtype']} -> {b['dtype']}")
    if "shape" in c["reasons"]:
        parts.append(f"shape {a['shape']} -> {b['shape']}")
    if "numel" in c:
        if c["different"] or c["nan_mismatches"]:
            nans = f" ({c['nan_mismatches']} NaN on one side only)" if c["nan_mismatches"] else ""
            parts.append(f"{c['different']} of {c['numel']} elements differ{nans}")
            if c["max_abs_diff"] is not None:
                parts.append(f"max |a-b| = {c['max_abs_diff']:.6g}")
        elif "values" in c["reasons"]:
            parts.append("bits differ, values equal (-0.0 vs 0.0, NaN payloads)")
        elif "dtype" in c["reasons"]:
            parts.append("values equal")
    return "; ".join(parts)


def diff(
    out: Printer, path_a: str, path_b: str, *, key_env: str | None = None, exclude: list[str] | None = None
) -> int:
    """Compare two checkpoints' state; keys matching an ``exclude`` glob pattern (as ``load``'s: ``"_rng"``
    takes everything under it) are left out, such as the RNG state a manager captures on its own."""
    patterns = exclude or []

    def kept(key: str) -> bool:
        return not any(matches(key, p) for p in patterns)

    with open_ckpt(path_a, key_env) as ca, open_ckpt(path_b, key_env) as cb:
        ca.verify_headers()  # what load() would refuse, diff does not call identical
        cb.verify_headers()
        progress = Progress(out, sum(ca.info(n).nbytes for n in ca.keys() if n in cb and kept(n)), "comparing")
        try:
            added, removed, changed = _tensor_changes(ca, cb, progress, kept)
        finally:
            progress.close()
        values = compare(state_values(ca), state_values(cb))
        values = Changes(
            [c for c in values.added if kept(c[0])],
            [c for c in values.removed if kept(c[0])],
            [c for c in values.changed if kept(c[0])],
        )
        metadata = compare(ca.metadata, cb.metadata)
    identical = not (added or removed or changed or values)
    if out.json_mode:
        out.json(
            {
                "a": path_a,
                "b": path_b,
                "identical": identical,
                "tensors": {"added": added, "removed": removed, "changed": changed},
                "values": values.as_json(),
                "metadata": metadata.as_json(),
            }
        )
        return OK if identical else DIFFERENT
    t = Table(["", "what", "name", "change"])
    for r in removed:
        t.add("-", "tensor", r["name"], f"{r['dtype']} {r['shape']} ({size(r['nbytes'])})", style="red")
    for r in added:
        t.add("+", "tensor", r["name"], f"{r['dtype']} {r['shape']} ({size(r['nbytes'])})", style="green")
    for c in changed:
        t.add("~", "tensor", c["name"], _detail(c), style="yellow")
    for what, changes in (("value", values), ("metadata", metadata)):
        for p, v in changes.removed:
            t.add("-", what, p, short(v), style="red")
        for p, v in changes.added:
            t.add("+", what, p, short(v), style="green")
        for p, x, y in changes.changed:
            t.add("~", what, p, f"{short(x, 40)} -> {short(y, 40)}", style="yellow")
    out.line(f"a: {path_a}")
    out.line(f"b: {path_b}")
    if t.rows:
        out.table(t)
    n = len(added) + len(removed) + len(changed)
    m = len(values.added) + len(values.removed) + len(values.changed)
    out.line(
        "identical state" + (" (metadata differs)" if metadata else "")
        if identical
        else f"state differs: {n} tensor(s), {m} value(s)",
        style="green" if identical else "yellow",
    )
    return OK if identical else DIFFERENT
