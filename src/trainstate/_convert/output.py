"""Where an export lands: written aside, flushed, then renamed into place, so OUT is whole or absent.

An export is a directory (a Hugging Face folder) or one file (``model.safetensors``, ``pytorch_model.bin``).
Either is written under a hidden sibling name (``.trainstate-tmp-<OUT in hex>-<random>``, as a checkpoint is staged), every file fsynced, then renamed to
OUT and the parent directory fsynced: a crash leaves OUT as it was, never half written. The export holds an
``flock`` on its staging name while it writes, so the next export to the same OUT removes what a killed one
left (a lock it can take has no living writer) and leaves a running one alone. Replacing an
existing OUT needs ``overwrite=True``; a trainstate checkpoint is never replaced by an export (exporting
onto the checkpoint being read, or onto the run's directory, is a typo that would destroy them).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainstate._format.manifest import MANIFEST_NAME
from trainstate._format.run_dir import staged_target, staging_name
from trainstate._storage.local import fsync_path
from trainstate.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    StorageError,
)

# Files --copy-from leaves behind: weights (the export writes its own) and what a hub cache keeps beside them.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")
_INDEX = re.compile(r".*\.index\.json$")


def _refuse_existing(out: Path, overwrite: bool, *, directory: bool) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or out.is_dir() != directory:
        kind = "a directory" if directory else "a file"
        raise CheckpointExistsError(f"{out} exists and is not {kind}; refusing to replace it: choose another OUT")
    if directory and (out / MANIFEST_NAME).exists():
        raise CheckpointExistsError(
            f"{out} is a trainstate checkpoint; an export never replaces one: choose another OUT"
        )
    if directory and any(child.is_dir() and not child.is_symlink() for child in out.iterdir()):
        # An export is a flat folder of files; one with folders in it may hold runs (at any depth: a parent of
        # several runs' directories once lost them all to --overwrite).
        raise CheckpointExistsError(
            f"{out} holds folders (trainstate checkpoints or runs, maybe); an export replaces only a folder of "
            "files, as an export writes: choose another OUT"
        )
    if directory and not any(out.iterdir()):
        return  # an empty directory: nothing to lose
    if not overwrite:
        raise CheckpointExistsError(f"{out} already exists; pass overwrite=True to replace it")


@contextmanager
def staged(out: str | os.PathLike[str], *, overwrite: bool, directory: bool) -> Iterator[Path]:
    """Yield where to write ``out``'s content: a fresh hidden sibling directory (or, for a file, a path inside
    one); on success it replaces ``out`` atomically.

    The caller writes (and fsyncs) its files there. On any failure the sibling is removed and ``out`` is
    left as it was. Leftovers of earlier exports to ``out`` that were killed are removed first.
    """
    final = Path(out)
    _refuse_existing(final, overwrite, directory=directory)
    stage = final.parent / staging_name(final.name, "tmp")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        sweep_leftovers(final)
        stage.mkdir()
        lock = _locked(stage)
    except OSError as e:
        raise StorageError(e.errno, f"cannot create {stage}: {e.strerror}") from e
    try:
        yield stage if directory else stage / final.name
        fsync_path(stage)
        _refuse_existing(final, overwrite, directory=directory)  # again: someone may have made it meanwhile
        old = None
        if directory and final.exists() and any(final.iterdir()):  # a directory cannot be renamed over
            old = final.parent / staging_name(final.name, "old")
            os.rename(final, old)
        try:
            os.replace(stage if directory else stage / final.name, final)  # one step
        except BaseException:
            if old is not None:
                os.rename(old, final)
            raise
        fsync_path(final.parent)
        if not directory:
            os.rmdir(stage)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        _remove(stage)
        if isinstance(e, CheckpointError):  # already trainstate's (a StorageError, a missing folder)
            raise
        raise StorageError(e.errno, f"writing {final} failed: {e.strerror or e}") from e
    except BaseException:
        _remove(stage)
        raise
    finally:
        os.close(lock)


def _locked(path: Path) -> int:
    """A descriptor of directory ``path`` holding an exclusive ``flock``; the kernel drops it when the
    process dies, so a lock that can be taken has no living writer."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep_leftovers(out: Path) -> list[str]:
    """Clear what killed exports to ``out`` left beside it: staging directories no living process holds, and
    the previous export moved aside by a replace killed between its two renames (put back when ``out`` is
    missing, else removed). Returns the names handled."""
    swept = []
    for name in sorted(os.listdir(out.parent)):
        leftover = out.parent / name
        staged = staged_target(name)
        if staged == (out.name, "old"):
            if out.exists() or out.is_symlink():
                _remove(leftover)
            else:
                os.rename(leftover, out)
            swept.append(name)
        elif staged == (out.name, "tmp") and leftover.is_dir() and not leftover.is_symlink():
            try:
                fd = _locked(leftover)
            except OSError:  # held: an export is writing there (or it is gone already)
                continue
            try:
                _remove(leftover)
                swept.append(name)
            finally:
                os.close(fd)
    return swept


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def model_folder(src: str | os.PathLike[str]) -> Path:
    """``src`` as a folder to copy from, checked before anything is written."""
    root = Path(src)
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"copy_from: {root} is not a directory (expected a model folder with config.json)"
        )
    if (root / MANIFEST_NAME).exists():  # its manifest copied beside the weights made OUT a broken checkpoint
        raise InvalidArgumentError(
            f"copy_from: {root} is a trainstate checkpoint, not a model folder: copy_from takes the folder whose "
            "config and tokenizer files the export needs (e.g. the model's Hugging Face folder)"
        )
    return root


def copy_beside(src: str | os.PathLike[str], dst: Path) -> list[str]:
    """Copy a model folder's other files (config, tokenizer, generation config, README) from ``src`` into
    ``dst``, subfolders included; weights, weight indexes and hidden files are left behind. Returns the
    copied paths, relative to ``dst``; each copy is fsynced."""
    root = Path(src)
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"copy_from: {root} is not a directory (expected a model folder with config.json)"
        )
    copied = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith(".") or name.endswith(WEIGHT_SUFFIXES) or _INDEX.match(name):
                continue
            source = Path(dirpath) / name
            rel = source.relative_to(root)
            target = dst / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                raise InvalidArgumentError(f"copy_from: {rel} would replace a file the export wrote")
            shutil.copyfile(source, target)
            fsync_path(target)
            copied.append(rel.as_posix())
    for d in {Path(c).parent for c in copied if "/" in c}:
        fsync_path(dst / d)
    return sorted(copied)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_size(value: int | str) -> int:
    """Bytes from ``2GB`` (10^9, as Hugging Face counts), ``500MiB`` (2^20), or an int."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise InvalidArgumentError(
                f"max_shard_size: expected a size like 2GB, 500MB or 1GiB (or a number of bytes), got {value!r:.40}"
            )
        number, unit = float(m.group(1)), m.group(2).lower()
    size = int(number * _UNITS[unit])
    if size < 1:
        raise InvalidArgumentError(f"max_shard_size must be at least one byte, got {value!r:.40}")
    return size
