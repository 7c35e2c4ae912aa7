"""Writing one checkpoint: state -> tree -> plan -> write -> commit (encode.py, plan.py, write.py). The
``save()`` verb, which also chooses between this and a collective save, is in ``trainstate._saving``."""

from __future__ import annotations

from trainstate._cores import DEFAULT_THREADS
from trainstate._save.encode import Snapshot, TensorTable, encode_state
from trainstate._save.options import SaveOptions, save_options
from trainstate._save.plan import FILE_TEMPLATE, plan_files
from trainstate._save.write import SaveResult, write_checkpoint

__all__ = [
    "DEFAULT_THREADS",
    "FILE_TEMPLATE",
    "SaveOptions",
    "SaveResult",
    "Snapshot",
    "TensorTable",
    "encode_state",
    "plan_files",
    "save_options",
    "write_checkpoint",
]
