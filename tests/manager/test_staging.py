"""The async staging buffer: kept out of forked DataLoader workers, never overwritten by its reservation."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

import trainstate
from trainstate._manager import committer as committer_module
from trainstate._save import encode_state
from trainstate._save.staging import StagingBuffer

torch = pytest.importorskip("torch")
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="MADV_DONTFORK and /proc/self/maps are Linux")


def join_reservation() -> None:
    for t in threading.enumerate():
        if t.name == "trainstate-reserve":
            t.join()


def peek(address: int, n: int) -> bytes | None:
    """The ``n`` bytes at ``address`` in the calling process, or None where nothing is mapped."""
    with open("/proc/self/mem", "rb", buffering=0) as mem:
        try:
            return os.pread(mem.fileno(), n, address)
        except OSError:
            return None


class SeenInWorker(torch.utils.data.Dataset):
    """Each item says whether the DataLoader worker reading it sees the given bytes at the given addresses."""

    def __init__(self, expected: dict[int, bytes]) -> None:
        self.expected = expected

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([peek(a, len(b)) == b for a, b in self.expected.items()])


@linux_only
def test_dataloader_workers_do_not_share_the_staging_buffer(tmp_path):
    # Pages shared copy-on-write with forked workers make the next save fault on every page of the buffer.
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MB
    with trainstate.CheckpointManager(tmp_path, every_steps=1, async_save=True) as mgr:
        mgr.prepare(state)
        join_reservation()
        mgr.save(1, state)  # the staging buffer now holds the state's bytes
        mgr.wait()
        buf = mgr._writer.queue.buffers[0]._buf
        start, end = buf.ctypes.data, buf.ctypes.data + state["w"].nbytes - 64
        expected = {a: peek(a, 64) for a in (start, end)}
        assert expected[start] == state["w"][:16].numpy().tobytes()
        loader = torch.utils.data.DataLoader(
            SeenInWorker(expected),
            batch_size=None,
            num_workers=2,
            persistent_workers=True,
            multiprocessing_context="fork",
        )
        seen = torch.stack(list(loader))
        assert not seen.any(), "a DataLoader worker shares the staging buffer's pages"
        state["w"] += 1
        mgr.save(2, state)  # the workers are still alive
        mgr.wait()
        del loader
    assert np.array_equal(trainstate.load(tmp_path / "step_00000002")["w"], state["w"].numpy())


@linux_only
def test_a_forked_child_that_stages_gets_its_own_buffer():
    buffer, data = StagingBuffer(), np.arange(1 << 20, dtype=np.float32)
    buffer.reserve(encode_state({"w": data}))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ok = False
        try:
            staged = buffer.stage(encode_state({"w": data}))
            ok = np.array_equal(staged.entries[0].value.view(np.float32), data)
        finally:
            os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0


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
    real_reserve, real_write = StagingBuffer.reserve, committer_module.write_checkpoint

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
    monkeypatch.setattr(committer_module, "write_checkpoint", write_after_reservation)
    with trainstate.CheckpointManager(tmp_path, every_steps=1, async_save=True) as mgr:
        mgr.prepare(state)
        mgr.save(1, state)
        mgr.wait()
    assert np.array_equal(trainstate.load(tmp_path / "step_00000001")["w"], state["w"].numpy())
