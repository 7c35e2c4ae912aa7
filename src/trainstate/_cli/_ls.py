"""``trainstate ls``: a manager directory's checkpoints (complete, incomplete, corrupt) or one checkpoint; manifests only."""

from __future__ import annotations

import argparse
import logging
import os
import posixpath
import re
from typing import Any

from trainstate import open as open_checkpoint
from trainstate._cli._args import Subparsers, command
from trainstate._cli._ls_tier import is_local_tier, tier_ls
from trainstate._cli._open import manifest_size, require_dir, shared_size
from trainstate._cli._output import Printer, Table, clip, local_time, metrics_text, size
from trainstate._format.manifest import MANIFEST_NAME
from trainstate._format.run_dir import DELETE_MARKER, POOL_DIR, is_staging_name, staged_target, step_of
from trainstate._manager import CheckpointInfo, CheckpointManager
from trainstate._restore.checkpoint import Checkpoint
from trainstate._storage import Storage, resolve
from trainstate.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    StorageError,
)

_STAGING_NOTE = {"tmp": "unfinished save", "old": "replaced checkpoint not yet removed", "del": "unfinished delete"}
_STAGING_STATUS = {"tmp": "incomplete", "old": "incomplete", "del": "deleting"}
_DELETING_NOTE = "a delete began and did not finish; a manager's sweep removes it"


def add_parser(sub: Subparsers) -> None:
    p = command(sub, "ls", "list the checkpoints of a manager directory (or show one checkpoint)")
    p.add_argument("path", metavar="DIR", help="a CheckpointManager directory, or one checkpoint")


def run(args: argparse.Namespace) -> int:
    return ls(Printer(args.json), args.path, key_env=args.key_env)


def _is_dir(backend: Storage, path: str) -> bool:
    info = backend.stat(path)
    return info is not None and info.is_dir


def _parent_and_name(backend: Storage, root: str) -> tuple[str, str]:
    if backend.capabilities.symlinks:  # a link (``latest``) stands for the checkpoint it points to
        return os.path.split(os.path.realpath(root))
    return posixpath.dirname(root.rstrip("/")), posixpath.basename(root.rstrip("/"))


def _row(info: CheckpointInfo, path: str, manifest_nbytes: int) -> dict[str, Any]:
    """A committed checkpoint's row. Its sizes, the same in ``ls``, ``inspect`` and ``history``:
    ``size_nbytes`` (its manifest and every data file it reads, shared pool files included),
    ``written_nbytes`` (what its save wrote: the data files new in it and the manifest; what ``history``
    counts), and their parts ``nbytes`` (data files), ``shared_nbytes`` (data files an earlier save wrote),
    ``manifest_nbytes``."""
    return {
        "name": info.name,
        "path": path,
        "step": info.step,
        "created": info.created,
        "created_iso": local_time(info.created),
        "modified": None,
        "size_nbytes": info.nbytes + manifest_nbytes,
        "written_nbytes": info.nbytes - info.shared + manifest_nbytes,
        "nbytes": info.nbytes,
        "manifest_nbytes": manifest_nbytes,
        "shared_nbytes": info.shared,
        "metrics": dict(info.metrics),
        "epoch": info.epoch,
        "pinned": info.pinned,
        "pin_reason": info.pin_reason,
        "status": "complete",
        "note": "",
    }


def _other_row(backend: Storage, name: str, path: str, status: str, note: str) -> dict[str, Any]:
    staged = staged_target(name)
    step = step_of(staged[0] if staged else name)
    nbytes, modified = 0, None
    try:
        for entry in backend.list(path):
            info = backend.stat(backend.join(path, entry))
            nbytes += info.size if info is not None and not info.is_dir else 0
        top = backend.stat(path)
        modified = top.mtime if top is not None and top.mtime else None
    except StorageError:
        pass
    return {
        "name": name,
        "path": path,
        "step": step,
        "created": None,
        "created_iso": "",
        "modified": modified,
        "size_nbytes": nbytes,
        "written_nbytes": nbytes,
        "nbytes": nbytes,
        "manifest_nbytes": 0,
        "shared_nbytes": 0,
        "metrics": {},
        "epoch": None,
        "pinned": False,
        "pin_reason": "",
        "status": status,
        "note": note,
    }


