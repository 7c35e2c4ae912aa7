"""A run's save history: what each save of a CheckpointManager cost and what became of its checkpoint.

``log.py`` is the history file itself: one small JSON record per save, written by the manager after the save
committed (or failed), into ``_history/`` in the run directory, and read back. ``entries.py`` joins those
records with the checkpoints the directory holds now (:func:`trainstate.history`); ``plot.py`` draws them
(:func:`trainstate.plot_history`, ``trainstate history --plot``), importing matplotlib only when called.

Nothing in the manager reads the history: resuming, retention and "newest" depend on manifests alone, so a
lost, torn or edited record can change what ``trainstate history`` shows, never what a run does.
"""
