"""Framework adapters: the only modules that import torch or jax.

An adapter knows, for its array type, how to describe a value (dtype code, shape), expose its bytes for
writing, make an empty array to read into, and expose a live array's memory for in-place reads.
Dispatch looks at ``sys.modules`` first, so a framework that was never imported is never imported here.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from trainstate._frameworks import numpy as numpy_adapter


def adapter_for(value: Any) -> ModuleType | None:
    """The adapter module for an array value, or None if ``value`` is not an array we store."""
    if numpy_adapter.is_array(value):
        return numpy_adapter
    if "torch" in sys.modules and type(value).__module__.startswith("torch"):
        from trainstate._frameworks import torch as torch_adapter

        if torch_adapter.is_array(value):
            return torch_adapter
    return None


def adapter_named(kind: str) -> ModuleType:
    if kind == "torch":
        from trainstate._frameworks import torch as torch_adapter

        return torch_adapter
    return numpy_adapter
