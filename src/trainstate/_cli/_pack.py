"""``trainstate pack CKPT OUT``: a checkpoint as one file (docs/format.md §10), for an application to embed.

The file opens wherever a checkpoint does: ``trainstate inspect|verify|diff OUT``, ``trainstate.load(OUT)``,
or its bytes with ``trainstate.load(data)``.
"""

from __future__ import annotations

import argparse
import time

from trainstate import pack as pack_checkpoint
from trainstate._cli._args import Subparsers, command, overwrite_flag
from trainstate._cli._open import open_ckpt
from trainstate._cli._output import Printer, size
from trainstate.errors import CheckpointExistsError


def add_parser(sub: Subparsers) -> None:
    p = command(
        sub,
        "pack",
        "pack a checkpoint into one file that CKPT arguments and trainstate.load accept",
        writes="an encrypted CKPT is read with it; OUT holds its bytes as stored, still encrypted with it",
    )
    p.add_argument("path", metavar="CKPT")
    p.add_argument("out", metavar="OUT", help="the file to write (e.g. model.tsar)")
    p.add_argument("--overwrite", action="store_true", help="replace a file at OUT")


def run(args: argparse.Namespace) -> int:
    return pack(Printer(args.json), args.path, args.out, overwrite=args.overwrite, key_env=args.key_env)


def pack(out: Printer, path: str, dst: str, *, overwrite: bool, key_env: str | None = None) -> int:
    start = time.perf_counter()
    with open_ckpt(path, key_env) as ck:  # a manager's directory given as CKPT is a usage error, as for inspect
        tensors, files = len(ck.manifest.tensors), len(ck.manifest.files)
    try:
        nbytes = pack_checkpoint(path, dst, overwrite=overwrite, key_env=key_env)
    except CheckpointExistsError as e:
        raise overwrite_flag(e) from None
    seconds = time.perf_counter() - start
    report = {"path": dst, "source": path, "tensors": tensors, "files": files, "nbytes": nbytes}
    if out.json_mode:
        out.json({**report, "seconds": round(seconds, 3)})
        return 0
    out.line(f"packed {path} ({tensors} tensors, {files} data file(s)) into {dst}: {size(nbytes)} in {seconds:.2f} s")
    return 0
