"""Checksums: the GIL-free path for large blocks gives the same digests; malformed checksum strings."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

import trainstate
from trainstate import _checksum as checksum


@pytest.mark.parametrize("size", [0, 1, (64 << 10) - 1, 64 << 10, (64 << 10) + 1, 3 << 20])
def test_digests_are_xxh3_64_on_both_sides_of_the_unlocked_threshold(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    for block in (memoryview(data), data.tobytes(), bytearray(data.tobytes())):
        assert checksum.value_of(block) == xxhash.xxh3_64_intdigest(block)
        assert checksum.digest(block) == "xxh3_64:" + xxhash.xxh3_64_hexdigest(block)


@pytest.mark.parametrize("bad", ["xxh3_64:XYZ", "xxh3_64:" + "0" * 15, "md5:" + "0" * 16, "nonsense"])
def test_a_malformed_checksum_string_is_a_corrupt_checkpoint(bad):
    with pytest.raises(trainstate.CorruptCheckpointError, match="checksum"):
        checksum.check(b"abc", bad, "tensor x")
