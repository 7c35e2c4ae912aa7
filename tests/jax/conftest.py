"""tests/jax runs only where JAX is installed.

``tests/`` is on ``sys.path`` (pyproject's ``pythonpath``), so where JAX is not installed ``import jax`` finds
this folder as a namespace package: ``pytest.importorskip("jax")`` would import it instead of skipping, and
trainstate, seeing ``jax`` in ``sys.modules``, would take it for JAX in every later test. So the folder is
not collected at all unless a real JAX package is found.
"""

from __future__ import annotations

import importlib.util

_spec = importlib.util.find_spec("jax")
if _spec is None or _spec.origin is None:  # no JAX, or only this folder as a namespace package
    collect_ignore_glob = ["test_*.py"]
