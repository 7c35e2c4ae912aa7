"""What every command module shares: exit codes, the parser class, one subcommand's common options, argument types.

A leaf of ``_cli``: the command modules import it, the package ``__init__`` imports them, so nothing here
imports the package (no import circle).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn, TypeAlias

from trainstate.errors import CheckpointExistsError

OK, DIFFERENT, USAGE, NOT_FOUND, INCOMPLETE, CORRUPT, MISMATCH, STORAGE, OTHER, INTERNAL = range(10)
INTERRUPTED = 130

# The help text's table, kept here rather than in a docstring: ``python -OO`` strips docstrings.
EXIT_CODES = """

    0  success; diff: the states are identical
    1  diff: the states differ
    2  usage error (bad arguments, or a path of the wrong kind); also a missing or wrong
       encryption key (--key-env), or one given for a plain checkpoint
    3  not found (no such file, directory, checkpoint or step)
    4  incomplete checkpoint (no manifest: its save never committed)
    5  corrupt checkpoint (checksum mismatch, malformed manifest), or one written by a newer
       trainstate (upgrade to read it); also verify finding any damage
    6  state mismatch
    7  storage error (I/O error, permission denied, disk full)
    8  other trainstate error (e.g. the directory is locked by a running CheckpointManager,
       a missing optional dependency)
    9  internal error (a bug: please report it; TRAINSTATE_DEBUG=1 shows the traceback)
    130 interrupted
"""

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class UsageError(Exception):
    """A bad argument noticed after parsing (exit code 2)."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def command(sub: Subparsers, name: str, help: str, *, keyed: bool = True, writes: str = "") -> argparse.ArgumentParser:
    """A subcommand with ``--json`` and (``keyed``) ``--key-env``; ``writes``: for one that writes a
    checkpoint, what the key does to what it writes."""
    p = sub.add_parser(
        name,
        help=help,
        description=help,
        epilog="exit codes:" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    if keyed:
        p.add_argument(
            "--key-env",
            metavar="NAME",
            help=f"the environment variable holding the encryption key (make one with 'trainstate keygen'): {writes}"
            if writes
            else "the environment variable holding the key of encrypted checkpoints, to read them (make one "
            "with 'trainstate keygen')",
        )
    return p


def overwrite_flag(error: CheckpointExistsError) -> CheckpointExistsError:
    """The library's error names its argument; on the command line it is a flag."""
    return CheckpointExistsError(str(error).replace("pass overwrite=True", "pass --overwrite"))


def _integer(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum``, or a usage error saying ``what`` was expected."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = _integer(1, "a positive integer")
step_number = _integer(0, "a step number (0, 1, ...)")
rank_number = _integer(0, "a rank (0, 1, ...)")


def positive_minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of minutes, got {text!r}")
    return value


def best_metric(text: str) -> tuple[str, str, int]:
    """``METRIC:min|max[:K]`` (K defaults to 1)."""
    parts = text.rsplit(":", 2) if text.count(":") >= 2 else text.rsplit(":", 1)
    if len(parts) == 2:
        parts.append("1")
    if len(parts) != 3 or not parts[0] or parts[1] not in ("min", "max"):
        raise argparse.ArgumentTypeError(f"expected METRIC:min|max[:K], got {text!r}")
    return parts[0], parts[1], positive_int(parts[2])
