"""trainstate's version, in one place: the package exports it, and every manifest names its writer with it."""

from __future__ import annotations

VERSION = "0.1.0"  # as pyproject.toml's [project] version
