"""``trainstate pin``: keep a checkpoint whatever the retention policies say.

A read-only CheckpointManager writes the pin, so it is safe beside a running training job.
"""

from __future__ import annotations

import argparse

from trainstate._cli._args import OK, Subparsers, command, step_number
from trainstate._cli._open import find_step
from trainstate._cli._output import Printer
from trainstate._manager import CheckpointManager


def add_parser(sub: Subparsers) -> None:
    p = command(sub, "pin", "keep a checkpoint whatever the retention policies say")
    p.add_argument("path", metavar="DIR")
    p.add_argument("step", type=step_number, metavar="STEP")
    p.add_argument("--reason", default="", metavar="TEXT", help="why (stored with the pin)")


def run(args: argparse.Namespace) -> int:
    return pin(Printer(args.json), args.path, args.step, args.reason, key_env=args.key_env)


def pin(out: Printer, directory: str, step: int, reason: str, *, key_env: str | None = None) -> int:
    info = find_step(directory, step, key_env)
    added = CheckpointManager(directory, read_only=True, key_env=key_env).pin(step, reason)  # safe beside a running job
    kept = reason if added else info.pin_reason
    if out.json_mode:
        out.json({"path": directory, "name": info.name, "step": step, "pinned": True, "reason": kept, "changed": added})
        return OK
    if added:
        out.line(f"pinned {info.name}" + (f" ({reason})" if reason else ""))
    else:
        note = f" (reason: {info.pin_reason})" if info.pin_reason else ""
        change = "; its reason was not changed: unpin and pin again to change it" if reason != info.pin_reason else ""
        out.line(f"{info.name} was already pinned{note}{change}")
    return OK
