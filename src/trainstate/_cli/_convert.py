"""``trainstate export`` / ``import`` / ``average``: checkpoints to and from other tools' formats."""

from __future__ import annotations

from trainstate._cli._output import Printer, size
from trainstate.errors import CheckpointExistsError


def _flag(e: CheckpointExistsError) -> CheckpointExistsError:
    """The library names its argument; here it is a flag."""
    return CheckpointExistsError(str(e).replace("pass overwrite=True", "pass --overwrite"))


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
        raise _flag(e) from None
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


def import_(
    out: Printer, src: str, dst: str, *, prefix: str | None, overwrite: bool, key_env: str | None = None
) -> int:
    from trainstate._convert.import_ import import_checkpoint
    from trainstate._restore.checkpoint import Checkpoint

    try:
        r = import_checkpoint(src, dst, prefix=prefix, overwrite=overwrite, key_env=key_env)
    except CheckpointExistsError as e:
        raise _flag(e) from None
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


def average(out: Printer, paths: list[str], dst: str, *, overwrite: bool, key_env: str | None = None) -> int:
    from trainstate._convert.average import average as average_checkpoints

    try:
        r = average_checkpoints(paths, dst, overwrite=overwrite, key_env=key_env)
    except CheckpointExistsError as e:
        raise _flag(e) from None
    report = {"path": dst, "sources": paths, "nbytes": r.nbytes, "seconds": round(r.seconds, 3)}
    if out.json_mode:
        out.json(report)
        return 0
    out.line(f"averaged {len(paths)} checkpoints into {dst}: {size(r.nbytes)} in {r.seconds:.2f} s")
    return 0
