"""trainstate: save and resume machine-learning training state.

Example:
    >>> import trainstate
    >>> state = {"model": model, "optim": optimizer, "step": 1200, "rng": trainstate.RNGState()}
    >>> trainstate.save("ckpt/step_1200", state, metadata={"run": "exp1"})
    >>> trainstate.load("ckpt/step_1200", state)
"""

from __future__ import annotations

from .api import load
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    MissingDependencyError,
    StateMismatchError,
    StorageError,
    UnknownKeyError,
    UnsupportedValueError,
)
from .format.manifest import FORMAT_VERSION
from .manager import CheckpointInfo, CheckpointManager, SaveRecord
from .reader import Checkpoint, TensorInfo
from .reader import open_checkpoint as open
from .rng import RNGState
from .save import SaveResult, save
from .storage import check as check_storage
from .tree import Stateful

__version__ = "0.1.0"

_LAZY = {
    "ResumableSampler": "trainstate.data",
    "seed_per_sample": "trainstate.data",
}  # these import torch: only on first use


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainstate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FORMAT_VERSION",
    "FormatVersionError",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "MissingDependencyError",
    "RNGState",
    "ResumableSampler",
    "SaveRecord",
    "SaveResult",
    "StateMismatchError",
    "Stateful",
    "StorageError",
    "TensorInfo",
    "UnknownKeyError",
    "UnsupportedValueError",
    "__version__",
    "check_storage",
    "load",
    "open",
    "save",
    "seed_per_sample",
]
