"""The same crash states for what users would otherwise write with: ``torch.distributed.checkpoint`` (its
FileSystemWriter, in one process) and ``torch.save`` to a temporary file renamed over the last one.

What "consistent" means for each, stated as their users rely on it:

* **DCP**: each save goes to its own directory (``step_N``); a checkpoint is complete when its ``.metadata``
  file exists (what torchtitan and most loops check). The newest directory with a ``.metadata`` must load with
  ``dcp.load`` and hold exactly what that save held, and be no older than the last save that returned.
* **torch.save + rename**: ``torch.save`` to ``ckpt.pt.tmp``, then ``os.replace`` onto ``ckpt.pt`` (the common
  "atomic" recipe, no fsync). ``torch.load("ckpt.pt")`` must hold exactly a saved state, no older than the last
  save that returned.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .campaign import Result, distinct
from .record import Recorder
from .states import crash_states, materialize


def _state(step: int) -> dict[str, Any]:
    import torch

    return {"w": torch.full((64, 16), float(step)), "b": torch.arange(32) + step, "step": torch.tensor(step)}


def _same(a: dict[str, Any], step: int) -> bool:
    import torch

    want = _state(step)
    return all(torch.equal(a[k], want[k]) for k in want)


def _dcp_work(root: Path, recorder: Recorder) -> None:
    import torch.distributed.checkpoint as dcp

    for step in range(3):
        dcp.save(_state(step), checkpoint_id=str(root / f"step_{step}"))
        recorder.mark(f"committed {step}")


def _dcp_judge(root: Path, committed: list[int]) -> None:
    import torch.distributed.checkpoint as dcp

    floor = max(committed) if committed else None
    done = sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if (p / ".metadata").exists())
    if not done:
        assert floor is None, f"no complete checkpoint, though step {floor} was saved"
        return
    step = done[-1]
    assert floor is None or step >= floor, f"newest complete is {step}, older than {floor}"
    target = _state(-1)
    dcp.load(target, checkpoint_id=str(root / f"step_{step}"))
    assert _same(target, step), f"step {step} loads other values"


def _torch_work(root: Path, recorder: Recorder) -> None:
    import torch

    for step in range(3):
        torch.save(_state(step), root / "ckpt.pt.tmp")
        recorder.wrote(root / "ckpt.pt.tmp")  # torch.save writes from C++, out of the recorder's sight
        os.replace(root / "ckpt.pt.tmp", root / "ckpt.pt")
        recorder.mark(f"committed {step}")


def _torch_judge(root: Path, committed: list[int]) -> None:
    import torch

    floor = max(committed) if committed else None
    if not (root / "ckpt.pt").exists():
        assert floor is None, f"no ckpt.pt, though step {floor} was saved"
        return
    state = torch.load(root / "ckpt.pt", weights_only=True)
    step = int(state["step"])
    assert floor is None or step >= floor, f"holds step {step}, older than {floor}"
    assert _same(state, step), f"step {step} holds other values"


TOOLS: list[tuple[str, Callable[[Path, Recorder], None], Callable[[Path, list[int]], None]]] = [
    ("torch.distributed.checkpoint (FileSystemWriter), 3 saves", _dcp_work, _dcp_judge),
    ("torch.save to a temporary file + os.replace, 3 saves", _torch_work, _torch_judge),
]


def _marks(recorder: Recorder, k: int) -> list[str]:
    return [label for at, label in recorder.marks if at <= k]


def run(name: str, work: Any, judge: Any, sample: int | None = None, seed: int = 0) -> Result:
    result = Result(name)
    with tempfile.TemporaryDirectory(prefix="crashstates-others-") as tmp:
        root = Path(tmp) / "recorded"
        root.mkdir()
        recorder = Recorder(root)
        with recorder:
            work(root, recorder)
        result.operations = len(recorder.ops)
        states = [
            (k, how, image)
            for (k, how, _, image) in distinct(
                [(k, how, _marks(recorder, k), image) for k, how, image in crash_states(recorder.before, recorder.ops)]
            )
        ]
        result.states = len(states)
        if sample is not None and sample < len(states):
            states = random.Random(seed).sample(states, sample)
        for k, how, image in states:
            shutil.rmtree(root)
            root.mkdir()
            materialize(image, root)
            committed = [int(label.split()[1]) for at, label in recorder.marks if at <= k]
            try:
                judge(root, committed)
            except Exception as e:  # noqa: BLE001 - each failure is a finding
                result.failures.append(f"after op {k} ({how}): {type(e).__name__}: {str(e)[:160]}")
            result.checked += 1
    return result
