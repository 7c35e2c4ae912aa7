"""How the ``trainstate`` command prints: rich tables on a terminal, plain text without rich, JSON on request.

Every cell is passed to rich as :class:`rich.text.Text`, never as markup, so a tensor named ``[bold]`` prints
as itself. With ``--json`` only JSON reaches stdout; warnings and errors always go to stderr.
"""

from __future__ import annotations

import base64
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

INSTALL_HINT = "hint: pip install 'trainstate[cli]' (rich) for formatted tables"


def rich_available() -> bool:
    """Whether rich can be used (``TRAINSTATE_NO_RICH=1`` pretends it is missing)."""
    if os.environ.get("TRAINSTATE_NO_RICH"):
        return False
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


# -- values -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRef:
    """Stands for a tensor while walking a decoded tree, so plain values can be told from arrays."""

    name: str

    def __repr__(self) -> str:
        return f"<tensor {self.name}>"


def jsonable(value: Any) -> Any:
    """Plain values as strict JSON: non-finite floats become strings, bytes ``{"bytes": base64}``,
    tuples lists, dict keys strings."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, TensorRef):
        return {"tensor": value.name}
    if isinstance(value, dict):
        return {_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return repr(value)


def _key(key: Any) -> str:
    return key if isinstance(key, str) else repr(key)


def dumps(obj: Any) -> str:
    return json.dumps(jsonable(obj), indent=2, allow_nan=False, ensure_ascii=False)


def clip(text: str, limit: int = 60) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short(value: Any, limit: int = 60) -> str:
    """A one-line representation of a plain value for a table cell."""
    return clip(repr(value), limit)


def size(nbytes: int | None) -> str:
    if nbytes is None:
        return ""
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def local_time(ts: float | None) -> str:
    """Unix time as local ISO 8601 with the UTC offset, to the second."""
    if ts is None:
        return ""
    return datetime.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def metrics_text(metrics: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


# -- tables -------------------------------------------------------------------------------------------


@dataclass
class Table:
    columns: Sequence[str]
    rows: list[Sequence[str]] = field(default_factory=list)
    title: str | None = None
    right: frozenset[str] = frozenset()  # right-aligned columns
    nowrap: frozenset[str] = frozenset({"step", "time", "size", "bytes", "dtype", "pinned", "action", ""})
    styles: dict[int, str] = field(default_factory=dict)  # row index -> rich style
    show_header: bool = True

    def add(self, *cells: Any, style: str | None = None) -> None:
        if style:
            self.styles[len(self.rows)] = style
        self.rows.append(["" if c is None else str(c) for c in cells])


class Printer:
    """Where command output goes. ``json_mode`` prints a single JSON document and nothing else."""

    def __init__(self, json_mode: bool) -> None:
        self.json_mode = json_mode
        self.rich = rich_available() and not json_mode
        self._console: Any = None
        if not json_mode and not self.rich:
            print(INSTALL_HINT, file=sys.stderr)

    @property
    def console(self) -> Any:
        if self._console is None:
            from rich.console import Console

            columns = os.environ.get("COLUMNS", "")
            width = None if sys.stdout.isatty() else int(columns) if columns.isdigit() else 160
            self._console = Console(highlight=False, soft_wrap=False, width=width)
        return self._console

    def json(self, obj: Any) -> None:
        sys.stdout.write(dumps(obj) + "\n")

    def line(self, text: str = "", style: str | None = None) -> None:
        if self.json_mode:
            return
        if self.rich:
            from rich.text import Text

            self.console.print(Text(text, style=style or ""))
        else:
            print(text)

    def pairs(self, items: Iterable[tuple[str, str]]) -> None:
        """Key / value lines, keys aligned."""
        t = Table(["key", "value"], show_header=False)
        for k, v in items:
            t.add(k, v)
        self.table(t)

    def table(self, t: Table) -> None:
        if self.json_mode:
            return
        if self.rich:
            self._rich_table(t)
        else:
            self._plain_table(t)

    def _rich_table(self, t: Table) -> None:
        from rich import box
        from rich.table import Table as RichTable
        from rich.text import Text

        rt = RichTable(
            title=Text(t.title, style="bold") if t.title else None,
            title_justify="left",
            show_header=t.show_header,
            header_style="bold",
            box=box.SIMPLE_HEAD if t.show_header else None,
            pad_edge=False,
        )
        for c in t.columns:
            rt.add_column(
                Text(c),
                justify="right" if c in t.right else "left",
                overflow="fold",
                no_wrap=c in t.nowrap,
                style="bold" if not t.show_header and c == t.columns[0] else None,
            )
        for i, row in enumerate(t.rows):
            rt.add_row(*(Text(cell) for cell in row), style=t.styles.get(i))
        self.console.print(rt)

    def _plain_table(self, t: Table) -> None:
        rows = [list(t.columns)] + [list(r) for r in t.rows] if t.show_header else [list(r) for r in t.rows]
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(len(t.columns))]
        if t.title:
            print(t.title)
        for n, r in enumerate(rows):
            cells = [c.rjust(w) if t.columns[i] in t.right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
            print("  ".join(cells).rstrip())
            if n == 0 and t.show_header:
                print("  ".join("-" * w for w in widths))


PROGRESS_AFTER = 1.0  # seconds: quick checks print no bar


class Progress:
    """A rich progress bar on stderr that appears only once the work has run for a second."""

    def __init__(self, out: Printer, total: int, label: str) -> None:
        self.label = label
        self.enabled = out.rich and sys.stderr.isatty()
        self.total, self.done, self.start = total, 0, time.monotonic()
        self.bar: Any = None
        self.task: Any = None

    def step(self, name: str) -> None:
        if self.bar is None and self.enabled and time.monotonic() - self.start > PROGRESS_AFTER:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn(self.label),
                BarColumn(),
                DownloadColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}", markup=False),
                console=Console(stderr=True),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=self.total, completed=self.done)
        if self.bar is not None:
            self.bar.update(self.task, description=clip(name, 50), completed=self.done)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
