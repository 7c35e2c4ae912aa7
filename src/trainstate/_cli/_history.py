"""``trainstate history DIR``: every save of a run, with its timings, metrics and what became of its checkpoint.

A table (or ``--json``) of :func:`trainstate.history`'s entries; ``--plot OUT.png`` also draws them
(:func:`trainstate.plot_history`, the ``plot`` extra). Reads manifests and ``_history/`` records only.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from trainstate._cli._args import OK, Subparsers, UsageError, command
from trainstate._cli._ls_tier import is_local_tier, tier_folders
from trainstate._cli._open import require_dir
from trainstate._cli._output import Printer, Table, local_time, metrics_text, size
from trainstate._manager.history import HistoryEntry
from trainstate._manager.history import history as read_history
from trainstate._manager.history_plot import chosen_metrics, draw
from trainstate.errors import InvalidArgumentError

_STYLES = {"deleted": "dim", "replaced": "yellow", "failed": "red", "damaged": "red"}


def add_parser(sub: Subparsers) -> None:
    p = command(sub, "history", "every save of a manager directory: time, size, seconds, metrics, kept or deleted")
    p.add_argument("path", metavar="DIR", help="a CheckpointManager directory")
    p.add_argument(
        "--plot", metavar="OUT", help="also draw save times and metrics over steps into this image (.png, .svg, .pdf)"
    )
    p.add_argument(
        "--metric",
        metavar="NAME",
        action="append",
        help="only this metric, in the table and as a panel of the plot (repeatable; default: all)",
    )


def run(args: argparse.Namespace) -> int:
    return history(Printer(args.json), args.path, plot=args.plot, metrics=args.metric, key_env=args.key_env)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 100 else f"{value:.0f}"


def _status(e: HistoryEntry) -> str:
    text = e.status + (", pinned" if e.pinned else "")
    detail = "; ".join(part for part in (e.error or "", e.note) if part)
    return f"{text}: {detail}" if detail else text


def history(
    out: Printer,
    path: str,
    *,
    plot: str | None = None,
    metrics: list[str] | None = None,
    key_env: str | None = None,
) -> int:
    path = path.rstrip("/") or "/"
    require_dir(path)
    if is_local_tier(path) and plot is None:  # each process's folder of a local tier (LocalTier), one after another
        folders = tier_folders(path)
        if out.json_mode:
            saves = {
                f.rsplit("/", 2)[-2] + "/" + f.rsplit("/", 1)[-1]: read_history(f, key_env=key_env) for f in folders
            }
            out.json(
                {
                    "path": path,
                    "kind": "local tier",
                    "folders": {k: [dataclasses.asdict(e) for e in v] for k, v in saves.items()},
                }
            )
            return OK
        for folder in folders:
            history(out, folder, metrics=metrics, key_env=key_env)
        if not folders:
            out.line(f"no saves in the local tier {path}")
        return OK
    entries = read_history(path, key_env=key_env)
    try:
        shown = chosen_metrics(entries, metrics or None)  # --metric also narrows the table's metrics
    except InvalidArgumentError as error:
        raise UsageError(str(error)) from None
    if plot is not None:
        draw(entries, plot, shown, path)
    if out.json_mode:
        out.json({"path": path, "saves": [dataclasses.asdict(e) for e in entries], "plot": plot})
        return OK
    if not entries:
        out.line(f"no saves in {path}")
        return OK
    t = Table(
        ["step", "time", "wrote", "blocked s", "write s", "commit s", "metrics", "status"],
        right=frozenset({"step", "wrote", "blocked s", "write s", "commit s"}),
        title=f"saves in {path}",
    )
    for e in entries:
        t.add(
            e.step,
            local_time(e.time),
            size(e.nbytes),
            _seconds(e.blocking_seconds),
            _seconds(e.write_seconds),
            _seconds(e.commit_seconds),
            metrics_text({k: v for k, v in e.metrics.items() if k in shown}),
            _status(e),
            style=_STYLES.get(e.status),
        )
    out.table(t)
    out.line(_summary(entries))
    out.line("wrote: what each save wrote (its new data files and the manifest); `trainstate ls` shows sizes")
    if plot is not None:
        out.line(f"plot written to {plot}")
    return OK


def _summary(entries: list[HistoryEntry]) -> str:
    counts = {s: sum(e.status == s for e in entries) for s in ("kept", "deleted", "replaced", "failed", "damaged")}
    text = f"{len(entries)} saves (" + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ")"
    timed = [e for e in entries if e.status != "failed" and e.blocking_seconds is not None]
    if timed:
        blocked = [e.blocking_seconds or 0.0 for e in timed]
        wrote = [(e.write_seconds or 0.0) + (e.commit_seconds or 0.0) for e in timed]
        text += (
            f"; training blocked {statistics.fmean(blocked):.3f} s per save on average ({max(blocked):.3f} s at "
            f"most); write + commit {statistics.fmean(wrote):.3f} s on average"
        )
    return text
