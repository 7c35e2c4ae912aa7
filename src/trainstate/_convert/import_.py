"""import_checkpoint(): another tool's weights written as a trainstate checkpoint, a tensor at a time.

Sources, told apart by what they are (not only by their names):

- a ``.safetensors`` file (header read, each tensor read when written);
- a ``torch.save`` file (``.pt`` / ``.bin`` / anything else that is not safetensors), its pickle read by
  trainstate's own restricted unpickler (``torch_pickle``: never code, never torch's unpickler) and its
  tensors memory-mapped;
- a Hugging Face folder: ``model.safetensors``, or shards listed by ``model.safetensors.index.json``,
  else ``pytorch_model.bin`` or its ``pytorch_model.bin.index.json`` (``from_pretrained``'s order);
- a ``torch.distributed.checkpoint`` directory (it has ``.metadata``), read with DCP's own loader.

The result goes through the save pipeline (``write_checkpoint``: checksums, the atomic commit) with lazy
entries, so one tensor is in memory at a time. How the tree is shaped (a state dict becomes a module's
state, so ``load(ckpt, {"model": model})`` works) is in ``source.py``. Safetensors files that
``trainstate.export`` wrote list the names of tied tensors it wrote once; they come back tied.
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

from trainstate import _gc, _keys
from trainstate import _tree as tree
from trainstate._convert import dcp, safetensors_file, source, torch_file
from trainstate._format.manifest import MANIFEST_NAME
from trainstate._save.options import save_options
from trainstate._save.write import SaveResult, write_checkpoint
from trainstate._storage import resolve
from trainstate.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    StorageError,
    UnsupportedValueError,
)

TIED_KEY = "trainstate.tied"  # export.py writes it: JSON {alias: name written}
REPEAT_SLACK = 64 << 20  # bytes repeated references in a source may import beyond twice its size
_HF_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def import_checkpoint(
    src: str | os.PathLike[str],
    ckpt: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    overwrite: bool = False,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> SaveResult:
    """Write the weights (or state) of ``src`` as a trainstate checkpoint at ``ckpt``.

    Args:
        src: a ``.safetensors`` file, a ``torch.save`` file, a Hugging Face model folder (single or sharded,
            safetensors or ``.bin``), or a ``torch.distributed.checkpoint`` directory. A local path.
        ckpt: the checkpoint to write (a path or URL).
        prefix: put the state under this key (``"model"``: ``{"model": <the weights>}``; dotted nests deeper).
        overwrite: replace a checkpoint at ``ckpt`` (atomically).
        key: encrypt the checkpoint with this key (docs/encryption.md).
        key_env: the name of an environment variable that holds the key, instead of ``key``.

    Returns:
        A :class:`SaveResult` for ``ckpt``.

    Raises:
        CheckpointNotFoundError: ``src`` does not exist.
        InvalidArgumentError: ``src`` is a folder of none of the kinds above (or a trainstate checkpoint).
        CorruptCheckpointError: ``src`` is not a well-formed file of its kind.
        UnsupportedValueError: ``src`` holds something trainstate does not store or unpickle (a pickled class).

    Example:
        >>> trainstate.import_checkpoint("bert-base-uncased/", "ckpt/imported", prefix="model")
        >>> trainstate.load("ckpt/imported", {"model": model})
    """
    start = time.perf_counter()
    if prefix is not None and (not isinstance(prefix, str) or not all(prefix.split(".")) or not _unicode(prefix)):
        raise InvalidArgumentError(
            f"prefix must be a key like 'model' (dotted nests deeper; valid Unicode), got {prefix!r:.40}"
        )
    options = save_options(overwrite=overwrite, threads=1, workers=1, key=key, key_env=key_env)
    path = Path(src)
    try:
        return _imported(path, ckpt, prefix, options, start)
    finally:
        torch_file.forget()  # the files a torch.save read left open for its tensors' bytes


def _imported(path: Path, ckpt: str | os.PathLike[str], prefix: str | None, options: Any, start: float) -> SaveResult:
    kind, state, meta = read_source(path)
    record = {"source": str(path), "format": kind, **({"metadata": meta} if meta else {})}
    # torch tensors: a torch.save file's, a .bin shard's, or inside a value DCP pickled whole (a tuple)
    torch_tensors = (
        partial(torch_file.source_tensor, where=path, views=torch_file.Views(_size(path)))
        if kind in ("torch", "hf", "dcp")
        else None  # safetensors: no torch
    )
    try:
        snapshot = source.build(
            state, prefix or None, {"imported_from": record}, torch_tensors, budget=2 * _size(path) + REPEAT_SLACK
        )
    except UnsupportedValueError as e:  # it names the value's place in the source; the source is named here
        raise e if str(path) in str(e) else UnsupportedValueError(f"{path}: {e}") from None
    backend, root = resolve(ckpt, None)
    with _gc.paused():
        return write_checkpoint(root, snapshot, storage=backend, options=options, start=start)


def _unicode(text: str) -> bool:
    """Whether ``text`` is a key trainstate stores (valid Unicode: no lone surrogate, which a non-UTF-8 byte
    in argv becomes); the tree's own rule (:func:`trainstate._tree.key_text`)."""
    try:
        tree.key_text(text)
    except UnsupportedValueError:
        return False
    return True


