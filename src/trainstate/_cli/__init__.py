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

Exit codes are listed in ``EXIT_CODES`` below (``--help`` prints them). Errors print one line to
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

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

OK, DIFFERENT, USAGE, NOT_FOUND, INCOMPLETE, CORRUPT, MISMATCH, STORAGE, OTHER, INTERNAL = range(10)
INTERRUPTED = 130

# The help text's table, kept here rather than in the docstring: ``python -OO`` strips docstrings.
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


class UsageError(Exception):
    """A bad argument noticed after parsing (exit code 2)."""


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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


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


_positive = _integer(1, "a positive integer")
_step = _integer(0, "a step number (0, 1, ...)")
_rank = _integer(0, "a rank (0, 1, ...)")


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of minutes, got {text!r}")
    return value


def _keep_best(text: str) -> tuple[str, str, int]:
    """``METRIC:min|max[:K]`` (K defaults to 1)."""
    parts = text.rsplit(":", 2) if text.count(":") >= 2 else text.rsplit(":", 1)
    if len(parts) == 2:
        parts.append("1")
    if len(parts) != 3 or not parts[0] or parts[1] not in ("min", "max"):
        raise argparse.ArgumentTypeError(f"expected METRIC:min|max[:K], got {text!r}")
    return parts[0], parts[1], _positive(parts[2])


