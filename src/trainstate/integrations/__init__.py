"""Where users already train: plug trainstate into a training framework's own checkpointing.

Each integration is a module of its own, imported by name so that a user of one never imports the other's
framework: ``trainstate.integrations.lightning`` (PyTorch Lightning's ``CheckpointIO``) and
``trainstate.integrations.huggingface`` (the Hugging Face ``Trainer``).
"""
