"""Training-loop checkpointing: the manager, its policies, async staging and preemption handling."""

from trainstate._history.log import SaveRecord
from trainstate._manager.manager import CheckpointManager
from trainstate._manager.policies import CheckpointInfo

__all__ = ["CheckpointInfo", "CheckpointManager", "SaveRecord"]
