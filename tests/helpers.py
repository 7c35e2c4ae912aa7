"""Exact structural equality for restored states: types, dtypes, shapes and bytes all count."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trainstate import _checksum as checksum


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if type(a).__module__.startswith("torch"):
        import torch

        assert isinstance(b, torch.Tensor), f"{path}: {type(b)}"
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), (
            f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        assert _torch_bytes(a) == _torch_bytes(b), f"{path}: bytes differ"
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), (
            f"{path}: {a.dtype}{np.shape(a)} vs {b.dtype}{np.shape(b)}"
        )
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()) or _nan_keys(a), f"{path}: keys {list(a)} vs {list(b)}"
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert type(ka) is type(kb), f"{path}: key type {type(ka)} vs {type(kb)}"
            assert_same(va, vb, f"{path}.{ka}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _nan_keys(d: dict) -> bool:
    return any(isinstance(k, float) and math.isnan(k) for k in d)


def _torch_bytes(t: Any) -> bytes:
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def one_line(raw: bytes) -> bytes:
    """Manifest bytes without the line layout's line feeds (docs/format.md §3.1): as one line, the way
    trainstate wrote manifests before it (a JSON string holds no raw line feed, so each one is layout)."""
    return raw.rstrip(b"\n").replace(b"\n", b"") + b"\n"


def laid_out(body: dict[str, Any]) -> bytes:
    """The JSON text ``B`` of a manifest object (without its checksum), canonical and in the line layout,
    from docs/format.md §3 and §3.1 alone: members sorted, no other whitespace; ``metadata``, ``tensors`` and
    ``tree`` each begin a line and end one; each tensor on a line of its own."""

    def dumps(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)

    out, previous = "{", ""
    for i, name in enumerate(sorted(body)):
        value = body[name]
        if name == "tensors" and value:
            text = "{\n" + ",\n".join(f"{dumps(n)}:{dumps(value[n])}" for n in sorted(value)) + "\n}"
        else:
            text = dumps(value)
        own = {"metadata", "tensors", "tree"}
        out += ("," if i else "") + ("\n" if name in own or previous in own else "") + f"{dumps(name)}:{text}"
        previous = name
    return (out + "}").encode()


def reseal_manifest(path: Path, edit: Callable[[dict[str, Any]], Any], layout: bool = False) -> None:
    """Apply ``edit`` to the manifest body and re-seal it with a valid checksum (a lying manifest): as one
    line (re-formatted, docs/format.md §5.1), or with ``layout`` as a writer lays it out (§3.1)."""
    body = json.loads((path / "manifest.json").read_bytes())
    body.pop("checksum")
    edit(body)
    if layout:
        b = laid_out(body)
        (path / "manifest.json").write_bytes(b'{"checksum":"' + checksum.digest(b).encode() + b'",' + b[1:] + b"\n")
        return
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["checksum"] = checksum.digest(raw)
    (path / "manifest.json").write_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def cli(*args: str, env: dict[str, str] | None = None, code: int | None = 0) -> subprocess.CompletedProcess[str]:
    """``trainstate ARGS``: in a subprocess where ``env`` is given, else in this process through the same
    ``main()`` the console script calls (a subprocess costs a second of interpreter start per call; the
    entry point itself is tested by the subprocess calls)."""
    if env is not None:
        proc = subprocess.run(
            [sys.executable, "-m", "trainstate", *args], capture_output=True, text=True, env=env, timeout=120
        )
    else:
        proc = _in_process(list(args))
    assert "Traceback" not in proc.stderr, proc.stderr
    if code is not None:
        assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def _in_process(args: list[str]) -> subprocess.CompletedProcess[str]:
    from trainstate._cli import main

    logger = logging.getLogger("trainstate")  # main() points the library's logger at stderr: put it back
    saved = (logger.handlers[:], logger.level, logger.propagate, os.environ.get("COLUMNS"))
    out, err = io.StringIO(), io.StringIO()
    logger.handlers.clear()
    os.environ["COLUMNS"] = "200"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 2
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]
        if saved[3] is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved[3]
    return subprocess.CompletedProcess(["trainstate", *args], code, out.getvalue(), err.getvalue())


def make_training_state(seed: int = 0, steps: int = 2) -> dict[str, Any]:
    """A small model trained a few steps with AdamW and a scheduler, plus counters and RNG."""
    import torch

    import trainstate

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    for _ in range(steps):
        loss = model(torch.randn(8, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return {"model": model, "optim": opt, "sched": sched, "step": steps, "epoch": 0, "rng": trainstate.RNGState()}


def fresh_like(seed: int = 123) -> dict[str, Any]:
    """The same structure, untrained, with different weights."""
    return make_training_state(seed=seed, steps=0)


def torchrun(script: Path, *args: object, env: dict[str, str], nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc_per_node NPROC SCRIPT ARGS`` on a free loopback port, its
    output (stdout and stderr together) captured; a launch that hangs is stopped (SIGTERM, which torchrun
    passes to its workers) and fails the test with its output."""
    import pytest

    import ranks

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(ranks.free_port()), str(script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
            pytest.fail("the launch hung:\n" + out[-6000:])
    return subprocess.CompletedProcess(command, proc.returncode, out, "")
