"""``trainstate demo``: train, get killed, resume in a fresh process, check the result is bit-identical.

The demo parses its own arguments (``trainstate demo --help`` is its help), so ``main`` hands it everything
after ``demo`` unparsed, as ``args.argv``; the subparser here only lists it among the commands.
"""

from __future__ import annotations

import argparse

from trainstate._cli._args import Subparsers


def add_parser(sub: Subparsers) -> None:
    sub.add_parser(
        "demo", help="train, get killed, resume in a fresh process, check it is bit-identical", add_help=False
    )


def run(args: argparse.Namespace) -> int:
    from trainstate import _demo

    return _demo.main(args.argv)
