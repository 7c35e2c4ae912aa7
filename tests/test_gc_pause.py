"""save and load pause the cyclic garbage collector while they run and leave it as the user had it."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import trainstate


class Probe:
    """A stateful part of the state that records whether the collector ran during save and load."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def state_dict(self):
        self.seen.append(gc.isenabled())
        return {"w": np.arange(4.0)}

    def load_state_dict(self, state):
        self.seen.append(gc.isenabled())


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_during_save_and_load_and_restored_after(tmp_path, enabled):
    probe = Probe()
    (gc.enable if enabled else gc.disable)()
    try:
        trainstate.save(tmp_path / "c", {"p": probe, "x": np.zeros(3)})
        trainstate.load(tmp_path / "c", {"p": probe, "x": np.zeros(3)})
        assert gc.isenabled() is enabled
        assert probe.seen == [False, False, False]  # save's state_dict, load's state_dict and load_state_dict
    finally:
        gc.enable()


def test_the_collector_comes_back_after_a_failed_load(tmp_path):
    trainstate.save(tmp_path / "c", {"x": np.zeros(3)})
    data = tmp_path / "c" / "data-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    assert gc.isenabled()
    with pytest.raises(trainstate.CorruptCheckpointError):
        trainstate.load(tmp_path / "c", {"x": np.zeros(3)})
    assert gc.isenabled()
