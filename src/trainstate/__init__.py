"""trainstate: save and resume machine-learning training state.

Example:
    >>> import trainstate
    >>> state = {"model": model, "optim": optimizer, "step": 1200, "rng": trainstate.RNGState()}
    >>> trainstate.save("ckpt/step_1200", state, metadata={"run": "exp1"})
    >>> trainstate.load("ckpt/step_1200", state)
"""

from __future__ import annotations

from trainstate import _version
from trainstate._convert.average import average
from trainstate._convert.consolidate import consolidate
from trainstate._convert.export import ExportResult, export
from trainstate._convert.import_ import import_checkpoint
from trainstate._convert.onnx import export_onnx
from trainstate._convert.pack import pack
from trainstate._format.manifest import FORMAT_VERSION
from trainstate._keys import generate_key
from trainstate._manager import CheckpointInfo, CheckpointManager, SaveRecord
from trainstate._manager.history import HistoryEntry, history
from trainstate._manager.history_plot import plot_history
from trainstate._manager.local_tier import LocalTier
from trainstate._manager.policies import (
    AtSteps,
    EverySeconds,
    EverySteps,
    KeepBest,
    KeepEveryMinutes,
    KeepEverySteps,
    KeepLast,
    RetentionPlan,
    RetentionPolicy,
    SavePolicy,
)
from trainstate._restore import load
from trainstate._restore.checkpoint import Checkpoint, TensorInfo
from trainstate._restore.checkpoint import open_checkpoint as open
from trainstate._rng import RNGState
from trainstate._sample_stream import GlobalBatches
from trainstate._save import SaveResult
from trainstate._saving import save
from trainstate._state import PerRank, Stateful
from trainstate._storage import Capabilities, FileInfo, LocalStorage, Storage
from trainstate._storage import check as check_storage
from trainstate.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedError,
    EncryptionKeyError,
    FormatVersionError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    KeyRequiredError,
    MissingDependencyError,
    NotEncryptedError,
    OnnxExportError,
    StateMismatchError,
    StorageError,
    TamperedCheckpointError,
    UnknownKeyError,
    UnsupportedValueError,
    WrongKeyError,
)

__version__ = _version.VERSION
"""trainstate's version, as pip knows it (``trainstate --version`` prints it too).

Example:
    >>> trainstate.__version__
    '0.1.0'
"""

_LAZY = {
    "FsspecStorage": "trainstate._storage.fsspec",
    "ResumableSampler": "trainstate._data",
    "seed_per_sample": "trainstate._data",
}  # these import torch or fsspec: only on first use


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainstate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AtSteps",
    "Capabilities",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DistributedError",
    "EncryptionKeyError",
    "EverySeconds",
    "EverySteps",
    "ExportResult",
    "FORMAT_VERSION",
    "FileInfo",
    "FormatVersionError",
    "FsspecStorage",
    "GlobalBatches",
    "HistoryEntry",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "KeepBest",
    "KeepEveryMinutes",
    "KeepEverySteps",
    "KeepLast",
    "KeyRequiredError",
    "LocalStorage",
    "LocalTier",
    "MissingDependencyError",
    "NotEncryptedError",
    "OnnxExportError",
    "PerRank",
    "RNGState",
    "ResumableSampler",
    "RetentionPlan",
    "RetentionPolicy",
    "SavePolicy",
    "SaveRecord",
    "SaveResult",
    "StateMismatchError",
    "Stateful",
    "Storage",
    "StorageError",
    "TamperedCheckpointError",
    "TensorInfo",
    "UnknownKeyError",
    "UnsupportedValueError",
    "WrongKeyError",
    "__version__",
    "average",
    "check_storage",
    "consolidate",
    "export",
    "export_onnx",
    "generate_key",
    "history",
    "import_checkpoint",
    "load",
    "open",
    "pack",
    "plot_history",
    "save",
    "seed_per_sample",
]
