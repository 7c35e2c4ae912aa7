"""``trainstate verify``: every data-file header and every tensor against its checksum.

This is :meth:`Checkpoint.verify` unrolled, so a progress bar can advance per tensor and every damaged
tensor is reported, not just the first.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from trainstate._cli._args import CORRUPT, OK, Subparsers, command
from trainstate._cli._open import open_ckpt
from trainstate._cli._output import Printer, Progress, Table, size
from trainstate.errors import CorruptCheckpointError


def add_parser(sub: Subparsers) -> None:
    p = command(sub, "verify", "re-check every checksum of a checkpoint")
    p.add_argument("path", metavar="CKPT")


def run(args: argparse.Namespace) -> int:
    return verify(Printer(args.json), args.path, key_env=args.key_env)


def verify(out: Printer, path: str, *, key_env: str | None = None) -> int:
    start = time.perf_counter()
    errors: list[dict[str, Any]] = []
    with open_ckpt(path, key_env) as ck:
        names = ck.keys()
        total = sum(ck.info(n).nbytes for n in names)
        try:
            ck.verify_headers()
        except CorruptCheckpointError as e:
            errors.append({"tensor": None, "message": str(e)})
        progress = Progress(out, total, "verifying")
        try:
            for name in names:
                progress.step(name)
                try:
                    ck.read(name, verify=True)
                except CorruptCheckpointError as e:
                    errors.append({"tensor": name, "message": str(e)})
                progress.advance(ck.info(name).nbytes)
        finally:
            progress.close()
    seconds = time.perf_counter() - start
    report = {
        "path": path,
        "ok": not errors,
        "tensors": len(names),
        "nbytes": total,
        "seconds": round(seconds, 3),
        "errors": errors,
    }
    if out.json_mode:
        out.json(report)
    elif errors:
        t = Table(["damaged", "error"])
        for err in errors:
            t.add(err["tensor"] or "(data-file header)", err["message"], style="red")
        out.table(t)
    else:
        out.line(f"OK: {len(names)} tensors, {size(total)} verified in {seconds:.2f} s", style="green")
    if errors:
        bad = [e["tensor"] or "a data-file header" for e in errors]
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        print(f"trainstate: error: {path} is corrupt: {len(errors)} damaged ({shown})", file=sys.stderr)
        return CORRUPT
    return OK
