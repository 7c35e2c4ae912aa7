"""The stand-in directory that sets the Trainer's loop to where a trainstate checkpoint left off.

``Trainer.train(resume_from_checkpoint=PATH)`` is the only way into the Trainer's resume: from
``PATH/trainer_state.json`` it takes the global step, from that the epoch and the batches to skip, and it
restores its callbacks' states. It also insists on loading model weights from ``PATH`` (it raises "Can't find a
valid checkpoint" without a weights file or index) and reads its own pickles (``optimizer.pt``, ``scheduler.pt``,
``rng_state.pth``) when they are there.

The stand-in holds the saved ``trainer_state.json`` and a weights index, ``model.safetensors.index.json``, that
names every weight of the model but maps them all to one empty safetensors file: the Trainer's sharded loader
takes the names from the index (so it reports nothing missing) and loads nothing. No pickle is there, so the
Trainer restores nothing else; :class:`~trainstate.integrations.huggingface.TrainstateCallback` restores the
model, optimizer, scheduler and RNG from the trainstate checkpoint when training begins, and removes the
stand-in. The weights it restores are checksum-verified; the stand-in's are never used.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable
from typing import Any

TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
INDEX = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
EMPTY_SHARD = "trainstate-restores-the-weights.safetensors"
MARKER = "trainstate.json"


def write(trainer_state: dict[str, Any], weight_names: Iterable[str], checkpoint: str) -> str:
    """A fresh stand-in directory for resuming from ``checkpoint`` (a trainstate checkpoint's path); returns it."""
    where = tempfile.mkdtemp(prefix="trainstate-hf-resume-")
    try:
        with open(os.path.join(where, TRAINER_STATE), "w", encoding="utf-8") as f:
            f.write(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
        index = {
            "metadata": {
                "total_size": 0,
                "note": f"a stand-in: trainstate's TrainstateCallback restores the weights from {checkpoint}",
            },
            "weight_map": {name: EMPTY_SHARD for name in weight_names},
        }
        with open(os.path.join(where, INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        with open(os.path.join(where, EMPTY_SHARD), "wb") as f:
            f.write(struct.pack("<Q", 8) + b"{}      ")  # a safetensors file with no tensors
        with open(os.path.join(where, MARKER), "w", encoding="utf-8") as f:
            json.dump({"checkpoint": checkpoint}, f)
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    return where


def is_stand_in(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, MARKER))


def remove(path: str | None) -> None:
    if path is not None and is_stand_in(path):
        shutil.rmtree(path, ignore_errors=True)
