"""``trainstate export``: a checkpoint's model weights as a Hugging Face folder, safetensors or torch.save file."""

from __future__ import annotations

import argparse

from trainstate._cli._args import Subparsers, command, overwrite_flag
from trainstate._cli._output import Printer, size
from trainstate.errors import CheckpointExistsError


def add_parser(sub: Subparsers) -> None:
    p = command(
        sub, "export", "write a checkpoint's model weights for inference tools (Hugging Face, safetensors, torch)"
    )
    p.add_argument("path", metavar="CKPT")
    p.add_argument("out", metavar="OUT", help="a folder (hf), or a file or folder (safetensors, torch)")
    p.add_argument(
        "--select", action="append", metavar="GLOB", help="tensors whose keys match (repeatable); default: the model"
    )
    p.add_argument("--strip-prefix", metavar="PREFIX", help="removed from every selected name, e.g. 'model.'")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors")
    p.add_argument("--max-shard-size", metavar="SIZE", help="hf: the most bytes per shard, e.g. 2GB (default 5GB)")
    p.add_argument("--copy-from", metavar="DIR", help="copy config and tokenizer files from this model folder")
    p.add_argument("--format", choices=["hf", "safetensors", "torch"], default="hf", help="default: hf")
    p.add_argument("--overwrite", action="store_true", help="replace OUT")


def run(args: argparse.Namespace) -> int:
    return export(
        Printer(args.json),
        args.path,
        args.out,
        select=args.select,
        strip_prefix=args.strip_prefix,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        copy_from=args.copy_from,
        format=args.format,
        overwrite=args.overwrite,
        key_env=args.key_env,
    )


def export(
    out: Printer,
    path: str,
    dst: str,
    *,
    select: list[str] | None,
    strip_prefix: str | None,
    dtype: str | None,
    max_shard_size: str | None,
    copy_from: str | None,
    format: str,
    overwrite: bool,
    key_env: str | None = None,
) -> int:
    from trainstate._convert.export import export as export_weights

    try:
        r = export_weights(
            path,
            dst,
            select=select,
            strip_prefix=strip_prefix,
            dtype=dtype,
            max_shard_size=max_shard_size,
            copy_from=copy_from,
            format=format,
            overwrite=overwrite,
            key_env=key_env,
        )
    except CheckpointExistsError as e:
        raise overwrite_flag(e) from None
    report = {
        "path": r.path,
        "source": path,
        "format": format,
        "files": list(r.files),
        "tensors": r.tensors,
        "nbytes": r.nbytes,
        "tied": r.tied,
        "copied": list(r.copied),
        "seconds": round(r.seconds, 3),
    }
    if out.json_mode:
        out.json(report)
        return 0
    files = ", ".join(r.files[:3]) + (f" (+{len(r.files) - 3})" if len(r.files) > 3 else "")
    out.line(f"exported {r.tensors} tensors of {path} to {r.path}: {files}, {size(r.nbytes)} in {r.seconds:.2f} s")
    for alias, kept in r.tied.items():
        out.line(f"  {alias}: tied to {kept}, written once under that name")
    if r.copied:
        out.line(f"  copied {len(r.copied)} files beside them: {', '.join(r.copied[:5])}")
    return 0
