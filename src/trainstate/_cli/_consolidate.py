"""``trainstate consolidate``: a checkpoint saved by many ranks rewritten as one a single process loads."""

from __future__ import annotations

from trainstate import consolidate as consolidate_checkpoint
from trainstate import open as open_checkpoint
from trainstate._cli._output import Printer, size
from trainstate._cli._show import open_ckpt
from trainstate.errors import CheckpointExistsError


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
    except CheckpointExistsError as e:  # the library names its argument; here it is a flag
        raise CheckpointExistsError(str(e).replace("pass overwrite=True", "pass --overwrite")) from None
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
