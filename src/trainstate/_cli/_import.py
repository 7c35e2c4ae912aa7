"""``trainstate import``: safetensors, torch.save, Hugging Face or DCP weights written as a trainstate checkpoint."""

from __future__ import annotations

import argparse

from trainstate._cli._args import Subparsers, command, overwrite_flag
from trainstate._cli._output import Printer, size
from trainstate.errors import CheckpointExistsError


def add_parser(sub: Subparsers) -> None:
    p = command(
        sub,
        "import",
        "write safetensors, torch.save, Hugging Face or DCP weights as a trainstate checkpoint",
        writes="CKPT is written encrypted with it",
    )
    p.add_argument(
        "src", metavar="SRC", help="a .safetensors / torch.save file, a Hugging Face folder, a DCP directory"
    )
    p.add_argument("out", metavar="CKPT", help="the new checkpoint (a path or URL)")
    p.add_argument("--prefix", metavar="KEY", help="put the weights under this key, e.g. 'model'")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at CKPT")


def run(args: argparse.Namespace) -> int:
    return import_(
        Printer(args.json), args.src, args.out, prefix=args.prefix, overwrite=args.overwrite, key_env=args.key_env
    )


def import_(
    out: Printer, src: str, dst: str, *, prefix: str | None, overwrite: bool, key_env: str | None = None
) -> int:
    from trainstate._convert.import_ import import_checkpoint
    from trainstate._restore.checkpoint import Checkpoint

    try:
        r = import_checkpoint(src, dst, prefix=prefix, overwrite=overwrite, key_env=key_env)
    except CheckpointExistsError as e:
        raise overwrite_flag(e) from None
    with Checkpoint(dst, key_env=key_env) as ck:
        tensors = len(ck.manifest.tensors)
        meta = ck.metadata
    record = meta.get("imported_from") if isinstance(meta, dict) else None
    kind = record.get("format", "?") if isinstance(record, dict) else "?"
    report = {"path": dst, "source": src, "format": kind, "tensors": tensors, "nbytes": r.nbytes}
    report["seconds"] = round(r.seconds, 3)
    if out.json_mode:
        out.json(report)
        return 0
    under = f" under '{prefix}'" if prefix else ""
    out.line(f"imported {tensors} tensors of {src} ({kind}){under} into {dst}: {size(r.nbytes)} in {r.seconds:.2f} s")
    return 0
