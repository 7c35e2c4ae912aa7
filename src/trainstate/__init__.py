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
    MissingDependencyError,
    StateMismatchError,
    StorageError,
    UnsupportedValueError,
)
from .format.manifest import FORMAT_VERSION
from .reader import Checkpoint, TensorInfo
from .reader import open_checkpoint as open
from .rng import RNGState
from .save import SaveResult, save
from .tree import Stateful

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FORMAT_VERSION",
    "FormatVersionError",
    "IncompleteCheckpointError",
    "MissingDependencyError",
    "RNGState",
    "SaveResult",
    "StateMismatchError",
    "Stateful",
    "StorageError",
    "TensorInfo",
    "UnsupportedValueError",
    "__version__",
    "load",
    "open",
    "save",
]
