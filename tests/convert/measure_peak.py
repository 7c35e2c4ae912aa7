"""Peak memory of conversions, measured from outside the process that runs them.

Counted is anonymous memory (resident minus file-backed pages, /proc/PID/statm): what a conversion owns.
The checkpoint's files are read through memory maps whose pages are the kernel's page cache; they count
toward RSS (and ``ru_maxrss``) without being memory the process holds. The parent samples the child's
statm every 0.5 ms while a conversion runs (from outside, so sampling takes nothing from the child); each
tensor stays in memory for at least its read and its write (tens of milliseconds at 64 MB), so samples
land inside it. One child runs several conversions in turn (importing torch costs seconds on a busy
machine), each measured from the memory it holds just before it starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")


def anonymous(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


def peaks(*calls: tuple[str, list[Any], dict[str, Any]]) -> list[int]:
    """For each ``(op, args, kwargs)``: the anonymous memory ``trainstate.<op>(*args, **kwargs)`` added at
    its peak, in bytes, all run in one child process."""
    spec = json.dumps(
        [[op, [str(a) if not isinstance(a, list) else [str(x) for x in a] for a in args], kw] for op, args, kw in calls]
    )
    proc = subprocess.Popen([sys.executable, __file__, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    found = []
    try:
        for _ in calls:
            base = int(proc.stdout.readline())  # what the child holds now (torch imported, earlier calls done)
            peak = base
            proc.stdin.write("go\n")
            proc.stdin.flush()
            os.set_blocking(proc.stdout.fileno(), False)
            line = ""
            while not line and proc.poll() is None:
                peak = max(peak, anonymous(proc.pid))
                time.sleep(0.0005)
                line = proc.stdout.readline()
            os.set_blocking(proc.stdout.fileno(), True)
            assert line.strip() == "done", f"the child failed: {line!r}"
            found.append(peak - base)
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)
    assert proc.returncode == 0
    return found


def _child() -> None:
    import torch  # noqa: F401 - imported before any baseline: its own memory is not a conversion's
    import torch.distributed.checkpoint  # noqa: F401

    import trainstate

    for op, args, kwargs in json.loads(sys.argv[1]):
        print(anonymous(), flush=True)
        sys.stdin.readline()
        getattr(trainstate, op)(*args, **kwargs)
        print("done", flush=True)


if __name__ == "__main__":
    _child()
