"""export(): a training checkpoint's model weights as the files inference tools load.

The weights are the model's (``select.py``: the first module by default, named as its ``state_dict()``
names them); optimizer, RNG and loop state are left out. Three layouts (docs/export.md):

- ``hf`` (default): a folder with ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors``
  of at most ``max_shard_size`` (default 5GB, as ``save_pretrained``) plus ``model.safetensors.index.json``;
  ``copy_from`` adds the config and tokenizer files, so ``AutoModel.from_pretrained(OUT)`` loads it.
- ``safetensors``: one file (OUT itself when it ends in ``.safetensors``, else ``OUT/model.safetensors``).
- ``torch``: one ``torch.save`` file (OUT when it ends in ``.bin`` / ``.pt`` / ``.pth``, else
  ``OUT/pytorch_model.bin``) that ``torch.load(weights_only=True)`` reads.

Every tensor is read (checked against its checksum), cast if asked, written and dropped before the next:
memory peaks near the largest tensor. A tensor tied under several names (input and output embeddings) is
written once in safetensors layouts, under its first name, as ``save_pretrained`` does (safetensors refuses
shared storage; Hugging Face re-ties on load); the other names are listed in the file's ``__metadata__``
(``trainstate.tied``), which ``import_checkpoint`` reads back. A checkpoint imported from a safetensors file
writes that file's other ``__metadata__`` again. A torch file keeps every name, sharing one
storage, as ``torch.save(model.state_dict())`` does.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from trainstate import _gc, _keys
from trainstate._convert import safetensors_file, torch_file
from trainstate._convert.output import copy_beside, model_folder, parse_size, staged
from trainstate._convert.select import Weight, weights
from trainstate._format import dtypes
from trainstate._restore.checkpoint import Checkpoint
from trainstate._storage.local import fsync_path
from trainstate.errors import InvalidArgumentError, UnsupportedValueError

FORMATS = ("hf", "safetensors", "torch")
CASTS = {"bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "float16": "F16", "fp32": "F32", "float32": "F32"}
_RANGE_BLOCK = 1 << 20  # elements per block when checking a cast for overflow
CAST_FROM = frozenset({"F16", "BF16", "F32", "F64"})  # floating tensors a cast applies to (not float8, ints)
DEFAULT_SHARD = "5GB"
TIED_KEY = "trainstate.tied"  # safetensors __metadata__: JSON {alias: name written}
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: where, which files (relative to ``path`` for a folder), how many tensor names
    and bytes, how long; ``tied`` maps each name written only once to the name it was written under.

    Attributes:
        path: the file or folder written.
        files: the files written (relative to ``path`` for a folder).
        tensors: how many tensor names were exported.
        nbytes: bytes of tensor data written.
        seconds: how long the export took.
        tied: each tied name written only once, mapped to the name it was written under.
        copied: the files copied from ``copy_from`` (config, tokenizer, ...).

    Example:
        >>> result = trainstate.export("ckpt/step_1200", "release/", dtype="bf16")
        >>> result.files, result.tensors
        (('model.safetensors', 'model.safetensors.index.json'), 148)
    """

    path: str
    files: tuple[str, ...]
    tensors: int
    nbytes: int
    seconds: float
    tied: dict[str, str] = field(default_factory=dict)
    copied: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Tensor:
    stored: str  # name in the checkpoint
    dtype: str  # as written (after the cast)
    shape: tuple[int, ...]
    nbytes: int


