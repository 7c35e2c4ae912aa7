"""Property tests: generated nested states round-trip exactly, for NumPy and for torch."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import trainstate
from helpers import assert_same

DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
]


def _random_array(dtype: type, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bytes viewed as ``dtype``: NaN payloads, subnormals and all, which must survive bit-exactly."""
    dt = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=math.prod(shape) * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        raw %= 2
    return raw.view(dt).reshape(shape)


contiguous = st.builds(
    _random_array,
    st.sampled_from(DTYPES),
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    st.integers(0, 2**32 - 1),
)
arrays = contiguous | contiguous.map(lambda a: a.T)  # transposes are non-contiguous
np_scalars = st.sampled_from([np.float32, np.float64, np.int64, np.int32]).flatmap(
    lambda dt: st.integers(-1000, 1000).map(lambda x: dt(x))
)
plain = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
keys = st.text(max_size=6) | st.integers(-5, 50) | st.tuples(st.integers(0, 3), st.text(max_size=2))


def states(leaves: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        leaves,
        lambda children: (
            st.lists(children, max_size=4)
            | st.lists(children, max_size=4).map(tuple)
            | st.dictionaries(keys, children, max_size=4)
        ),
        max_leaves=20,
    )


SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@SETTINGS
@given(state=states(plain | arrays | np_scalars))
def test_numpy_state_roundtrips_exactly(tmp_path_factory, state):
    path = tmp_path_factory.mktemp("ck") / "c"
    trainstate.save(path, state)
    assert_same(state, trainstate.load(path))


torch = pytest.importorskip("torch")


def _to_torch(a: np.ndarray):
    from trainstate._frameworks.torch import from_numpy

    t = from_numpy(np.ascontiguousarray(a))
    return t.t() if t.dim() == 2 else t  # keep some non-contiguous tensors


@SETTINGS
@given(state=states(plain | arrays.map(_to_torch)))
def test_torch_state_roundtrips_exactly(tmp_path_factory, state):
    path = tmp_path_factory.mktemp("ck") / "c"
    trainstate.save(path, state)
    assert_same(state, trainstate.load(path, framework="torch"))


@SETTINGS
@given(state=st.dictionaries(st.text(min_size=1, max_size=5), arrays.map(_to_torch), min_size=1, max_size=5))
def test_torch_in_place_restore_fills_live_tensors(tmp_path_factory, state):
    path = tmp_path_factory.mktemp("ck") / "c"
    trainstate.save(path, state)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    ids = {k: id(v) for k, v in target.items()}
    trainstate.load(path, target)
    assert {k: id(v) for k, v in target.items()} == ids  # the same tensor objects, filled in place
    assert_same(state, target)
