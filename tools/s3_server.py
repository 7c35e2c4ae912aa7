"""A real S3-compatible server for tests and benchmarks: moto's standalone server on 127.0.0.1.

Reached through s3fs over HTTP exactly as a user reaches AWS; nothing is patched. Only loopback is used.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

S3_KEY, S3_SECRET, S3_REGION = "testing", "testing", "us-east-1"
# Never let boto look for credentials or regions anywhere real (files, instance metadata).
AWS_ISOLATION = {
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
        env = {
            **os.environ,
            **AWS_ISOLATION,
            "AWS_ACCESS_KEY_ID": S3_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_DEFAULT_REGION": S3_REGION,
        }
        out = open(self._log, "wb") if self._log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
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

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            region_name=S3_REGION,
        )
        client.create_bucket(Bucket=name)

    def filesystem(self, **kwargs: Any) -> Any:
        import s3fs

        return s3fs.S3FileSystem(
            key=S3_KEY, secret=S3_SECRET, endpoint_url=self.endpoint, client_kwargs={"region_name": S3_REGION}, **kwargs
        )