def export(
    ckpt: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    select: str | Sequence[str] | None = None,
    strip_prefix: str | None = None,
    dtype: str | None = None,
    max_shard_size: int | str | None = None,
    copy_from: str | os.PathLike[str] | None = None,
    format: str = "hf",
    overwrite: bool = False,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> ExportResult:
    """Write the model weights of checkpoint ``ckpt`` at ``out`` for inference tools (see the module docs).

    Args:
        ckpt: a trainstate checkpoint (any storage).
        out: a local folder (``hf``), or a file or folder (``safetensors``, ``torch``).
        select: glob pattern(s) over the checkpoint's dotted keys (``"model.*"``); default: the first module.
        strip_prefix: removed from every selected name (``"model."``).
        dtype: cast floating tensors (float16 / bfloat16 / float32 / float64) to ``"bf16"``, ``"fp16"`` or
            ``"fp32"``; integer, bool and float8 tensors keep theirs.
        max_shard_size: ``hf`` only: the most bytes per shard, ``"2GB"`` (10^9), ``"2GiB"`` or an int.
        copy_from: a model folder whose other files (config, tokenizer) are copied beside the weights.
        format: ``"hf"``, ``"safetensors"`` or ``"torch"``.
        overwrite: replace ``out`` (atomically) if it exists.
        key: the key of an encrypted checkpoint. The files written are NOT encrypted: inference tools read
            plain safetensors / torch files (docs/encryption.md).
        key_env: the name of an environment variable that holds the key, instead of ``key``.

    Raises:
        InvalidArgumentError: a bad argument, or a selection that finds no weights (the message says why).
        UnsupportedValueError: a tensor whose dtype safetensors cannot hold.
        CheckpointExistsError: ``out`` exists and ``overwrite`` is False (or it is a trainstate checkpoint).

    Example:
        >>> trainstate.export("ckpt/step_1200", "release/", copy_from="base-model/", dtype="bf16")
        >>> model = transformers.AutoModel.from_pretrained("release/")
    """
    start = time.perf_counter()
    resolved = _keys.resolve(key, key_env)
    if format not in FORMATS:
        raise InvalidArgumentError(f"format must be one of {list(FORMATS)}, got {format!r:.40}")
    cast = None if dtype is None else CASTS.get(str(dtype).lower())
    if dtype is not None and cast is None:
        raise InvalidArgumentError(f"dtype must be one of {sorted(CASTS)}, got {dtype!r:.40}")
    if max_shard_size is not None and format != "hf":
        raise InvalidArgumentError(f"max_shard_size applies to format='hf' (sharded folders), not {format!r}")
    shard = parse_size(DEFAULT_SHARD if max_shard_size is None else max_shard_size)
    target = Path(out)
    single = _single_file(target, format)
    if single and copy_from is not None:
        raise InvalidArgumentError(f"copy_from needs a folder to copy into; {target} is a file: give a folder as OUT")
    if copy_from is not None:
        model_folder(copy_from)
    with Checkpoint(ckpt, key=resolved) as ck, _gc.paused():
        ck.verify_headers()
        picked = weights(ck, select, strip_prefix)
        tensors = _plan(ck, picked, cast, format)
        first = {w.stored: w.name for w in reversed(picked)}  # each tensor's first name
        tied = {} if format == "torch" else {w.name: first[w.stored] for w in picked if first[w.stored] != w.name}
        with staged(target, overwrite=overwrite, directory=not single) as tmp:
            folder = tmp.parent if single else tmp
            if format == "torch":
                name = tmp.name if single else "pytorch_model.bin"
                _write_torch(ck, folder / name, picked, tensors)
                files = [target.name if single else name]
            else:
                groups = _shards(picked, tensors, shard) if format == "hf" else [_unique(picked)]
                files = _write_safetensors(ck, tmp, single, groups, tensors, tied, _source_metadata(ck))
            files = [target.name] if single else files
            copied = copy_beside(copy_from, tmp) if copy_from is not None else []
            nbytes = tmp.stat().st_size if single else sum((tmp / f).stat().st_size for f in files)
    seconds = time.perf_counter() - start
    return ExportResult(str(target), tuple(files), len(picked) - len(tied), nbytes, seconds, tied, tuple(copied))


def _single_file(target: Path, format: str) -> bool:
    if format == "safetensors":
        return target.suffix == ".safetensors"
    return format == "torch" and target.suffix in (".bin", ".pt", ".pth")


def _plan(ck: Checkpoint, picked: list[Weight], cast: str | None, format: str) -> dict[str, _Tensor]:
    """Each stored tensor as it will be written: dtype after the cast, size."""
    planned = {}
    for w in picked:
        t = ck.manifest.tensors[w.stored]
        code = cast if cast is not None and t.dtype in CAST_FROM else t.dtype
        if format != "torch" and not dtypes.from_code(code).safetensors:
            raise UnsupportedValueError(
                f"{w.name} is {code}, which safetensors cannot hold: export it with format='torch'"
            )
        planned[w.stored] = _Tensor(w.stored, code, t.shape, dtypes.from_code(code).itemsize * int(np.prod(t.shape)))
    return planned


def _produce(ck: Checkpoint, t: _Tensor) -> np.ndarray:
    """A tensor's bytes as it is written: read and checked (a view of the file's map where it is stored
    whole), cast when asked."""
    array = np.asarray(ck.read(t.stored))
    want = dtypes.from_code(t.dtype).numpy
    if array.dtype == want:
        return array
    with np.errstate(over="ignore"):  # an overflow is reported below, as an error naming the tensor
        out = array.astype(want)
    _check_range(t, array, out)
    return out


def _check_range(t: _Tensor, before: np.ndarray, after: np.ndarray) -> None:
    """Refuse a cast that turned finite values into infinities (float16 ends at 65504): the exported model
    would overflow where the trained one did not. Counted a block at a time, so no tensor-sized mask."""
    flat_in, flat_out = before.reshape(-1), after.reshape(-1)
    for begin in range(0, flat_out.size, _RANGE_BLOCK):
        block = slice(begin, begin + _RANGE_BLOCK)
        if np.count_nonzero(np.isinf(flat_out[block])) != np.count_nonzero(np.isinf(flat_in[block])):
            finite = flat_in[np.isfinite(flat_in)]
            largest = float(np.abs(finite.astype(np.float64)).max())
            raise UnsupportedValueError(
                f"{t.stored}: casting to {t.dtype} overflows (its largest magnitude is {largest:.6g}, beyond what "
                f"{t.dtype} holds): export it in bf16 (float32's range) or fp32 instead"
            )


def _unique(picked: list[Weight]) -> list[Weight]:
    """One name per stored tensor: its first (a tied tensor is written once)."""
    first: dict[str, Weight] = {}
    for w in picked:
        first.setdefault(w.stored, w)
    return list(first.values())


def _shards(picked: list[Weight], tensors: dict[str, _Tensor], limit: int) -> list[list[Weight]]:
    """Tensors cut into shards of at most ``limit`` bytes, in order; a larger tensor gets a shard of its own
    (``save_pretrained``'s rule)."""
    shards: list[list[Weight]] = [[]]
    size = 0
    for w in _unique(picked):
        n = tensors[w.stored].nbytes
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(w)
        size += n
    return shards


def _write_safetensors(
    ck: Checkpoint,
    tmp: Path,
    single: bool,
    groups: list[list[Weight]],
    tensors: dict[str, _Tensor],
    tied: dict[str, str],
    kept: dict[str, str],
) -> list[str]:
    files = []
    weight_map: dict[str, str] = {}
    total = parameters = 0
    for i, group in enumerate(groups):
        name = tmp.name if single else _shard_name(i, len(groups))
        meta = {"format": "pt", **kept}  # format: what from_pretrained checks
        here = {w.name for w in group}
        aliases = {alias: kept for alias, kept in tied.items() if kept in here}
        if aliases:
            meta[TIED_KEY] = json.dumps(aliases, sort_keys=True)
        outs = []
        for w in group:
            t = tensors[w.stored]
            outs.append(safetensors_file.Out(w.name, t.dtype, t.shape, t.nbytes, partial(_produce, ck, t)))
            weight_map[w.name] = name
            total += t.nbytes
            parameters += int(np.prod(t.shape))
        safetensors_file.write(tmp if single else tmp / name, outs, meta)
        files.append(name)
    if len(groups) > 1:
        metadata = {"total_parameters": parameters, "total_size": total}  # as save_pretrained writes it
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        fsync_path(tmp / INDEX_NAME)
        files.append(INDEX_NAME)
    return files


def _source_metadata(ck: Checkpoint) -> dict[str, str]:
    """The ``__metadata__`` of the safetensors file ``ck`` was imported from (``import_checkpoint`` records it),
    to write again: a model's own notes (format, license, provenance) survive import then export. The list
    of tied names is left out: it describes the source's tensors, and export writes its own."""
    record = ck.metadata.get("imported_from") if isinstance(ck.metadata, dict) else None
    meta = record.get("metadata") if isinstance(record, dict) else None
    if not isinstance(meta, dict):
        return {}
    return {str(k): v for k, v in meta.items() if isinstance(v, str) and k != TIED_KEY}


def _shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_torch(ck: Checkpoint, path: Path, picked: list[Weight], tensors: dict[str, _Tensor]) -> None:
    stored: dict[str, Any] = {}
    for name, t in tensors.items():
        stored[name] = torch_file.Stored(t.dtype, t.shape, partial(_produce, ck, t))
    torch_file.write(path, {w.name: stored[w.stored] for w in picked})
