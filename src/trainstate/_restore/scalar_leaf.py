"""A Python number and a 0-d array are one leaf when restoring.

JAX turns a number into a 0-d array wherever a jitted function takes or returns it: a ``TrainState``'s
``step``, or a loop's ``state["step"]``, is ``0`` when created and an array after a jitted step. So in the
target's dicts and JAX pytrees, a saved 0-d tensor restores into a number of its kind and a saved number into
a 0-d array, where the kinds match (a bool from BOOL, an int from an integer dtype, a float from a floating
one) and the value fits. The planner asks :func:`planned_against` what to plan a leaf against and gives the
result its target's type with :func:`as_own`.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import numpy as np

from trainstate._format import dtypes
from trainstate._format.manifest import TensorEntry
from trainstate._frameworks import NUMPY, adapter_for


def is_number(value: Any) -> TypeGuard[bool | int | float]:
    return isinstance(value, (bool, int, float))


def planned_against(own: Any, saved_tensor: TensorEntry | None, saved_value: Any) -> Any:
    """What a target leaf ``own`` is planned against: a NumPy 0-d array to read a saved 0-d tensor into where
    ``own`` is a number, the saved number where ``own`` is a 0-d array that holds it, else ``own`` itself."""
    if is_number(own) and saved_tensor is not None:
        if saved_tensor.shape == () and _fits(own, saved_tensor.dtype):
            return NUMPY.empty(saved_tensor.dtype, ())
    elif is_number(saved_value):
        code = _scalar_code(own)
        if code is not None and _fits(saved_value, code) and _holds(code, saved_value):
            return saved_value
    return own


def as_own(own: Any, value: Any) -> Any:
    """A value restored against :func:`planned_against`'s answer, as ``own``'s type."""
    if is_number(own) and isinstance(value, np.ndarray):
        return type(own)(value.item())
    code = _scalar_code(own) if is_number(value) else None
    if code is None:
        return value
    adapter = adapter_for(own)
    assert adapter is not None
    return adapter.assign(own, adapter.from_numpy(np.asarray(value, dtype=dtypes.from_code(code).numpy)))


def _scalar_code(value: Any) -> str | None:
    """The dtype code of a 0-d array of any framework, else None."""
    adapter = adapter_for(value)
    if adapter is None:
        return None
    code, shape, _ = adapter.describe(value)
    return code if shape == () else None


def _fits(number: bool | int | float, code: str) -> bool:
    if isinstance(number, bool):
        return code == "BOOL"
    if isinstance(number, int):
        return code[0] in "IU"
    return code[0] == "F" or code == "BF16"


def _holds(code: str, number: bool | int | float) -> bool:
    """Whether a 0-d array of dtype ``code`` holds ``number`` exactly (an int in range, a float that fits)."""
    try:
        return bool(np.asarray(number, dtype=dtypes.from_code(code).numpy).item() == number)
    except (OverflowError, ValueError):
        return False
