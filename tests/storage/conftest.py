"""Backends for the storage conformance suite: the local disk, fsspec's memory://, and S3 over HTTP.

S3 is a real moto server process on 127.0.0.1 (started once per session, only when an s3 test runs),
reached through s3fs exactly as a user would reach AWS: no client is patched.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainstate.storage import LocalStorage, Storage

BACKENDS = ("local", "memory", "s3")
S3_KEY, S3_SECRET, S3_REGION = "testing", "testing", "us-east-1"
BUCKET = "trainstate-conformance"

# Never let boto look for credentials or regions anywhere real (files, instance metadata).
_AWS_ISOLATION = {
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=0.5) as r:
            return bool(r.status)
    except urllib.error.HTTPError:
        return True  # it answered, if only with an error
    except OSError:
        return False


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 at a free port, for the duration of a ``with`` block."""

    def __init__(self, log: Path | None = None) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> MotoServer:
        env = {**os.environ, **_AWS_ISOLATION, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET,
               "AWS_DEFAULT_REGION": S3_REGION}
        out = open(self._log, "wb") if self._log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        finally:
            if self._log:
                out.close()  # the server holds its own copy
        deadline = time.monotonic() + 30
        while not _answers(self.endpoint + "/"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("moto server did not answer within 30 s")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def create_bucket(self, name: str) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_KEY,
                              aws_secret_access_key=S3_SECRET, region_name=S3_REGION)
        client.create_bucket(Bucket=name)

    def filesystem(self, **kwargs: Any) -> Any:
        import s3fs

        return s3fs.S3FileSystem(key=S3_KEY, secret=S3_SECRET, endpoint_url=self.endpoint,
                                 client_kwargs={"region_name": S3_REGION}, **kwargs)


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    mp = pytest.MonkeyPatch()
    for k, v in _AWS_ISOLATION.items():
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

    kind: str
    root: str
    storage: Storage
    fs: Any = None  # the fsspec filesystem under a remote storage

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
    from trainstate.storage.fsspec import FsspecStorage

    unique = uuid.uuid4().hex[:12]
    if request.param == "local":
        yield Backend("local", str(tmp_path / "ckpts"), LocalStorage())
    elif request.param == "memory":
        pytest.importorskip("fsspec")
        root = f"memory://trainstate-{unique}"
        storage = FsspecStorage.from_url(root)
        yield Backend("memory", root, storage, storage.fs)
        if storage.fs.exists(storage.strip(root)):  # the memory store is process-wide
            storage.fs.rm(storage.strip(root), recursive=True)
    else:
        server: MotoServer = request.getfixturevalue("moto_server")
        fs = server.filesystem()
        yield Backend("s3", f"s3://{BUCKET}/{unique}", FsspecStorage(fs), fs)
