"""The on-disk format: manifest, data files, dtypes and checksums. docs/format.md is the spec."""