def _probe(backend: Storage, name: str, path: str, key_env: str | None) -> dict[str, Any] | None:
    """A row for a step directory the catalog did not list (incomplete, damaged, or committed just now), or
    for a checkpoint no manager wrote (Lightning's ``epoch=0-step=10.ckpt``, ``trainstate.save``'s): no step."""
    step = step_of(name)
    try:
        with open_checkpoint(path, backend, key_env=key_env) as ck:
            info = CheckpointInfo(name, step or 0, ck.created, nbytes=ck.nbytes, shared=shared_size(ck), path=path)
            row = _row(info, path, manifest_size(backend, path))
            row["step"] = step
            return row
    except IncompleteCheckpointError:
        if _deleting(backend, path):
            return _other_row(backend, name, path, "deleting", _DELETING_NOTE)
        return _other_row(backend, name, path, "incomplete", "no manifest")
    except CorruptCheckpointError as e:
        return _other_row(backend, name, path, "corrupt", " ".join(str(e).split()))
    except FormatVersionError as e:
        return _other_row(backend, name, path, "newer format", " ".join(str(e).split()))
    except CheckpointNotFoundError:
        return None  # deleted meanwhile


def directory_rows(directory: str, key_env: str | None = None) -> list[dict[str, Any]]:
    backend, root = resolve(directory)
    logger = logging.getLogger("trainstate")
    level = logger.level
    logger.setLevel(logging.ERROR)  # damaged checkpoints become rows below, not warnings
    try:
        infos = CheckpointManager(root, read_only=True, storage=backend, key_env=key_env).list()
    finally:
        logger.setLevel(level)
    rows = [_row(i, i.path, manifest_size(backend, i.path)) for i in infos]
    listed = {i.name for i in infos}
    entries = backend.list(root)
    if POOL_DIR not in entries:  # an incremental run whose pool is gone: its checkpoints cannot load
        for listed_row, info in zip(rows, infos):
            if info.pooled:
                listed_row["status"] = "pool missing"
                listed_row["note"] = f"its data files were in {POOL_DIR}/, which is gone"
    for name in entries:
        path = backend.join(root, name)
        if name in listed or not _is_dir(backend, path):
            continue
        if step_of(name) is None and not is_staging_name(name):  # a checkpoint no manager wrote, or no checkpoint
            if _has_manifest(backend, path):
                row = _probe(backend, name, path, key_env)
                if row is not None:
                    rows.append(row)
            elif name.endswith(".ckpt"):  # Lightning's name for a checkpoint: one whose save did not finish
                rows.append(_other_row(backend, name, path, "incomplete", "no manifest (a save that did not finish)"))
        elif step_of(name) is not None:
            row = _probe(backend, name, path, key_env)
            if row is not None:
                rows.append(row)
        else:
            staged = staged_target(name)
            status = _STAGING_STATUS[staged[1]] if staged else "incomplete"
            rows.append(_other_row(backend, name, path, status, _STAGING_NOTE[staged[1]] if staged else "leftover"))
    rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0, _natural(r["name"])))
    return rows


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """``epoch=2`` before ``epoch=10``: the numbers in a name compared as numbers."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


def _has_manifest(backend: Storage, path: str) -> bool:
    try:
        return backend.stat(backend.join(path, MANIFEST_NAME)) is not None
    except StorageError:
        return False


def _deleting(backend: Storage, path: str) -> bool:
    """Whether a checkpoint without a manifest is one whose delete began (object stores mark it first)."""
    try:
        return backend.stat(backend.join(path, DELETE_MARKER)) is not None
    except StorageError:
        return False


def _single_row(path: str, ck: Checkpoint, key_env: str | None) -> dict[str, Any]:
    parent, name = _parent_and_name(ck.storage, ck.path)
    manifest_nbytes = manifest_size(ck.storage, ck.path)
    if step_of(name) is not None:
        for info in CheckpointManager(parent, read_only=True, storage=ck.storage, key_env=key_env).list():
            if info.name == name:
                return _row(info, path, manifest_nbytes)
    info = CheckpointInfo(name, 0, ck.created, nbytes=ck.nbytes, shared=shared_size(ck), path=ck.path)
    row = _row(info, path, manifest_nbytes)
    row["step"] = None  # not a manager's checkpoint: no step, metrics or pin
    return row


def ls(out: Printer, path: str, *, key_env: str | None = None) -> int:
    path = path.rstrip("/") or "/"
    require_dir(path)
    kind = "checkpoint"
    try:
        with open_checkpoint(path, key_env=key_env) as ck:
            rows = [_single_row(path, ck, key_env)]
    except (IncompleteCheckpointError, CheckpointNotFoundError):  # not one checkpoint: list the directory
        backend, root = resolve(path)
        name = _parent_and_name(backend, root)[1]
        staged = staged_target(name)
        if staged:
            rows = [_other_row(backend, name, root, _STAGING_STATUS[staged[1]], _STAGING_NOTE[staged[1]])]
        elif step_of(name) is not None and _deleting(backend, root):
            rows = [_other_row(backend, name, root, "deleting", _DELETING_NOTE)]
        elif step_of(name) is not None or is_staging_name(name):
            rows = [_other_row(backend, name, root, "incomplete", "no manifest")]
        elif is_local_tier(path):
            return tier_ls(out, path, lambda folder: directory_rows(folder, key_env))
        else:
            kind, rows = "directory", directory_rows(path, key_env)
    pool = pool_bytes(path) if kind == "directory" else None
    if out.json_mode:
        out.json({"path": path, "kind": kind, "checkpoints": rows, **({"pool_nbytes": pool} if pool else {})})
        return 0
    if not rows:
        out.line(f"no checkpoints in {path}")
        return 0
    shares = any(r["shared_nbytes"] for r in rows)  # incremental: what each save wrote beside what it uses
    t = Table(
        ["name", "step", "time", "size", *(["wrote"] if shares else []), "metrics", "pinned", "status"],
        right=frozenset({"step", "size", "wrote"}),
        title=f"checkpoints in {path}" if kind == "directory" else None,
    )
    for r in rows:
        status = r["status"] if not r["note"] else f"{r['status']}: {clip(r['note'], 70)}"
        style = {
            "incomplete": "yellow",
            "deleting": "dim",
            "corrupt": "red",
            "pool missing": "red",
            "newer format": "magenta",
        }.get(r["status"])
        t.add(
            r["name"],
            "" if r["step"] is None else r["step"],
            r["created_iso"],
            size(r["size_nbytes"]),
            *([size(r["written_nbytes"])] if shares else []),
            metrics_text(r["metrics"]),
            _pin_text(r),
            status,
            style=style,
        )
    out.table(t)
    complete = [r for r in rows if r["status"] == "complete"]
    others = {s: sum(r["status"] == s for r in rows) for s in ("incomplete", "deleting", "corrupt", "pool missing")}
    extra = "".join(f", {n} {s}" for s, n in others.items() if n)
    if pool:  # checkpoints share the pool's files: their sizes overlap
        out.line(f"{len(complete)} complete{extra}; {size(pool)} in the shared pool, which they share")
    else:
        total = size(sum(r["size_nbytes"] for r in complete))
        out.line(f"{len(complete)} complete{extra}; {total} in complete checkpoints")
    if shares:
        out.line(
            "size: the manifest and every data file it reads, shared ones included; wrote: its save's new data "
            "files and manifest (as in `trainstate history`)"
        )
    return 0


def pool_bytes(directory: str) -> int:
    """The bytes in a run directory's shared pool (incremental checkpoints); 0 without one."""
    backend, root = resolve(directory)
    pool = backend.join(root, POOL_DIR)
    total = 0
    for name in backend.list(pool):
        info = backend.stat(backend.join(pool, name))
        total += info.size if info is not None and not info.is_dir else 0
    return total


def _pin_text(row: dict[str, Any]) -> str:
    if not row["pinned"]:
        return ""
    return clip(row["pin_reason"], 30) if row.get("pin_reason") else "yes"
