"""The ``trainstate`` command: a thin shell over the public API.

Commands::

    trainstate ls DIR|CKPT            checkpoints of a manager directory (complete, incomplete, corrupt)
    trainstate history DIR            every save of a run: timings, size, metrics, kept or deleted (--plot OUT)
    trainstate inspect CKPT           metadata, plain values and the tensor table (--filter GLOB, --chunks)
    trainstate verify CKPT            re-check every checksum
    trainstate consolidate CKPT OUT   a checkpoint saved by many ranks rewritten as one process's (--rank N)
    trainstate export-onnx CKPT OUT   the model as an ONNX file checked in onnxruntime (--factory, --inputs)
    trainstate export CKPT OUT        the model's weights as a Hugging Face folder, safetensors or torch.save file
    trainstate import SRC CKPT        safetensors, torch.save, Hugging Face or DCP weights as a checkpoint
    trainstate average CKPT... -o OUT the mean of several checkpoints (weight averaging after the fact)
    trainstate diff A B               tensors and values added, removed or changed
    trainstate pack CKPT OUT          one file holding the checkpoint (CKPT arguments accept it too)
    trainstate prune DIR --keep-...   apply retention policies now (--dry-run to only show the plan)
    trainstate pin DIR STEP           keep a checkpoint whatever the retention says; unpin undoes it
    trainstate keygen                 print a new random encryption key (docs/encryption.md)
    trainstate demo                   train, get killed, resume, check the result is bit-identical

Every command that opens or writes checkpoints takes ``--key-env NAME``: the environment variable that
holds the key of encrypted checkpoints (never the key itself on the command line, where ``ps`` shows it).
Every command but ``demo`` takes ``--json``: then stdout holds one JSON document and nothing else
(non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``).

Exit codes are listed in ``EXIT_CODES`` (``_args.py``; ``--help`` prints them). Errors print one line to
stderr, never a traceback.

Each command is one module with ``add_parser(sub)`` (its subparser, arguments and help) and ``run(args)
-> int``; ``COMMANDS`` below lists them in ``--help`` order. Adding a command is one module plus one row
in ``COMMANDS``. Command modules import ``_args`` (never this package), so there is no import circle.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from types import ModuleType
from typing import Any

from trainstate._cli import (
    _average,
    _consolidate,
    _demo,
    _diff,
    _export,
    _export_onnx,
    _history,
    _import,
    _inspect,
    _keygen,
    _ls,
    _pack,
    _pin,
    _prune,
    _unpin,
    _verify,
)
from trainstate._cli._args import (
    CORRUPT,
    DIFFERENT,
    EXIT_CODES,
    INCOMPLETE,
    INTERNAL,
    INTERRUPTED,
    MISMATCH,
    NOT_FOUND,
    OK,
    OTHER,
    STORAGE,
    USAGE,
    Parser,
    UsageError,
)
from trainstate.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    EncryptionKeyError,
    FormatVersionError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    StateMismatchError,
    StorageError,
)

__all__ = [
    "CORRUPT",
    "COMMANDS",
    "DIFFERENT",
    "EXIT_CODES",
    "INCOMPLETE",
    "INTERNAL",
    "INTERRUPTED",
    "MISMATCH",
    "NOT_FOUND",
    "OK",
    "OTHER",
    "STORAGE",
    "USAGE",
    "UsageError",
    "build_parser",
    "exit_code",
    "main",
    "one_line",
]

# (command, module): one row per command, in the order --help lists them.
COMMANDS: tuple[tuple[str, ModuleType], ...] = (
    ("ls", _ls),
    ("history", _history),
    ("inspect", _inspect),
    ("verify", _verify),
    ("consolidate", _consolidate),
    ("export-onnx", _export_onnx),
    ("export", _export),
    ("import", _import),
    ("average", _average),
    ("diff", _diff),
    ("pack", _pack),
    ("prune", _prune),
    ("pin", _pin),
    ("unpin", _unpin),
    ("keygen", _keygen),
    ("demo", _demo),
)
_BY_NAME = dict(COMMANDS)


def exit_code(error: BaseException) -> int:
    """The exit code for an error; order matters (subclasses first)."""
    table: list[tuple[type[BaseException], int]] = [
        (UsageError, USAGE),
        (InvalidArgumentError, USAGE),  # an argument the library refused: the command line's to fix
        (EncryptionKeyError, USAGE),  # the key given (or not) does not fit: an argument to fix, not damage
        (CheckpointNotFoundError, NOT_FOUND),
        (IncompleteCheckpointError, INCOMPLETE),
        (CorruptCheckpointError, CORRUPT),
        (FormatVersionError, CORRUPT),  # not damage, but the same answer for scripts: cannot be read here
        (StateMismatchError, MISMATCH),
        (StorageError, STORAGE),
        (CheckpointError, OTHER),
        (FileNotFoundError, NOT_FOUND),
        (NotADirectoryError, USAGE),
        (OSError, STORAGE),
        (ImportError, OTHER),
    ]
    for kind, code in table:
        if isinstance(error, kind):
            return code
    return INTERNAL


def one_line(error: BaseException) -> str:
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    if exit_code(error) == INTERNAL:
        return f"internal error: {type(error).__name__}: {text} (TRAINSTATE_DEBUG=1 shows the traceback)"
    return text or type(error).__name__


def build_parser() -> argparse.ArgumentParser:
    from trainstate import __version__

    ap = Parser(
        prog="trainstate",
        description="Inspect, verify, compare and prune trainstate checkpoints.",
        epilog="exit codes:" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"trainstate {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, module in COMMANDS:
        module.add_parser(sub)
        if name not in sub.choices:
            raise RuntimeError(f"{module.__name__}.add_parser did not add the command {name!r}")
    return ap


def _run(args: argparse.Namespace) -> int:
    return int(_BY_NAME[args.command].run(args))


def _library_warnings() -> None:
    """The library's warnings (e.g. a checkpoint skipped as damaged) as one stderr line each."""
    logger = logging.getLogger("trainstate")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("trainstate: warning: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False


def _guarded(fn: Any, *args: Any) -> int:
    try:
        return int(fn(*args))
    except KeyboardInterrupt:
        print("trainstate: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return OK
    except Exception as e:  # noqa: BLE001 - the one place every error becomes an exit code and one line
        if os.environ.get("TRAINSTATE_DEBUG"):
            traceback.print_exc()
        print(f"trainstate: error: {one_line(e)}", file=sys.stderr)
        return exit_code(e)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "demo":  # the demo parses its own arguments
        return _guarded(_run, argparse.Namespace(command="demo", argv=args[1:]))
    parser = build_parser()
    parsed = parser.parse_args(args)
    if parsed.command is None:
        parser.print_help(sys.stderr)
        return USAGE
    _library_warnings()
    return _guarded(_run, parsed)
