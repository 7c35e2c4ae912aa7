"""NumPy arrays and scalars; bfloat16 and float8 come from ml_dtypes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from trainstate._format import dtypes
from trainstate.errors import UnsupportedValueError

KIND = "numpy"


def is_array(value: Any) -> bool:
    # np.str_ / np.bytes_ are str / bytes subclasses: they go through the scalar path instead.
    return isinstance(value, np.ndarray) or (isinstance(value, np.generic) and value.dtype.kind not in "US")


def has_values(value: Any) -> bool:
    return True


def describe(value: Any) -> tuple[str, tuple[int, ...], str]:
    """(dtype code, shape, kind) of an array or NumPy scalar."""
    if value.dtype.hasobject or value.dtype.fields is not None:
        raise UnsupportedValueError(f"NumPy dtype {value.dtype} (object or structured) cannot be stored")
    kind = "numpy-scalar" if isinstance(value, np.generic) else KIND
    dtype = value.dtype.newbyteorder("=") if value.dtype.byteorder == ">" else value.dtype
    return dtypes.from_numpy(dtype).code, tuple(int(n) for n in np.shape(value)), kind


def identity(value: Any) -> tuple[object, ...] | None:
    """A key equal for two arrays that are the same view of the same memory."""
    if isinstance(value, np.generic) or value.size == 0:
        return None
    return ("np", value.__array_interface__["data"][0], value.shape, value.strides, value.dtype.str)


def local_part(value: Any) -> tuple[Any, tuple[int, ...]] | None:
    return None


def byte_view(value: Any) -> memoryview:
    """The value's bytes in C order, little-endian; copies only when the layout requires it."""
    arr = np.asarray(value)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8).data


def empty(code: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, dtype=dtypes.from_code(code).numpy)


def writable_view(target: Any) -> memoryview | None:
    """Memory to read straight into ``target``, or None when its layout does not allow it."""
    if (
        isinstance(target, np.ndarray)
        and target.flags.c_contiguous
        and target.flags.writeable
        and target.dtype.byteorder != ">"
    ):
        return target.reshape(-1).view(np.uint8).data
    return None


def on_accelerator(value: Any) -> bool:
    return False  # NumPy arrays live in host memory


def staging(nbytes: int, like: Any) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def cuttable(value: Any) -> bool:
    return writable_view(value) is not None


def copy_in_async(pairs: list[tuple[Any, int | None, np.ndarray]]) -> Callable[[], list[Any]]:
    """Host memory: the copies are done when this returns."""
    for target, offset, host in pairs:
        if offset is None:
            np.copyto(target, host.view(target.dtype).reshape(target.shape))
        else:
            view = writable_view(target)
            assert view is not None
            np.frombuffer(view, np.uint8)[offset : offset + host.nbytes] = host
    targets = [target for target, _, _ in pairs]
    return lambda: targets


def copy_out(pairs: list[tuple[Any, np.ndarray]]) -> None:
    for value, host in pairs:
        np.copyto(host, np.frombuffer(byte_view(value), dtype=np.uint8))


def copy_range_out(value: Any, offset: int, host: np.ndarray) -> None:
    np.copyto(host, np.frombuffer(byte_view(value), np.uint8)[offset : offset + host.nbytes])


def finish(array: np.ndarray, kind: str) -> Any:
    """Turn a freshly read array into what the saver held (a scalar stays a scalar)."""
    return array[()] if kind == "numpy-scalar" else array


def assign(target: Any, source: np.ndarray) -> Any:
    """Copy ``source`` into ``target`` when it is a writable array, else return ``source``."""
    if isinstance(target, np.ndarray) and target.flags.writeable:
        target[...] = source
        return target
    return source


def from_numpy(array: np.ndarray) -> np.ndarray:
    return array


def load_takes_strict(obj: Any) -> bool:
    return False  # NumPy has no stateful objects


def rebuilt_from_checkpoint(obj: Any) -> bool:
    return False


def after_restore(restored: Any) -> None:
    return None
