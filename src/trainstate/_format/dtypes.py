"""The dtype table: one code per element type, shared by the manifest, the data files and every framework.

Codes are safetensors' dtype strings where safetensors has one, so a data file header names the same type
the manifest does. Types safetensors lacks are stored in the data file as raw ``U8`` bytes; the manifest
still carries the true code. NumPy-side types for bfloat16 and the float8 family come from ml_dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from trainstate.errors import CorruptCheckpointError, UnsupportedValueError


@dataclass(frozen=True)
class DType:
    code: str
    numpy: np.dtype
    torch_name: str
    safetensors: bool  # whether safetensors readers know this code

    @property
    def itemsize(self) -> int:
        return int(self.numpy.itemsize)


def _d(code: str, np_type: object, torch_name: str, safetensors: bool = True) -> DType:
    return DType(code, np.dtype(np_type), torch_name, safetensors)  # type: ignore[call-overload]


_TABLE = [
    _d("BOOL", np.bool_, "bool"),
    _d("U8", np.uint8, "uint8"),
    _d("I8", np.int8, "int8"),
    _d("U16", np.uint16, "uint16"),
    _d("I16", np.int16, "int16"),
    _d("U32", np.uint32, "uint32"),
    _d("I32", np.int32, "int32"),
    _d("U64", np.uint64, "uint64"),
    _d("I64", np.int64, "int64"),
    _d("F16", np.float16, "float16"),
    _d("BF16", ml_dtypes.bfloat16, "bfloat16"),
    _d("F32", np.float32, "float32"),
    _d("F64", np.float64, "float64"),
    _d("C64", np.complex64, "complex64"),
    _d("C128", np.complex128, "complex128", safetensors=False),
    _d("F8_E4M3", ml_dtypes.float8_e4m3fn, "float8_e4m3fn"),
    _d("F8_E5M2", ml_dtypes.float8_e5m2, "float8_e5m2"),
    _d("F8_E4M3FNUZ", ml_dtypes.float8_e4m3fnuz, "float8_e4m3fnuz"),
    _d("F8_E5M2FNUZ", ml_dtypes.float8_e5m2fnuz, "float8_e5m2fnuz"),
    _d("F8_E8M0", ml_dtypes.float8_e8m0fnu, "float8_e8m0fnu", safetensors=False),
]

BY_CODE: dict[str, DType] = {d.code: d for d in _TABLE}
BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in _TABLE}
BY_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in _TABLE}


def from_code(code: object) -> DType:
    """The dtype for a manifest code; a code this reader does not know is a corrupt manifest."""
    if isinstance(code, str) and code in BY_CODE:
        return BY_CODE[code]
    raise CorruptCheckpointError(f"unknown dtype code {code!r}; known: {sorted(BY_CODE)}")


def from_numpy(dtype: np.dtype) -> DType:
    try:
        return BY_NUMPY[dtype.newbyteorder("=") if dtype.byteorder == "<" else dtype]
    except KeyError:
        raise UnsupportedValueError(f"NumPy dtype {dtype} cannot be stored") from None
