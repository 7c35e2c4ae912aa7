"""Optional dependencies: the one place a missing one becomes a MissingDependencyError naming its extra.

torch, fsspec and scikit-learn are imported only where a feature needs them. Each of those imports sits
in an ``optional(...)`` block, so whoever uses a feature without its extra gets one message that says
what needed what and which ``pip install`` fixes it, never a bare ``No module named 'torch'`` from
deep inside trainstate::

    with optional("torch", extra="torch", needed_for="trainstate._data"):
        import torch
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from trainstate.errors import MissingDependencyError


def missing(package: str, *, extra: str, needed_for: str, reason: str = "") -> MissingDependencyError:
    """The error for ``package`` not being importable; ``reason`` is what the import said, if anything."""
    said = f" ({reason})" if reason else ""
    return MissingDependencyError(
        f'{needed_for} needs {package}, which cannot be imported{said}: pip install "trainstate[{extra}]"'
    )


@contextmanager
def optional(package: str, *, extra: str, needed_for: str) -> Iterator[None]:
    """Turn an ImportError raised inside the block into :func:`missing`'s error (chained to it).

    A MissingDependencyError from a nested ``optional`` block passes through unchanged: the innermost
    block knows best what was missing.
    """
    try:
        yield
    except MissingDependencyError:
        raise
    except ImportError as e:
        raise missing(package, extra=extra, needed_for=needed_for, reason=str(e)) from e
