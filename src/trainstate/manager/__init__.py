"""Training-loop checkpointing: the manager, its policies, async staging and preemption handling."""

from .committer import SaveRecord
from .manager import CheckpointManager
from .policies import CheckpointInfo

__all__ = ["CheckpointInfo", "CheckpointManager", "SaveRecord"]
