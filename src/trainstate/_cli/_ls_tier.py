"""``trainstate ls`` of a local tier's path (``LocalTier``): each process's folder of local checkpoints, and how
much of the filesystem (a tmpfs: memory) they hold."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainstate._cli._output import Printer, Table, size
from trainstate._manager.local_tier import MARKER


def is_local_tier(path: str) -> bool:
    return "://" not in path and (Path(path) / MARKER).is_file()


def filesystem(path: str) -> dict[str, Any]:
    """The filesystem ``path`` is on: its type (from /proc/mounts, where there is one), size and free bytes."""
    stat = os.statvfs(path)
    kind = None
    try:
        real, best = os.path.realpath(path), ""
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and (real == fields[1] or real.startswith(fields[1].rstrip("/") + "/")):
                if len(fields[1]) >= len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        pass
    return {"type": kind, "size_nbytes": stat.f_blocks * stat.f_frsize, "free_nbytes": stat.f_bavail * stat.f_frsize}


def tier_ls(out: Printer, path: str, rows_of: Any) -> int:
    """List each process's local checkpoints (``rows_of(folder)``: ``trainstate ls`` rows of a run directory)."""
    try:
        durable = json.loads((Path(path) / MARKER).read_text()).get("durable")
    except (OSError, ValueError, AttributeError):
        durable = None
    folders = [Path(f) for f in tier_folders(path)]
    by_folder = {f"{p.parent.name}/{p.name}": rows_of(str(p)) for p in folders}
    # a process's own folder holds its manager's lock file; the others hold copies other nodes sent
    copies = {f"{p.parent.name}/{p.name}" for p in folders if not (p / ".trainstate.lock").exists()}
    fs = filesystem(path)
    held = sum(r["size_nbytes"] for rows in by_folder.values() for r in rows if r["status"] == "complete")
    if out.json_mode:
        out.json(
            {
                "path": path,
                "kind": "local tier",
                "durable": durable,
                "held_nbytes": held,
                "filesystem": fs,
                "folders": by_folder,
                "copies": sorted(copies),  # folders of copies other nodes sent, not this node's own
            }
        )
        return 0
    t = Table(
        ["folder", "holds", "name", "step", "time", "size", "status"],
        right=frozenset({"step", "size"}),
        title=f"local tier in {path} (of the run in {durable})",
    )
    for folder, rows in by_folder.items():
        for r in rows:
            t.add(
                folder,
                "copies" if folder in copies else "own",
                r["name"],
                "" if r["step"] is None else r["step"],
                r["created_iso"],
                size(r["size_nbytes"]),
                r["status"],
            )
    out.table(t)
    kind = f"{fs['type']} " if fs["type"] else ""
    out.line(
        f"{size(held)} in complete local checkpoints; the {kind}filesystem has {size(fs['free_nbytes'])} free of "
        f"{size(fs['size_nbytes'])}" + (" (tmpfs: memory)" if fs["type"] == "tmpfs" else "")
    )
    return 0


def tier_folders(path: str) -> list[str]:
    """A local tier's folders (``w{world}/rank{r}``), in order."""
    return sorted(
        str(p)
        for w in Path(path).iterdir()
        if w.is_dir() and w.name.startswith("w")
        for p in w.iterdir()
        if p.is_dir() and p.name.startswith("rank")
    )
