"""Checks and conversions for what users pass: steps, epochs, metrics, counts, policy settings.

Users pass NumPy scalars (``np.int64`` steps from a counter array, ``np.float32`` losses) and 0-d torch
tensors (``loss.detach()``) where plain numbers are expected; these are accepted and turned into plain
Python numbers here, once. Everything else that is wrong raises :class:`InvalidArgumentError` naming the
argument (and, for metrics, the key).
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from trainstate.errors import InvalidArgumentError


def step(value: Any, what: str = "step") -> int:
    """A non-negative integer step or epoch: ints, NumPy integers and 0-d integer tensors."""
    return _integer(value, what, minimum=0)


def _integer(value: Any, what: str, minimum: int) -> int:
    kind = "non-negative" if minimum == 0 else "positive"
    try:
        if isinstance(value, (bool, str)):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(
            f"{what} must be a {kind} integer, got {type(value).__name__} {value!r:.40}"
        ) from None
    if n < minimum:
        raise InvalidArgumentError(f"{what} must be at least {minimum}, got {n}")
    return n


def number(value: Any, what: str) -> float:
    """A plain float from an int, float, NumPy scalar or one-element tensor; NaN and inf are kept."""
    if isinstance(value, bool) or isinstance(value, (str, bytes)):
        raise InvalidArgumentError(f"{what} must be a number, got {type(value).__name__} {value!r:.40}")
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    size = getattr(value, "size", None)
    size = size() if callable(size) and not isinstance(size, int) else size  # torch: size() is the shape
    numel = getattr(value, "numel", None)
    count = numel() if callable(numel) else (size if isinstance(size, int) else None)
    if callable(item) and count == 1:
        try:
            return float(item())
        except (TypeError, ValueError):
            pass
    raise InvalidArgumentError(
        f"{what} must be a number (a float, a NumPy scalar or a one-element tensor), "
        f"got {type(value).__name__} {value!r:.60}"
    )


def metrics(values: Mapping[str, Any] | None) -> dict[str, float]:
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise InvalidArgumentError(f"metrics must be a dict of name -> number, got {type(values).__name__}")
    out = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise InvalidArgumentError(f"metric names must be strings, got {key!r:.40}")
        out[key] = number(value, f"metrics[{key!r}]")
    return out


def positive_int(value: Any, what: str) -> int:
    return _integer(value, what, minimum=1)


def positive_number(value: Any, what: str) -> float:
    x = number(value, what)
    if not math.isfinite(x) or x <= 0:
        raise InvalidArgumentError(f"{what} must be a positive, finite number, got {value!r:.40}")
    return x


def keep_best(value: Any) -> tuple[str, str, int]:
    """``(metric, "min" | "max")`` or ``(metric, "min" | "max", k)``."""
    if not isinstance(value, (tuple, list)) or len(value) not in (2, 3) or not isinstance(value[0], str):
        raise InvalidArgumentError(f"keep_best must be (metric, 'min' | 'max', k), got {value!r:.60}")
    metric, mode = value[0], value[1]
    if mode not in ("min", "max"):
        raise InvalidArgumentError(f"keep_best mode must be 'min' or 'max', got {mode!r:.40}")
    k = positive_int(value[2], "keep_best k") if len(value) == 3 else 1
    return metric, mode, k


def flag(value: Any, what: str) -> bool:
    """A real bool (or NumPy bool): ``async_save="yes"`` is a mistake, not a truthy string."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InvalidArgumentError(f"{what} must be True or False, got {type(value).__name__} {value!r:.40}")


def location(value: Any) -> str | os.PathLike[str]:
    """A checkpoint directory: a non-empty path or URL."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(f"the directory must be a non-empty path or URL, got {value!r:.60}")
    return value
