"""The encrypted checkpoint ``tests/fixtures/v1.3-encrypted/basic``, written from docs/format.md §12.

It is built here chunk by chunk (one chunk per tensor, each encrypted with the ``aes-256-gcm`` transform,
listed as ``U8`` in the data file's header as §2 asks of transformed bytes), not by ``trainstate.save``, so
it pins the format independently of the writer's chunking. Nonces and the manifest's salt are derived from
the tensor names instead of drawn at random, so running this again gives the same bytes
(``test_encrypted_fixture.py`` checks that). Regenerate with ``python tests/format/make_encrypted_fixture.py``.

The key is a TEST key, public in this repository: never use it for real data.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import ml_dtypes
import numpy as np

FIXTURE = Path(__file__).parent.parent / "fixtures" / "v1.3-encrypted" / "basic"
TEST_KEY = bytes(range(32))  # 000102...1f: a TEST key, public in this repository
METADATA = {"run": "encrypted-fixture"}
CREATED = 1_800_000_000.0


def fixture_state() -> dict[str, Any]:
    """The state in the fixture: two dtypes, a 0-d array, a NumPy scalar, an empty array, plain values."""
    return {
        "model": {
            "w": np.arange(12, dtype=np.float32).reshape(3, 4),
            "b": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
        },
        "step": 7,
        "name": "enc",
        "scale": np.float16(1024.0),
        "empty": np.zeros((0, 3), dtype=np.int8),
        "counts": np.array([3, 1, 4, 1, 5], dtype=np.int64),
    }


def _deterministic(seed: bytes) -> Any:
    """An ``os.urandom`` stand-in that derives its bytes from ``seed`` and a call counter."""
    calls = [0]

    def urandom(n: int) -> bytes:
        calls[0] += 1
        return hashlib.sha256(seed + calls[0].to_bytes(4, "little")).digest()[:n]

    return urandom


def write(path: Path) -> None:
    from trainstate import _checksum as checksum
    from trainstate._format import datafile, manifest
    from trainstate._keys import Key
    from trainstate._save.encode import encode_state
    from trainstate._transforms import Place
    from trainstate._transforms.aes_gcm import AesGcm

    key = Key(TEST_KEY)
    snapshot = encode_state(fixture_state(), METADATA)
    stored: list[bytes] = []
    params: list[dict[str, Any]] = []
    with mock.patch("trainstate._transforms.aes_gcm.os.urandom", _deterministic(b"fixture nonces")):
        for e in snapshot.entries:
            place = Place(e.name, e.dtype, (0,) * len(e.shape), e.shape)
            data, p = AesGcm(key).encode(memoryview(e.adapter.byte_view(e.value)), place)
            stored.append(data)
            params.append(p)
    name = "data-00000.safetensors"
    header, offsets = datafile.build_header(
        [datafile.HeaderEntry(e.name, "U8", (len(s),), len(s)) for e, s in zip(snapshot.entries, stored)],
        {"format": "trainstate"},
    )
    body = header + b"".join(stored)
    tensors = {
        e.name: manifest.TensorEntry(
            e.dtype,
            e.shape,
            e.kind,
            (manifest.Chunk(name, (o, o + len(s)), (0,) * len(e.shape), e.shape, checksum.digest(s), (p,), None),),
        )
        for e, s, p, o in zip(snapshot.entries, stored, params, offsets)
    }
    m = manifest.Manifest(
        tree=snapshot.tree,
        tensors=tensors,
        files=(manifest.FileEntry(name, len(body), checksum.digest(header)),),
        metadata=snapshot.metadata,
        created=CREATED,
        writer="trainstate 0.1.0 (tests/format/make_encrypted_fixture.py)",
    )
    with mock.patch("trainstate._format.manifest_mac.os.urandom", _deterministic(b"fixture salt")):
        raw = m.to_json_bytes(key)
    path.mkdir(parents=True)
    (path / name).write_bytes(body)
    (path / manifest.MANIFEST_NAME).write_bytes(raw)


if __name__ == "__main__":
    shutil.rmtree(FIXTURE, ignore_errors=True)
    write(FIXTURE)
    print("wrote", FIXTURE)
