"""``trainstate average``: the mean of several checkpoints of one run (weight averaging after the fact)."""

from __future__ import annotations

import argparse

from trainstate._cli._args import Subparsers, command, overwrite_flag
from trainstate._cli._output import Printer, size
from trainstate.errors import CheckpointExistsError


def add_parser(sub: Subparsers) -> None:
    p = command(
        sub,
        "average",
        "write the mean of several checkpoints of one run (floating tensors; the rest: newest)",
        writes="encrypted CKPTs are read with it, and OUT is encrypted with it too",
    )
    p.add_argument("paths", metavar="CKPT", nargs="+")
    p.add_argument("-o", "--out", metavar="OUT", required=True, help="the new checkpoint (a path or URL)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at OUT")


def run(args: argparse.Namespace) -> int:
    return average(Printer(args.json), args.paths, args.out, overwrite=args.overwrite, key_env=args.key_env)


def average(out: Printer, paths: list[str], dst: str, *, overwrite: bool, key_env: str | None = None) -> int:
    from trainstate._convert.average import average as average_checkpoints

    try:
        r = average_checkpoints(paths, dst, overwrite=overwrite, key_env=key_env)
    except CheckpointExistsError as e:
        raise overwrite_flag(e) from None
    report = {"path": dst, "sources": paths, "nbytes": r.nbytes, "seconds": round(r.seconds, 3)}
    if out.json_mode:
        out.json(report)
        return 0
    out.line(f"averaged {len(paths)} checkpoints into {dst}: {size(r.nbytes)} in {r.seconds:.2f} s")
    return 0
