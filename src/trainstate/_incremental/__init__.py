"""Incremental checkpoints: a tensor whose bytes did not change since the previous save is not written again.

``CheckpointManager(dir, incremental=True)`` writes each save's new bytes into the run's shared pool
(``pool.py``: ``<run>/_shared/``), and the new manifest refers to pool files earlier saves wrote for the
tensors that did not change (``index.py`` finds them, ``check.py`` makes sure their bytes are still there,
``save.py`` writes the rest). Readers find pool
files through the manifest's ``"pool": true`` flag (docs/format.md §11), so every checkpoint still loads
on its own. A pool file is deleted only when no manifest in the run names it (``gc.py``, run by the
manager's sweep and after each retention pass).

Modules are imported where used (``from trainstate._incremental.pool import ...``): the reader needs only
``pool.py``, and importing this package costs nothing.
"""
