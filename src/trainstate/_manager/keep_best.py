"""keep_best's one warning: a metric no save of the run passes (a misspelt name keeps nothing as the best)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from trainstate._manager.catalog import Catalog
from trainstate._manager.policies import KeepBest, RetentionPolicy
from trainstate.errors import CheckpointError

log = logging.getLogger("trainstate")


def warn_missing_metrics(
    retention: Iterable[RetentionPolicy], warned: set[str], catalog: Catalog, step: int, metrics: dict[str, float]
) -> None:
    """Warn once per metric when a keep_best metric is missing from a save and no save of the run has passed
    it: a misspelt name (or a metric logged under another) would otherwise leave keep_best keeping nothing,
    silently. A save without it in a run that passes it elsewhere (evaluation less often than saves, the
    final save of ``close(step, state)``) is normal and says nothing. ``warned`` holds the metrics already
    settled (warned about, or seen), and is updated."""
    for policy in retention:
        if not isinstance(policy, KeepBest) or policy.metric in warned:
            continue
        warned.add(policy.metric)
        if policy.metric in metrics or _run_has(catalog, policy.metric):
            continue  # the run passes it: never a warning for it
        log.warning(
            "keep_best ranks checkpoints by %r, but the save of step %d has no such metric (it has: %s), nor "
            "has any checkpoint of the run. A checkpoint without it is neither kept nor let go by keep_best "
            "(never counted as worse than the best); if the name is wrong, nothing is kept as the best: pass "
            "metrics={%r: value} to save() (or to close(step, state, metrics=...))",
            policy.metric,
            step,
            ", ".join(sorted(metrics)) or "none",
            policy.metric,
        )


def _run_has(catalog: Catalog, metric: str) -> bool:
    try:
        return any(metric in c.metrics for c in catalog.list())
    except CheckpointError:  # a listing that fails here fails where it matters too; warn meanwhile
        return False
