""":func:`trainstate.plot_history`: a run's save times and metrics over steps, as a matplotlib figure.

matplotlib (the ``plot`` extra) is imported only here, only when called, and never through pyplot: the
figure is drawn on its own Agg canvas, so nothing opens a window, a notebook's backend is left as it was,
and a script on a server without a display works.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from trainstate._manager.history import HistoryEntry, history
from trainstate._optional import optional
from trainstate.errors import CheckpointNotFoundError, InvalidArgumentError


def plot_history(
    run: str | os.PathLike[str] | Sequence[HistoryEntry],
    path: str | os.PathLike[str] | None = None,
    *,
    metrics: Sequence[str] | None = None,
    key_env: str | None = None,
) -> Any:
    """Draw a run's saves: what each save cost over the steps (how long it blocked the training loop, and
    how long it took to write and commit), and each chosen metric over the steps.

    In a metric's panel, checkpoints still in the directory are filled dots, deleted ones hollow; a failed save
    is a red cross, and a dotted line marks the first save of each new process (a restart). A rollback (a step
    saved again after resuming from an older checkpoint) starts a new line, so the abandoned timeline stays
    visible beside the new one.

    Args:
        run: a run directory, or the entries :func:`trainstate.history` returned.
        path: where to write the image (its suffix picks the format: ``.png``, ``.svg``, ``.pdf``); None
            writes nothing.
        metrics: the metrics to draw, one panel each (default: every metric the saves recorded).
        key_env: an encrypted run's key variable, when ``run`` is a directory.

    Returns:
        The ``matplotlib.figure.Figure`` (a notebook shows it when it is the cell's value).

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install "trainstate[plot]"``).
        InvalidArgumentError: a metric no save recorded.
        CheckpointNotFoundError: the run has no saves to draw.

    Example:
        >>> trainstate.plot_history("runs/exp1", "exp1.png", metrics=["loss"])
        <Figure size 800x500 with 2 Axes>
    """
    if isinstance(run, (str, os.PathLike)):
        return draw(history(run, key_env=key_env), path, metrics, os.fspath(run))
    entries = list(run) if isinstance(run, (list, tuple)) else None
    if entries is None or not all(isinstance(e, HistoryEntry) for e in entries):
        raise InvalidArgumentError(
            f"plot_history takes a run directory or trainstate.history()'s entries, got {run!r:.60}"
        )
    return draw(entries, path, metrics, "")


def chosen_metrics(entries: Sequence[HistoryEntry], metrics: Sequence[str] | None) -> list[str]:
    """``metrics`` without repeats, or every metric the saves recorded; InvalidArgumentError for one that
    no save recorded."""
    recorded = list(dict.fromkeys(name for e in entries for name in e.metrics))
    if metrics is None:
        return recorded
    if isinstance(metrics, str):
        metrics = [metrics]
    chosen = list(dict.fromkeys(metrics))
    unknown = [m for m in chosen if m not in recorded]
    if unknown:
        have = ", ".join(recorded) if recorded else "none"
        raise InvalidArgumentError(
            f"no save recorded the metric(s) {', '.join(unknown)} (recorded: {have}); mgr.save(step, state, "
            "metrics={...}) records them"
        )
    return chosen


def draw(
    entries: Sequence[HistoryEntry], path: str | os.PathLike[str] | None, metrics: Sequence[str] | None, where: str
) -> Any:
    """:func:`plot_history` of ``entries``; ``where`` names the run in the title."""
    if not entries:
        raise CheckpointNotFoundError(f"no saves to plot{' in ' + where if where else ''}")
    chosen = chosen_metrics(entries, metrics)
    with optional("matplotlib", extra="plot", needed_for="plotting a run's history"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

    panels = 1 + len(chosen)
    height = 1.0 + 2.0 * panels  # inches; fixed margins, since a layout engine would double the drawing time
    fig = Figure(figsize=(8, height))
    fig.subplots_adjust(left=0.1, right=0.97, top=1 - 0.45 / height, bottom=0.55 / height, hspace=0.12)
    FigureCanvasAgg(fig)  # its own canvas: no pyplot, no window, the global backend untouched
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    restarts = [e.step for e in entries if "new process" in e.note]
    for ax in axes:
        for n, step in enumerate(restarts):
            ax.axvline(step, color="grey", linestyle=":", lw=1, label="new process" if n == 0 else None)
    _save_times(axes[0], entries)
    for n, (ax, metric) in enumerate(zip(axes[1:], chosen)):
        _metric(ax, entries, metric, legend=n == 0)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"saves of {where}" if where else "saves")
    if path is not None:
        fig.savefig(os.fspath(path), dpi=100)
    return fig


def _timelines(entries: Sequence[HistoryEntry]) -> Iterator[list[HistoryEntry]]:
    """Entries (in commit order) cut where the step goes back: each piece is one line."""
    piece: list[HistoryEntry] = []
    for e in entries:
        if piece and e.step <= piece[-1].step:
            yield piece
            piece = []
        piece.append(e)
    if piece:
        yield piece


def _finite(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else math.nan


def _save_times(ax: Any, entries: Sequence[HistoryEntry]) -> None:
    done = [e for e in entries if e.status != "failed" and e.blocking_seconds is not None]
    series: tuple[tuple[str, str, Callable[[HistoryEntry], float | None]], ...] = (
        ("training blocked", "tab:blue", lambda e: e.blocking_seconds),
        ("write + commit", "tab:orange", lambda e: (e.write_seconds or 0.0) + (e.commit_seconds or 0.0)),
    )
    for label, color, value in series:
        for n, piece in enumerate(_timelines(done)):
            ax.plot(
                [e.step for e in piece],
                [_finite(value(e)) for e in piece],
                marker="o",
                markersize=3,
                color=color,
                label=label if n == 0 else None,
            )
    failed = [e for e in entries if e.status == "failed"]
    if failed:
        ax.plot(
            [e.step for e in failed],
            [_finite(e.blocking_seconds) for e in failed],
            "x",
            color="tab:red",
            markersize=8,
            label="failed save",
        )
    if not done and not failed:
        ax.text(0.5, 0.5, "no timings recorded", transform=ax.transAxes, ha="center", va="center")
    ax.set_ylabel("seconds per save")
    ax.set_ylim(bottom=0)
    if done or failed:
        ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)


def _metric(ax: Any, entries: Sequence[HistoryEntry], metric: str, legend: bool) -> None:
    have = [e for e in entries if metric in e.metrics and e.status != "failed"]  # a retry saves its step again
    for piece in _timelines(have):
        ax.plot([e.step for e in piece], [_finite(e.metrics[metric]) for e in piece], color="tab:green", lw=1)
    for label, statuses, face in (("kept", ("kept",), "tab:green"), ("deleted", ("deleted", "replaced"), "none")):
        shown = [e for e in have if e.status in statuses]
        if shown:
            ax.plot(
                [e.step for e in shown],
                [_finite(e.metrics[metric]) for e in shown],
                "o",
                markersize=4,
                color="tab:green",
                markerfacecolor=face,
                label=f"checkpoint {label}",
            )
    if have and not any(math.isfinite(e.metrics[metric]) for e in have):
        ax.text(0.5, 0.5, f"no finite value of {metric}", transform=ax.transAxes, ha="center", va="center")
    ax.set_ylabel(metric)
    if legend and have:
        ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)
