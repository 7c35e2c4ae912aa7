"""RNGState restores every generator so the next draws repeat exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest

import trainstate

torch = pytest.importorskip("torch")


def _draw(np_gen, torch_gen):
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np_gen.random(2).tolist(),
        torch.rand(3).tolist(),
        torch.rand(2, generator=torch_gen).tolist(),
    )


def test_all_generators_resume(tmp_path):
    np_gen = np.random.default_rng(5)
    torch_gen = torch.Generator().manual_seed(7)
    rng = trainstate.RNGState(numpy_generators={"data": np_gen}, torch_generators={"aug": torch_gen})
    random.gauss(0, 1)  # leave a cached gaussian in Python's state
    trainstate.save(tmp_path / "c", {"rng": rng})
    expected = _draw(np_gen, torch_gen)
    _draw(np_gen, torch_gen)  # move everything on
    trainstate.load(tmp_path / "c", {"rng": rng})
    assert _draw(np_gen, torch_gen) == expected


def test_missing_generator_is_a_clear_error(tmp_path):
    trainstate.save(tmp_path / "c", {"rng": trainstate.RNGState()})
    with pytest.raises(trainstate.CheckpointError, match="gen"):
        trainstate.load(tmp_path / "c", {"rng": trainstate.RNGState(numpy_generators={"gen": np.random.default_rng()})})


def test_rng_state_is_pickle_free_data(tmp_path):
    trainstate.save(tmp_path / "c", {"rng": trainstate.RNGState()})
    tree = trainstate.load(tmp_path / "c")
    assert tree["rng"]["torch"].dtype == np.uint8 and tree["rng"]["python"]["state"].shape == (625,)
