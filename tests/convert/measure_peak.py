"""Peak memory of conversions, measured from outside the process that runs them.

Counted is anonymous memory (resident minus file-backed pages, /proc/PID/statm): what a conversion owns.
The checkpoint's files are read through memory maps whose pages are the kernel's page cache; they count
toward RSS (and ``ru_maxrss``) without being memory the process holds. The parent samples the child's
statm every 0.5 ms while a conversion runs (from outside, so sampling takes nothing from the child); each
tensor stays in memory for at least its read and its write (tens of milliseconds at 64 MB), so samples
land inside it. One child runs several conversions in turn, each measured from the memory it holds just
before it starts. The child is forked from the suite's fork server (tests/forked.py), which imported torch
and trainstate once: a fresh ``python`` importing them costs seconds of CPU.
"""

from __future__ import annotations

import os
import time
from typing import Any

import forked

PAGE = os.sysconf("SC_PAGE_SIZE")


def anonymous(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


def peaks(*calls: tuple[str, list[Any], dict[str, Any]]) -> list[int]:
    """For each ``(op, args, kwargs)``: the anonymous memory ``trainstate.<op>(*args, **kwargs)`` added at
    its peak, in bytes, all run in one child process."""
    spec = [
        (op, [str(a) if not isinstance(a, list) else [str(x) for x in a] for a in args], kw) for op, args, kw in calls
    ]
    ctx = forked.context()
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(spec, there))
    proc.start()
    there.close()
    found = []
    try:
        for _ in calls:
            base = here.recv()  # what the child holds now (torch imported, earlier calls done)
            peak = base
            here.send("go")
            while not here.poll(0) and proc.is_alive():
                peak = max(peak, anonymous(proc.pid))
                time.sleep(0.0005)
            assert here.poll(0), "the child died"
            assert here.recv() == "done"
            found.append(peak - base)
    finally:
        here.close()
        proc.join(timeout=120)
    assert proc.exitcode == 0
    return found


def _child(spec: list[tuple[str, list[Any], dict[str, Any]]], conn: Any) -> None:
    import torch  # noqa: F401 - imported before any baseline: its own memory is not a conversion's
    import torch.distributed.checkpoint  # noqa: F401

    import trainstate

    for op, args, kwargs in spec:
        conn.send(anonymous())
        conn.recv()
        getattr(trainstate, op)(*args, **kwargs)
        conn.send("done")
