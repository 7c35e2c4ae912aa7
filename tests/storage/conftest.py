"""Backends for the storage conformance suite: the local disk, fsspec's memory://, S3 over HTTP, and
user wrappers around them.

S3 is a real moto server process on 127.0.0.1 (started once per session, only when an s3 test runs),
reached through s3fs exactly as a user would reach AWS: no client is patched. ``wrapped-*`` backends are
a Storage subclass that forwards every call and the capabilities to the backend it wraps (wrapping.py);
``forgetful-*`` ones forward every call but not the capabilities, so they get the conservative defaults.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tools.s3_server import AWS_ISOLATION, S3_KEY, S3_REGION, S3_SECRET, MotoServer  # noqa: F401 (re-exported)

from trainstate._storage import LocalStorage, Storage

from .wrapping import Forwarding, Wrapping

BACKENDS = ("local", "memory", "s3", "wrapped-local", "wrapped-s3", "forgetful-local", "forgetful-memory")
_WRAPPERS: dict[str, Callable[[Storage], Storage]] = {"wrapped": Wrapping, "forgetful": Forwarding}
BUCKET = "trainstate-conformance"


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    mp = pytest.MonkeyPatch()
    for k, v in AWS_ISOLATION.items():
        mp.setenv(k, v)
    try:
        with MotoServer(tmp_path_factory.mktemp("moto") / "server.log") as server:
            server.create_bucket(BUCKET)
            yield server
    finally:
        mp.undo()


@dataclass
class Backend:
    """One place to put checkpoints: ``root`` is a path or URL, ``storage`` the backend to pass."""

    kind: str  # what is underneath: "local", "memory" or "s3"
    root: str
    storage: Storage
    fs: Any = None  # the fsspec filesystem under a remote storage
    wrap: Callable[[Storage], Storage] = lambda storage: storage  # wraps another storage as this one is
    wrapper: str = ""  # "", "wrapped" (forwards the capabilities) or "forgetful" (does not)

    def url(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def native(self, url: str) -> str:
        """A URL in the storage's own terms (a local path, or the fsspec path without protocol)."""
        return self.storage.strip(url)

    def listdir(self, url: str) -> list[str]:
        """What is really there, asked of the backend directly (not through trainstate)."""
        if self.kind == "local":
            return sorted(os.listdir(url)) if os.path.isdir(url) else []
        path = self.native(url)
        if not self.fs.exists(path):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False, refresh=True))

    def read_bytes(self, url: str) -> bytes:
        if self.kind == "local":
            return Path(url).read_bytes()
        return bytes(self.fs.cat_file(self.native(url)))

    def write_bytes(self, url: str, data: bytes) -> None:
        """Replace a file's content (for an object store: PUT the whole object again)."""
        if self.kind == "local":
            Path(url).write_bytes(data)
        else:
            self.fs.pipe_file(self.native(url), data)

    def remove(self, url: str) -> None:
        if self.kind == "local":
            os.remove(url)
        else:
            self.fs.rm(self.native(url))

    def exists(self, url: str) -> bool:
        return os.path.exists(url) if self.kind == "local" else bool(self.fs.exists(self.native(url)))


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    from trainstate._storage.fsspec import FsspecStorage

    wrapper, _, kind = request.param.rpartition("-")
    wrap = _WRAPPERS.get(wrapper, lambda storage: storage)
    unique = uuid.uuid4().hex[:12]
    if kind == "local":
        yield Backend(kind, str(tmp_path / "ckpts"), wrap(LocalStorage()), None, wrap, wrapper)
    elif kind == "memory":
        pytest.importorskip("fsspec")
        root = f"memory://trainstate-{unique}"
        storage = FsspecStorage.from_url(root)
        yield Backend(kind, root, wrap(storage), storage.fs, wrap, wrapper)
        if storage.fs.exists(storage.strip(root)):  # the memory store is process-wide
            storage.fs.rm(storage.strip(root), recursive=True)
    else:
        server: MotoServer = request.getfixturevalue("moto_server")
        fs = server.filesystem()
        yield Backend(kind, f"s3://{BUCKET}/{unique}", wrap(FsspecStorage(fs)), fs, wrap, wrapper)
