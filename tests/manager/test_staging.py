"""The async staging buffer: never overwritten by its reservation."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import trainstate
from trainstate.manager import manager as manager_module
from trainstate.manager.staging import StagingBuffer
from trainstate.save import encode_state

torch = pytest.importorskip("torch")


def test_a_late_reservation_leaves_staged_bytes_alone():
    data = np.arange(1 << 20, dtype=np.float32) + 1  # no zero byte at any multiple of 4096
    buffer = StagingBuffer()
    staged = buffer.stage(encode_state({"w": data}))
    buffer.reserve(encode_state({"w": data}))  # the helper thread of prepare() only now got to run
    assert np.array_equal(staged.entries[0].value.view(np.float32), data)


def test_prepare_then_an_immediate_save_stores_the_state(tmp_path, monkeypatch):
    # prepare() reserves on a helper thread; here that thread runs only after save() staged the state and
    # before the background write reads the staged bytes.
    state = {"w": torch.arange(1 << 20, dtype=torch.float32) + 1}
    staged, reserved = threading.Event(), threading.Event()
    real_reserve, real_write = StagingBuffer.reserve, manager_module.write_checkpoint

    def late_reserve(self, snapshot):
        staged.wait()
        try:
            real_reserve(self, snapshot)
        finally:
            reserved.set()

    def write_after_reservation(*args, **kwargs):
        staged.set()
        reserved.wait()
        return real_write(*args, **kwargs)

    monkeypatch.setattr(StagingBuffer, "reserve", late_reserve)
    monkeypatch.setattr(manager_module, "write_checkpoint", write_after_reservation)
    with trainstate.CheckpointManager(tmp_path, every_steps=1, async_save=True) as mgr:
        mgr.prepare(state)
        mgr.save(1, state)
        mgr.wait()
    assert np.array_equal(trainstate.load(tmp_path / "step_00000001")["w"], state["w"].numpy())
