"""Storage backend conformance tests (a package, so this conftest does not shadow tests/conftest.py)."""
