"""JSON that trainstate reads but did not write (a run's history record or pin file, a downloaded Hugging Face
index, a safetensors file's ``trainstate.tied``) nested deeper than Python's parser goes: a RecursionError,
not a ValueError. Each is read as the damaged or foreign file it is, never as a raw error."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import trainstate

DEEP = "[" * 100_000 + "]" * 100_000


def _run(root: Path, **kwargs: object) -> trainstate.CheckpointManager:
    return trainstate.CheckpointManager(root, every_steps=1, capture_rng=False, **kwargs)  # type: ignore[arg-type]


def test_a_deeply_nested_history_record_is_skipped_as_unreadable(tmp_path: Path) -> None:
    with _run(tmp_path) as mgr:
        mgr.save(1, {"w": np.zeros(3)}, metrics={"loss": 1.0})
        mgr.save(2, {"w": np.zeros(3)}, metrics={"loss": 0.5})
    for record in (tmp_path / "_history").glob("*.json"):
        record.write_text(DEEP)
    entries = trainstate.history(tmp_path)  # the records are skipped, as torn ones are; the checkpoints remain
    assert [e.step for e in entries] == [1, 2]


def test_a_deeply_nested_pin_file_still_pins(tmp_path: Path) -> None:
    with _run(tmp_path, keep_last=1) as mgr:
        mgr.save(1, {"w": np.zeros(3)})
        mgr.pin(1, "keep")
    (tmp_path / "step_00000001" / "pinned.json").write_text(DEEP)
    with _run(tmp_path, keep_last=1) as mgr:
        mgr.save(2, {"w": np.zeros(3)})
    assert (tmp_path / "step_00000001").is_dir()


def test_a_deeply_nested_hugging_face_index_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(DEEP)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"model.safetensors.index.json"):
        trainstate.import_checkpoint(folder, tmp_path / "out")


def test_deeply_nested_tied_metadata_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    header = {
        "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "__metadata__": {"trainstate.tied": DEEP},
    }
    raw = json.dumps(header).encode()
    src = tmp_path / "tied.safetensors"
    src.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"tied.safetensors"):
        trainstate.import_checkpoint(src, tmp_path / "out")
