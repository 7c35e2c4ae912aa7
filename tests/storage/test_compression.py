"""Compressed saves on every kind of store: local disks stream each data file and write its header last;
stores that cannot rewrite part of a file (S3, memory://, a wrapper that forgets the capability or the
method) hold one file's chunks until its header is known. Both give the same checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest

import trainstate
from helpers import assert_same

from .conftest import Backend

pytest.importorskip("zstandard")


@pytest.mark.parametrize("backend", ["local", "memory", "s3", "wrapped-local", "forgetful-local"], indirect=True)
def test_a_compressed_save_round_trips_on_every_store(backend: Backend) -> None:
    from safetensors.numpy import load as safetensors_load

    state = {"w": (np.arange(300_000, dtype=np.float32) % 3).reshape(300, 1000), "noise": np.arange(50.0)}
    url = backend.url("c")
    trainstate.save(url, state, storage=backend.storage, compression="zstd")
    assert_same(trainstate.load(url, storage=backend.storage), state)
    with trainstate.open(url, storage=backend.storage) as ck:
        ck.verify()
        assert ck.manifest.tensors["w"].chunks[0].transforms[0]["name"] == "zstd"
        files = [f.path for f in ck.manifest.files]
    streamed = backend.kind == "local" and backend.wrapper == ""  # "wrapped": forwards rewrite=True, not the method
    for name in files:
        raw = backend.read_bytes(backend.url("c", name))
        n = int.from_bytes(raw[:8], "little")
        header = raw[8 : 8 + n]
        json.loads(header)
        # Streamed: the header was written into room reserved before the data. Held (or written again by the
        # wrapper that forwards the capability but not the method): exactly as long as it needs to be.
        assert (len(header) - len(header.rstrip(b" ")) >= 8) == streamed
        safetensors_load(raw)  # any safetensors reader opens it
