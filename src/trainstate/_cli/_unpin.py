"""``trainstate unpin``: let the retention policies decide about a pinned checkpoint again."""

from __future__ import annotations

import argparse

from trainstate._cli._args import OK, Subparsers, command, step_number
from trainstate._cli._open import find_step
from trainstate._cli._output import Printer
from trainstate._manager import CheckpointManager


def add_parser(sub: Subparsers) -> None:
    p = command(sub, "unpin", "let the retention policies decide about a checkpoint again")
    p.add_argument("path", metavar="DIR")
    p.add_argument("step", type=step_number, metavar="STEP")


def run(args: argparse.Namespace) -> int:
    return unpin(Printer(args.json), args.path, args.step, key_env=args.key_env)


def unpin(out: Printer, directory: str, step: int, *, key_env: str | None = None) -> int:
    info = find_step(directory, step, key_env)
    CheckpointManager(directory, read_only=True, key_env=key_env).unpin(step)
    if out.json_mode:
        out.json({"path": directory, "name": info.name, "step": step, "pinned": False, "was_pinned": info.pinned})
        return OK
    out.line(f"unpinned {info.name}" if info.pinned else f"{info.name} was not pinned")
    return OK
