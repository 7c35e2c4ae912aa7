"""A key check that does not match: another key, or a damaged manifest? One chunk tells.

An encrypted manifest's key check (docs/format.md §12.3) is derived from the key and the manifest's salt,
so a wrong key and a salt or key check altered by one flipped byte look alike. They must not be treated
alike: a wrong key is the user's argument (``WrongKeyError``: a manager refuses to start rather than resume
from an older checkpoint, or from nothing, and save over the checkpoints it cannot read), while damage is
skipped like any damage (``TamperedCheckpointError``: a manager falls back to the checkpoint before it).

The chunk key is derived from the key alone, with no per-checkpoint salt (§12.1), so the checkpoint's own
chunks settle it: if one decrypts with the key given (its AES-GCM tag verifies, with its place as
associated data), the key is the one that wrote the checkpoint, and the manifest was altered after. Only a
few small chunks are tried, and only on this error path; the unauthenticated manifest is used only to find
them (validated like any manifest), and nothing read is returned.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from trainstate._format import manifest
from trainstate._incremental import pool
from trainstate._keys import Key
from trainstate._storage import Storage
from trainstate._transforms import Place
from trainstate._transforms.aes_gcm import NAME, AesGcm
from trainstate.errors import CheckpointError, TamperedCheckpointError, WrongKeyError

TRIES = 3  # chunks tried before the key is called wrong
MAX_TRY_BYTES = 16 << 20  # a larger chunk is not read for this


def diagnose(
    storage: Storage, path: str, what: str, raw: bytes | bytearray, key: Key, error: WrongKeyError
) -> CheckpointError:
    """``error``, or a TamperedCheckpointError when a chunk of the checkpoint at ``path`` decrypts with ``key``."""
    decoder = AesGcm(key)
    for name, place, params, location, begin, end in _candidates(storage, path, raw):
        stored = bytearray(end - begin)
        try:
            if storage.read_into(location, begin, memoryview(stored)) != len(stored):
                continue
            decoder.decode(memoryview(stored), params, place, 0)
        except Exception:  # noqa: BLE001 - any failure to decrypt leaves the key check's verdict standing
            continue
        return TamperedCheckpointError(
            f"{what}: its key check does not match the key given, yet tensor {name!r:.80} of the checkpoint decrypts "
            "with that key (its AES-GCM tag verifies): the key is right, and the manifest's salt or key check was "
            "altered or damaged after it was written. Restore another checkpoint"
        )
    return error


def _candidates(
    storage: Storage, path: str, raw: bytes | bytearray
) -> Iterator[tuple[str, Place, dict[str, object], str, int, int]]:
    """Up to TRIES encrypted chunks the manifest names, each as (tensor, place, its aes-256-gcm object,
    where its file is, byte range), once the manifest and the file passed the checks any reader makes."""
    try:
        body = json.loads(raw)
        body.pop("checksum", None)
        with manifest.malformed(what=manifest.MANIFEST_NAME):
            m = manifest._build(body)
        where = pool.locations(storage, path, m.files)
        sizes = {f.path: f.size for f in m.files}
        names = list(m.tensors)
    except Exception:  # noqa: BLE001 - a manifest that does not even validate names no chunk to try
        return
    tries = 0
    for name in names:
        try:
            t = m.tensors[name]
        except CheckpointError:
            continue
        for c in t.chunks:
            params = c.transforms[-1] if c.transforms else None
            begin, end = c.byte_range
            if not isinstance(params, dict) or params.get("name") != NAME or end - begin > MAX_TRY_BYTES:
                continue
            location = where.get(c.file) or storage.join(path, c.file)
            info = storage.stat(location)
            if info is None or not info.regular or info.is_dir or info.size != sizes.get(c.file):
                continue
            yield name, Place(name, t.dtype, c.offset, c.shape), params, location, begin, end
            tries += 1
            if tries == TRIES:
                return