def _size(path: Path) -> int:
    """The bytes of the source: the file's, or those of the folder's files (what a pickle in it can be), each
    file counted once however many names (links) reach it."""
    try:
        if path.is_file():
            return source.real_size(path.stat())
        files = {(s.st_dev, s.st_ino): source.real_size(s) for p in path.iterdir() if p.is_file() for s in [p.stat()]}
        return sum(files.values())
    except OSError as e:
        raise StorageError(e.errno, f"cannot read {path}: {e.strerror}") from e


def read_source(path: Path) -> tuple[str, Any, dict[str, str]]:
    """What ``path`` is (``"safetensors"``, ``"torch"``, ``"hf"`` or ``"dcp"``), the state it holds (tensors
    as :class:`source.SourceTensor` or torch tensors), and a safetensors file's ``__metadata__``."""
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such file or directory to import")
    if path.is_file():
        return _read_file(path, path.name)
    if not path.is_dir():  # a pipe, a socket, a device: no weights to read (and a pipe's read would wait)
        raise InvalidArgumentError(f"{path} is neither a file nor a folder: nothing trainstate can import")
    if (path / dcp.METADATA).is_file():
        return "dcp", dcp.read(path), {}
    for name in _HF_FILES:
        if (path / name).is_file():
            real = confined(path / name, path)  # the index is read through its name: its shards are beside it
            if name.endswith(".index.json"):
                return "hf", _sharded(path / name), {}
            _, state, meta = _read_file(real, name)  # one weights file: its __metadata__ too, as for a file
            return "hf", state, meta
    if (path / MANIFEST_NAME).is_file():
        raise InvalidArgumentError(f"{path} is a trainstate checkpoint already: load it, or consolidate it to copy it")
    raise InvalidArgumentError(
        f"{path} is a folder without model weights trainstate can import: expected one of {list(_HF_FILES)} "
        f"(a Hugging Face folder) or {dcp.METADATA} (a torch.distributed.checkpoint directory); found "
        f"{sorted(p.name for p in path.iterdir())[:10]}. Pass the weights file itself if it has another name"
    )


def _read_file(path: Path, name: str) -> tuple[str, Any, dict[str, str]]:
    """:func:`read_source` of a file, its kind told by ``name`` (a hub cache's blobs have none) and its bytes."""
    if _is_safetensors(path, name):
        tensors, meta = safetensors_file.read(path)
        return "safetensors", _tie(tensors, meta, path), meta
    if name.endswith(".index.json"):
        return "hf", _sharded(path), {}
    if not _may_be_torch_save(path):
        raise InvalidArgumentError(
            f"{path} is not a file trainstate can import: expected a safetensors file, a torch.save file (a zip, "
            "or torch's legacy pickle format), a Hugging Face folder or a torch.distributed.checkpoint directory"
        )
    return "torch", torch_file.read(path), {}


