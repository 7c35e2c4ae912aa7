"""``trainstate prune``: a CheckpointManager's retention policies applied now, from the shell.

A writable CheckpointManager takes the directory's lock (so prune refuses to run beside a training job
that has the directory open) and sweeps leftovers of crashed saves when it starts; the output lists what
that sweep removed. ``prune --dry-run`` uses a read-only manager and deletes nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from trainstate._cli._args import OK, Subparsers, UsageError, best_metric, command, positive_int, positive_minutes
from trainstate._cli._ls import directory_rows, pool_bytes
from trainstate._cli._open import require_dir
from trainstate._cli._output import Printer, Table, local_time, metrics_text, size
from trainstate._manager import CheckpointInfo, CheckpointManager


def add_parser(sub: Subparsers) -> None:
    p = command(sub, "prune", "apply retention policies to a manager directory now")
    p.add_argument("path", metavar="DIR")
    p.add_argument("--keep-last", type=positive_int, metavar="N", help="keep the newest N")
    p.add_argument("--keep-every-steps", type=positive_int, metavar="N", help="keep steps that are multiples of N")
    p.add_argument("--keep-every-minutes", type=positive_minutes, metavar="M", help="keep one per M minutes")
    p.add_argument(
        "--keep-best",
        type=best_metric,
        metavar="METRIC:min|max:K",
        help="keep the K best by a metric recorded at save time",
    )
    p.add_argument("--dry-run", action="store_true", help="show the plan, delete nothing")


def run(args: argparse.Namespace) -> int:
    return prune(
        Printer(args.json),
        args.path,
        keep_last=args.keep_last,
        keep_every_steps=args.keep_every_steps,
        keep_every_minutes=args.keep_every_minutes,
        keep_best=args.keep_best,
        dry_run=args.dry_run,
        key_env=args.key_env,
    )


@contextmanager
def _writable(directory: str, **policies: Any) -> Iterator[CheckpointManager]:
    mgr = CheckpointManager(directory, save_on_preemption=False, capture_rng=False, **policies)
    try:
        yield mgr
    finally:
        mgr.close()


def _swept_line(out: Printer, swept: list[str], dry_run: bool = False) -> None:
    if swept:
        verb = "would be removed" if dry_run else "removed"
        out.line(f"leftovers of unfinished saves {verb}: {', '.join(swept)}", style="yellow")


def prune(
    out: Printer,
    directory: str,
    *,
    keep_last: int | None,
    keep_every_steps: int | None,
    keep_every_minutes: float | None,
    keep_best: tuple[str, str, int] | None,
    dry_run: bool,
    key_env: str | None = None,
) -> int:
    policies: dict[str, Any] = {
        "keep_last": keep_last,
        "keep_every_steps": keep_every_steps,
        "keep_every_minutes": keep_every_minutes,
        "keep_best": keep_best,
    }
    if not any(v is not None for v in policies.values()):
        raise UsageError(
            "prune needs at least one policy: --keep-last, --keep-every-steps, --keep-every-minutes or --keep-best"
        )
    require_dir(directory)
    pool_before = pool_bytes(directory)
    if dry_run:
        mgr = CheckpointManager(directory, read_only=True, key_env=key_env, **policies)  # no lock, sweep, deletes
        infos = mgr.list()
        plan = mgr.prune(dry_run=True)
        swept = [r["name"] for r in directory_rows(directory, key_env) if r["status"] == "incomplete"]
    else:
        with _writable(directory, key_env=key_env, **policies) as mgr:
            infos = mgr.list()
            plan = mgr.prune()
            swept = list(mgr.swept)
    by_name: dict[str, CheckpointInfo] = {i.name: i for i in infos}
    # an incremental checkpoint's bytes are in the shared pool: deleting it frees only what no kept one uses
    freed = sum(_size(by_name[n]) - by_name[n].pooled for n in plan.delete if n in by_name)
    if not dry_run:
        freed += pool_before - pool_bytes(directory)
    if out.json_mode:
        out.json(
            {
                "path": directory,
                "dry_run": dry_run,
                "keep": plan.keep,
                "delete": plan.delete,
                "freed_bytes": freed,
                ("would_sweep" if dry_run else "swept"): swept,
            }
        )
        return OK
    deleting = set(plan.delete)
    t = Table(
        ["name", "step", "time", "size", "metrics", "action", "why"],
        right=frozenset({"step", "size"}),
        title=f"{directory}" + (" (dry run: nothing is deleted)" if dry_run else ""),
    )
    for info in infos:
        gone = info.name in deleting
        action = ("would delete" if dry_run else "deleted") if gone else "keep"
        why = "" if gone else ", ".join(plan.keep.get(info.name, []))
        t.add(
            info.name,
            info.step,
            local_time(info.created),
            size(_size(info)),
            metrics_text(info.metrics),
            action,
            why,
            style="red" if gone else None,
        )
    out.table(t)
    _swept_line(out, swept, dry_run)
    verb = "would delete" if dry_run else "deleted"
    pooled = " outside the shared pool" if dry_run and any(by_name[n].pooled for n in deleting if n in by_name) else ""
    out.line(f"{len(infos) - len(deleting)} kept, {len(deleting)} {verb} ({size(freed)}{pooled})")
    return OK


def _size(info: CheckpointInfo) -> int:
    """A checkpoint's size as ``ls`` and ``inspect`` show it: its manifest and every data file it reads."""
    return info.nbytes + info.manifest_nbytes