def build_parser() -> argparse.ArgumentParser:
    from trainstate import __version__

    ap = _Parser(
        prog="trainstate",
        description="Inspect, verify, compare and prune trainstate checkpoints.",
        epilog="exit codes:" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"trainstate {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def command(name: str, help: str, *, keyed: bool = True, writes: str = "") -> argparse.ArgumentParser:
        """A subcommand; ``writes``: for one that writes a checkpoint, what the key does to what it writes."""
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

    p = command("ls", "list the checkpoints of a manager directory (or show one checkpoint)")
    p.add_argument("path", metavar="DIR", help="a CheckpointManager directory, or one checkpoint")

    p = command("history", "every save of a manager directory: time, size, seconds, metrics, kept or deleted")
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

    p = command("inspect", "show a checkpoint's metadata, plain values and tensors")
    p.add_argument("path", metavar="CKPT")
    p.add_argument("--filter", metavar="GLOB", help="only names matching this glob, e.g. 'model.*'")
    p.add_argument("--chunks", action="store_true", help="each tensor's chunks: box offset and shape, data file")

    p = command("verify", "re-check every checksum of a checkpoint")
    p.add_argument("path", metavar="CKPT")

    p = command(
        "consolidate",
        "rewrite a checkpoint saved by many ranks as one a single process loads",
        writes="an encrypted CKPT is read with it, and OUT encrypted with it too unless --new-key-env names another key",
    )
    p.add_argument("path", metavar="CKPT")
    p.add_argument("out", metavar="OUT", help="the new checkpoint (a path or URL)")
    p.add_argument(
        "--rank", type=_rank, default=0, metavar="N", help="keep this rank's per-rank values (RNG, data position)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at OUT")
    p.add_argument("--compression", metavar="zstd[:LEVEL]", help="compress OUT (default: uncompressed)")
    p.add_argument(
        "--new-key-env", metavar="NAME", help="encrypt OUT with the key in this variable instead (key rotation)"
    )

    from trainstate._cli import _onnx

    _onnx.add_parser(command)
    p = command("export", "write a checkpoint's model weights for inference tools (Hugging Face, safetensors, torch)")
    p.add_argument("path", metavar="CKPT")
    p.add_argument("out", metavar="OUT", help="a folder (hf), or a file or folder (safetensors, torch)")
    p.add_argument(
        "--select", action="append", metavar="GLOB", help="tensors whose keys match (repeatable); default: the model"
    )
    p.add_argument("--strip-prefix", metavar="PREFIX", help="removed from every selected name, e.g. 'model.'")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors")
    p.add_argument("--max-shard-size", metavar="SIZE", help="hf: the most bytes per shard, e.g. 2GB (default 5GB)")
    p.add_argument("--copy-from", metavar="DIR", help="copy config and tokenizer files from this model folder")
    p.add_argument("--format", choices=["hf", "safetensors", "torch"], default="hf", help="default: hf")
    p.add_argument("--overwrite", action="store_true", help="replace OUT")

    p = command(
        "import",
        "write safetensors, torch.save, Hugging Face or DCP weights as a trainstate checkpoint",
        writes="CKPT is written encrypted with it",
    )
    p.add_argument(
        "src", metavar="SRC", help="a .safetensors / torch.save file, a Hugging Face folder, a DCP directory"
    )
    p.add_argument("out", metavar="CKPT", help="the new checkpoint (a path or URL)")
    p.add_argument("--prefix", metavar="KEY", help="put the weights under this key, e.g. 'model'")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at CKPT")

    p = command(
        "average",
        "write the mean of several checkpoints of one run (floating tensors; the rest: newest)",
        writes="encrypted CKPTs are read with it, and OUT is encrypted with it too",
    )
    p.add_argument("paths", metavar="CKPT", nargs="+")
    p.add_argument("-o", "--out", metavar="OUT", required=True, help="the new checkpoint (a path or URL)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at OUT")

    p = command("diff", "compare two checkpoints: tensors and plain values (exit 1 if they differ)")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument(
        "--exclude",
        metavar="PATTERN",
        action="append",
        default=[],
        help="leave out keys matching this glob pattern and everything under them (repeatable), e.g. _rng: the "
        "RNG state a CheckpointManager captures on its own",
    )

    p = command(
        "pack",
        "pack a checkpoint into one file that CKPT arguments and trainstate.load accept",
        writes="an encrypted CKPT is read with it; OUT holds its bytes as stored, still encrypted with it",
    )
    p.add_argument("path", metavar="CKPT")
    p.add_argument("out", metavar="OUT", help="the file to write (e.g. model.tsar)")
    p.add_argument("--overwrite", action="store_true", help="replace a file at OUT")

    p = command("prune", "apply retention policies to a manager directory now")
    p.add_argument("path", metavar="DIR")
    p.add_argument("--keep-last", type=_positive, metavar="N", help="keep the newest N")
    p.add_argument("--keep-every-steps", type=_positive, metavar="N", help="keep steps that are multiples of N")
    p.add_argument("--keep-every-minutes", type=_minutes, metavar="M", help="keep one per M minutes")
    p.add_argument(
        "--keep-best",
        type=_keep_best,
        metavar="METRIC:min|max:K",
        help="keep the K best by a metric recorded at save time",
    )
    p.add_argument("--dry-run", action="store_true", help="show the plan, delete nothing")

    p = command("pin", "keep a checkpoint whatever the retention policies say")
    p.add_argument("path", metavar="DIR")
    p.add_argument("step", type=_step, metavar="STEP")
    p.add_argument("--reason", default="", metavar="TEXT", help="why (stored with the pin)")

    p = command("unpin", "let the retention policies decide about a checkpoint again")
    p.add_argument("path", metavar="DIR")
    p.add_argument("step", type=_step, metavar="STEP")

    command("keygen", "print a new random encryption key (64 hex digits) for --key-env / key=", keyed=False)

    sub.add_parser(
        "demo", help="train, get killed, resume in a fresh process, check it is bit-identical", add_help=False
    )
    return ap


def _run(args: argparse.Namespace) -> int:
    from trainstate._cli._output import Printer

    out = Printer(args.json)
    if args.command == "keygen":
        from trainstate._keys import generate_key

        key = generate_key()
        if out.json_mode:
            out.json({"key": key})
        else:
            print(key)  # plain, for $(trainstate keygen) and key files
        return OK
    key_env = args.key_env
    if args.command in ("ls", "inspect"):
        from trainstate._cli import _show

        if args.command == "ls":
            return _show.ls(out, args.path, key_env=key_env)
        return _show.inspect(out, args.path, args.filter, chunks=args.chunks, key_env=key_env)
    if args.command == "history":
        from trainstate._cli import _history

        return _history.history(out, args.path, plot=args.plot, metrics=args.metric, key_env=key_env)
    if args.command == "consolidate":
        from trainstate._cli import _consolidate

        return _consolidate.consolidate(
            out,
            args.path,
            args.out,
            rank=args.rank,
            overwrite=args.overwrite,
            compression=args.compression,
            key_env=key_env,
            new_key_env=args.new_key_env,
        )
    if args.command == "export-onnx":
        from trainstate._cli import _onnx

        return _onnx.export_onnx(out, args)
    if args.command in ("export", "import", "average"):
        from trainstate._cli import _convert

        if args.command == "export":
            return _convert.export(
                out,
                args.path,
                args.out,
                select=args.select,
                strip_prefix=args.strip_prefix,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                copy_from=args.copy_from,
                format=args.format,
                overwrite=args.overwrite,
                key_env=key_env,
            )
        if args.command == "import":
            return _convert.import_(
                out, args.src, args.out, prefix=args.prefix, overwrite=args.overwrite, key_env=key_env
            )
        return _convert.average(out, args.paths, args.out, overwrite=args.overwrite, key_env=key_env)
    if args.command == "verify":
        from trainstate._cli import _verify

        return _verify.verify(out, args.path, key_env=key_env)
    if args.command == "diff":
        from trainstate._cli import _diff

        return _diff.diff(out, args.a, args.b, key_env=key_env, exclude=args.exclude)
    if args.command == "pack":
        from trainstate._cli import _pack

        return _pack.pack(out, args.path, args.out, overwrite=args.overwrite, key_env=key_env)
    from trainstate._cli import _retention

    if args.command == "prune":
        return _retention.prune(
            out,
            args.path,
            keep_last=args.keep_last,
            keep_every_steps=args.keep_every_steps,
            keep_every_minutes=args.keep_every_minutes,
            keep_best=args.keep_best,
            dry_run=args.dry_run,
            key_env=key_env,
        )
    if args.command == "pin":
        return _retention.pin(out, args.path, args.step, args.reason, key_env=key_env)
    return _retention.unpin(out, args.path, args.step, key_env=key_env)


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
    if args and args[0] == "demo":
        from trainstate import _demo as demo

        return _guarded(demo.main, args[1:])
    parser = build_parser()
    parsed = parser.parse_args(args)
    if parsed.command is None:
        parser.print_help(sys.stderr)
        return USAGE
    _library_warnings()
    return _guarded(_run, parsed)
