"""``trainstate consolidate``: a checkpoint saved by many ranks rewritten as one a single process loads."""

from __future__ import annotations

import argparse

from trainstate import consolidate as consolidate_checkpoint
from trainstate import open as open_checkpoint
from trainstate._cli._args import Subparsers, command, overwrite_flag, rank_number
from trainstate._cli._open import open_ckpt
from trainstate._cli._output import Printer, size
from trainstate.errors import CheckpointExistsError


def add_parser(sub: Subparsers) -> None:
    p = command(
        sub,
        "consolidate",
        "rewrite a checkpoint saved by many ranks as one a single process loads",
        writes="an encrypted CKPT is read with it, and OUT encrypted with it too unless --new-key-env names another key",
    )
    p.add_argument("path", metavar="CKPT")
    p.add_argument("out", metavar="OUT", help="the new checkpoint (a path or URL)")
    p.add_argument(
        "--rank", type=rank_number, default=0, metavar="N", help="keep this rank's per-rank values (RNG, data position)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at OUT")
    p.add_argument("--compression", metavar="zstd[:LEVEL]", help="compress OUT (default: uncompressed)")
    p.add_argument(
        "--new-key-env", metavar="NAME", help="encrypt OUT with the key in this variable instead (key rotation)"
    )


def run(args: argparse.Namespace) -> int:
    return consolidate(
        Printer(args.json),
        args.path,
        args.out,
        rank=args.rank,
        overwrite=args.overwrite,
        compression=args.compression,
        key_env=args.key_env,
        new_key_env=args.new_key_env,
    )


def consolidate(
    out: Printer,
    path: str,
    dst: str,
    *,
    rank: int,
    overwrite: bool,
    compression: str | None = None,
    key_env: str | None = None,
    new_key_env: str | None = None,
) -> int:
    with open_ckpt(path, key_env) as ck:  # a manager's directory given as CKPT is a usage error, as for inspect
        world = ck.world_size
        chunks = sum(len(ck.manifest.tensors[n].chunks) for n in ck.manifest.tensors)
    try:
        result = consolidate_checkpoint(
            path,
            dst,
            rank=rank,
            overwrite=overwrite,
            compression=compression,
            key_env=key_env,
            new_key_env=new_key_env,
        )
    except CheckpointExistsError as e:
        raise overwrite_flag(e) from None
    with open_checkpoint(dst, key_env=new_key_env or key_env) as done:
        tensors = len(done.manifest.tensors)
    report = {
        "path": dst,
        "source": path,
        "source_world_size": world,
        "source_chunks": chunks,
        "rank": rank,
        "compression": compression,
        "tensors": tensors,
        "nbytes": result.nbytes,
        "seconds": round(result.seconds, 3),
    }
    if out.json_mode:
        out.json(report)
        return 0
    saved_by = f"{world} ranks" if world > 1 else "1 process"
    out.line(
        f"consolidated {path} (saved by {saved_by}, {chunks} chunks) into {dst}: {tensors} tensors "
        + (f"compressed with {compression}, " if compression else "of one chunk, ")
        + f"{size(result.nbytes)} in {result.seconds:.2f} s; per-rank values (RNG, data position) are rank {rank}'s"
    )
    return 0
