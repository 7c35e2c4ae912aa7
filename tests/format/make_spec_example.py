"""The state behind the example checkpoint that closes docs/format.md (tests/fixtures/v1.0/spec-example).

Small, but it has every node tag, a tied tensor, a NumPy scalar, a dtype safetensors lacks (complex128, listed
as U8 in the data-file header), header padding and user metadata. Regenerate the fixture with
``python tests/format/make_spec_example.py``, then paste the blocks ``python tests/format/test_spec_reader.py``
prints into docs/format.md §9 (test_spec_reader checks that the document shows the fixture's bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

FIXTURE = Path(__file__).parent.parent / "fixtures" / "v1.0" / "spec-example"
METADATA = {"run": "example"}


def example_state() -> dict[str, Any]:
    """The state saved into the fixture: what the document's example shows."""
    import torch

    model = torch.nn.Linear(2, 2)  # a stateful object: its state_dict() is stored, its tensors are kind "torch"
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        model.bias.copy_(torch.tensor([0.5, -0.5]))
    return {
        "model": model,
        "ema": {"weight": model.weight},  # the same tensor again: stored once, referenced twice
        "step": 7,
        "lr": 0.25,
        "betas": (0.9, 0.999),
        "scale": np.float16(1024.0),  # a NumPy scalar: kind "numpy-scalar"
        "z": np.array([1 + 2j], dtype=np.complex128),  # no safetensors dtype: U8 in the data-file header
        "history": [None, True, "ok", float("-inf")],
        "counts": {0: 3, (1, "b"): 4},  # int and tuple keys
        "seed": b"\x01\x02\x03",
    }


if __name__ == "__main__":
    import shutil

    import trainstate

    shutil.rmtree(FIXTURE, ignore_errors=True)
    trainstate.save(FIXTURE, example_state(), metadata=METADATA, threads=1)
    print("wrote", FIXTURE)
