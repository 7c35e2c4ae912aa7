"""The ``trainstate`` command: a thin shell over the public API."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: trainstate demo [--dir DIR] [--steps N] [--seed S]\n\n"
              "  demo    train a small model, kill it, resume it in a fresh process, check it is exact")
        return 0
    if args[0] == "demo":
        from . import demo

        return demo.main(args[1:])
    print(f"trainstate: unknown command {args[0]!r}; try 'trainstate --help'", file=sys.stderr)
    return 2