def _may_be_torch_save(path: Path) -> bool:
    """Whether a file starts as a torch.save file does: a zip (the format since torch 1.6), or a pickle's
    protocol opcode (the legacy format). Anything else (a config, a text file) was never a checkpoint."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise StorageError(e.errno, f"cannot read {path}: {e.strerror}") from e
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def _is_safetensors(path: Path, name: str) -> bool:
    """Whether a file starts as safetensors does: a plausible header length, then a JSON object."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise StorageError(e.errno, f"cannot read {path}: {e.strerror}") from e
    if name.endswith(".safetensors"):
        return True  # its reader says what is wrong with it, if anything
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size


def _tie(tensors: dict[str, Any], meta: dict[str, str], path: Path) -> dict[str, Any]:
    """Names an export wrote once (``trainstate.tied``) back beside the name they were written under."""
    if TIED_KEY not in meta:
        return tensors
    try:
        aliases = json.loads(meta[TIED_KEY])
        ok = isinstance(aliases, dict) and all(
            isinstance(v, str) and v in tensors and k not in tensors for k, v in aliases.items()
        )  # export names an alias only for a tensor it did not store: one the file holds is never replaced
    except (ValueError, RecursionError):
        ok = False
    if not ok:
        raise CorruptCheckpointError(
            f"{path}: __metadata__ {TIED_KEY} does not map names the file lacks to tensors of the file"
        )
    out = dict(tensors)
    for alias, kept in aliases.items():
        out[str(alias)] = tensors[kept]._replace(identity=("tied", str(path), kept))
        out[kept] = out[alias]
    return out


def confined(file: Path, folder: Path) -> Path:
    """Where the file ``file`` of a Hugging Face folder really is, refused when a link takes it out of
    ``folder``; in a hub cache snapshot (``<repo>/snapshots/<revision>/``, whose files link to
    ``../../blobs/<hash>``) the repo's ``blobs`` folder counts as inside. Downloaded folders are untrusted:
    a link to ``~/.ssh/`` or another model's weights is no weight of this one."""
    root = folder.resolve()
    real = file.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    if not any(real.is_relative_to(place) for place in allowed):
        where = " or its hub cache's blobs" if len(allowed) > 1 else ""
        raise CorruptCheckpointError(
            f"{file} is a link to {real}, outside {root}{where}: refused (a model folder's weights are its own "
            "files). Pass the file itself to import it"
        )
    return real


def _sharded(index: Path) -> dict[str, Any]:
    """The tensors of a sharded Hugging Face folder, shard by shard, as its index maps them."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{index} is not a Hugging Face weight index ({e!s:.80})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CorruptCheckpointError(f"{index}: weight_map is not a mapping of tensor names to shard files")
    out: dict[str, Any] = {}
    views = torch_file.Views(_size(index.parent))  # one budget for every shard: several may be one file
    by_shard: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(name)
    read: dict[tuple[int, int], tuple[str, Any, dict[str, int]]] = {}  # each file read once, however many names
    # reach it: its kind, its tensors, and each name's place in it (the order they are imported in)
    for shard in sorted(by_shard):
        plain = Path(shard).name == shard and "\\" not in shard and not shard.startswith(".")
        if not plain or not shard.endswith((".safetensors", ".bin")):
            raise CorruptCheckpointError(f"{index} names shard {shard!r:.80}, which is not a file of its folder")
        wanted = by_shard[shard]
        if not (index.parent / shard).is_file():
            raise CorruptCheckpointError(f"{index} names shard {shard}, which is missing")
        file = confined(index.parent / shard, index.parent)
        st = file.stat()
        if (st.st_dev, st.st_ino) not in read:
            kind, tensors, _ = _read_file(file, shard)
            if not isinstance(tensors, dict):
                raise CorruptCheckpointError(f"{file} does not hold a mapping of names to tensors")
            read[st.st_dev, st.st_ino] = (kind, tensors, {name: i for i, name in enumerate(tensors)})
        kind, tensors, place = read[st.st_dev, st.st_ino]
        missing = sorted(wanted - tensors.keys())
        if missing:
            raise CorruptCheckpointError(f"{index} maps {missing[:5]} to {shard}, which does not hold them")
        for name in sorted(wanted, key=place.__getitem__):
            value = tensors[name]
            out[name] = (
                value
                if kind == "safetensors"
                else torch_file.source_tensor(value, name, where=file, views=views) or value
            )
    return out
