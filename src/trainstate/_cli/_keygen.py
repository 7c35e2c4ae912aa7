"""``trainstate keygen``: print a new random encryption key (docs/encryption.md)."""

from __future__ import annotations

import argparse

from trainstate._cli._args import OK, Subparsers, command
from trainstate._cli._output import Printer


def add_parser(sub: Subparsers) -> None:
    command(sub, "keygen", "print a new random encryption key (64 hex digits) for --key-env / key=", keyed=False)


def run(args: argparse.Namespace) -> int:
    from trainstate._keys import generate_key

    out = Printer(args.json)
    key = generate_key()
    if out.json_mode:
        out.json({"key": key})
    else:
        print(key)  # plain, for $(trainstate keygen) and key files
    return OK
