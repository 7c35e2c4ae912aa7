"""``trainstate export-onnx``: a checkpoint's model as an ONNX file, checked in onnxruntime.

The model and its example inputs are Python, so the command names two functions of the user's code as
``module:function``: one that builds the untrained model, one that returns example inputs (a tensor, a
tuple of positional arguments or a dict of keyword arguments). The current directory is importable, as
with ``python -m``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainstate._cli._args import Subparsers, UsageError, command, overwrite_flag
from trainstate._cli._output import Printer, size
from trainstate.errors import CheckpointExistsError


def add_parser(sub: Subparsers) -> None:
    p = command(sub, "export-onnx", "export a checkpoint's model to ONNX, checked in onnxruntime against torch")
    p.add_argument("path", metavar="CKPT")
    p.add_argument("out", metavar="OUT", help="the .onnx file to write")
    p.add_argument(
        "--factory", required=True, metavar="MODULE:FUNCTION", help="builds the untrained model, e.g. mypkg.nets:build"
    )
    p.add_argument(
        "--inputs",
        required=True,
        metavar="MODULE:FUNCTION",
        help="returns example inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments",
    )
    p.add_argument(
        "--select", action="append", metavar="GLOB", help="the model's tensors (default: the first module saved)"
    )
    p.add_argument("--strip-prefix", metavar="PREFIX", help="removed from each selected key, e.g. 'model.'")
    p.add_argument("--opset", type=int, metavar="N", help="the ONNX opset (default: torch's recommended one)")
    p.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance of the check (default 1e-3)")
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance of the check (default 1e-4)")
    p.add_argument("--external-data", action="store_true", help="write the weights to OUT.data beside the graph")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")


def function(ref: str, what: str) -> Callable[..., Any]:
    """The callable named by ``module:function`` (the function part may be dotted: ``mod:Class.build``)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise UsageError(f"{what} must be MODULE:FUNCTION (e.g. mypkg.nets:build), got {ref!r:.80}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the user's own modules, as `python -m` finds them
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"{what} {ref!r:.80}: cannot import {module_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(found, part):
            raise UsageError(f"{what} {ref!r:.80}: {module_name} has no {attr!r}")
        found = getattr(found, part)
    if not callable(found):
        raise UsageError(f"{what} {ref!r:.80} is a {type(found).__name__}, not a function")
    return found  # type: ignore[no-any-return]


def run(args: argparse.Namespace) -> int:
    from trainstate import export_onnx as export

    out = Printer(args.json)

    if Path(args.out).exists() and not args.overwrite:  # before importing the user's code and torch
        raise CheckpointExistsError(f"{args.out} already exists: pass --overwrite to replace it")
    factory = function(args.factory, "--factory")
    inputs = function(args.inputs, "--inputs")()
    start = time.perf_counter()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed", once per op
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations, met inside torch.export
            path = export(
                args.path,
                factory,
                inputs,
                args.out,
                select=args.select,
                strip_prefix=args.strip_prefix,
                opset=args.opset,
                rtol=args.rtol,
                atol=args.atol,
                external_data=args.external_data,
                overwrite=args.overwrite,
                key_env=args.key_env,
            )
    except CheckpointExistsError as e:
        raise overwrite_flag(e) from None
    seconds = time.perf_counter() - start
    files = [p for p in (path, Path(f"{path}.data")) if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    if out.json_mode:
        report = {"path": str(path), "source": args.path, "files": [str(p) for p in files], "nbytes": nbytes}
        out.json({**report, "rtol": args.rtol, "atol": args.atol, "seconds": round(seconds, 3)})
        return 0
    out.line(
        f"exported {args.path} to {path} ({size(nbytes)}) in {seconds:.1f} s; onnxruntime reproduces the torch "
        f"model's outputs within rtol={args.rtol:g}, atol={args.atol:g}"
    )
    return 0
