"""An object store whose requests are recorded, and every state a crash may leave it in.

:class:`ObjectStore` is an fsspec filesystem (what :class:`trainstate.FsspecStorage` drives for ``s3://``)
holding its objects in memory with S3's semantics: a key's bytes appear at once, whole, when its upload
completes; a large upload goes as a multipart upload (create, parts of ``block_size``, complete: nothing is
visible before the complete); a delete removes one key; "directories" are only key prefixes. Every request is
recorded as a :class:`Request` with the moment it was sent and the moment it returned (one counter for the
whole store, so the background uploads' requests interleave as they ran).

The model (:func:`crash_states`): a request that returned before the crash took effect; one that was sent and
had not returned may have taken effect or not, each independently (a PUT is atomic: its object is there whole
or not at all); one not yet sent did not. Multipart steps before the complete change nothing visible. So for a
crash after each event (a request sent, a request returned, a mark) the states are: the requests returned,
plus every subset of the requests in flight that change objects.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem  # type: ignore[import-untyped]

VISIBLE = frozenset({"put", "complete", "delete"})  # the requests that change what a reader sees


@dataclass
class Request:
    """One request: put (a single-request upload), create / part / complete (a multipart upload's steps),
    or delete; ``data`` is the object's bytes for put and complete."""

    kind: str
    key: str
    sent: int
    returned: int = -1  # -1: still in flight
    data: bytes = b""


@dataclass
class Log:
    """The requests in the order they were sent, the counter, and the workload's marks (counter value, label)."""

    requests: list[Request] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)
    clock: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tick(self) -> int:
        with self.lock:
            self.clock += 1
            return self.clock

    def mark(self, label: str) -> None:
        self.marks.append((self.tick(), label))


class ObjectStore(AbstractFileSystem):  # type: ignore[misc]
    """Objects in memory, S3's semantics, requests recorded into ``log`` (None: not recorded)."""

    protocol = "crashobj"
    root_marker = ""
    cachable = False  # each store its own objects

    def __init__(
        self, objects: dict[str, bytes] | None = None, log: Log | None = None, latency: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.objects: dict[str, bytes] = dict(objects or {})
        self.mtimes: dict[str, float] = dict.fromkeys(self.objects, time.time())
        self.log = log
        self.latency = latency  # seconds each request takes, half before it takes effect: uploads overlap
        self._lock = threading.Lock()

    # -- requests -----------------------------------------------------------------------------------

    def request(self, kind: str, key: str, data: bytes = b"") -> None:
        """Send one request, apply it, and return (each step recorded)."""
        entry = Request(kind, key, self.log.tick(), data=data) if self.log is not None else None
        if entry is not None:
            with self.log.lock:  # type: ignore[union-attr]
                self.log.requests.append(entry)  # type: ignore[union-attr]
        time.sleep(self.latency / 2)
        with self._lock:
            if kind in ("put", "complete"):
                self.objects[key] = data
                self.mtimes[key] = time.time()
            elif kind == "delete":
                self.objects.pop(key, None)
                self.mtimes.pop(key, None)
        time.sleep(self.latency / 2)
        if entry is not None:
            entry.returned = self.log.tick()  # type: ignore[union-attr]

    # -- fsspec's interface -----------------------------------------------------------------------

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("crashobj://"):
            path = path[len("crashobj://") :]
        return path.strip("/")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        if path in self.objects:
            out = [self.info(path)]
        else:
            prefix = path + "/" if path else ""
            with self._lock:
                keys = [k for k in self.objects if k.startswith(prefix)]
            children = sorted({prefix + k[len(prefix) :].split("/", 1)[0] for k in keys})
            if not children and path:
                raise FileNotFoundError(path)
            out = [self.info(c) for c in children]
        return out if detail else [e["name"] for e in out]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        with self._lock:
            if path in self.objects:
                return {"name": path, "size": len(self.objects[path]), "type": "file", "mtime": self.mtimes[path]}
            if not path or any(k.startswith(path + "/") for k in self.objects):
                return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        with self._lock:
            if path not in self.objects:
                raise FileNotFoundError(path)
            return self.objects[path][start:end]

    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        if path not in self.objects:
            raise FileNotFoundError(path)
        self.request("delete", path)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rmdir(self, path: str) -> None:
        pass  # prefixes are not objects

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        pass

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        pass

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "r" in mode:
            return io.BytesIO(self.cat_file(path))
        return _Upload(self, path, mode, block_size=block_size or 5 << 20)


class _Upload(AbstractBufferedFile):  # type: ignore[misc]
    """A write: one PUT at close when it fits one block, else a multipart upload (as s3fs does)."""

    def _initiate_upload(self) -> None:
        if self.forced and self.buffer.tell() < self.blocksize:
            return  # small: one PUT at close
        self.fs.request("create", self.path)
        self._parts: list[bytes] = []

    def _upload_chunk(self, final: bool = False) -> bool:
        data = self.buffer.getvalue()
        parts = getattr(self, "_parts", None)
        if parts is None:  # one PUT
            if final:
                self.fs.request("put", self.path, data)
            return final
        if data:
            self.fs.request("part", self.path)
            parts.append(data)
        if final:
            self.fs.request("complete", self.path, b"".join(parts))
        return True


def crash_states(
    before: dict[str, bytes], log: Log, *, most_in_flight: int = 10
) -> Iterator[tuple[int, str, dict[str, bytes]]]:
    """(crash point: the counter value, how the state was made, the objects), each distinct state once per crash
    point. With more than ``most_in_flight`` requests in flight at one point, not every subset of them is tried:
    none, each one alone, all but each one, and all (the label says so)."""
    events = sorted({r.sent for r in log.requests} | {r.returned for r in log.requests} | {at for at, _ in log.marks})
    for t in [0, *events]:
        done = [r for r in log.requests if 0 <= r.returned <= t]
        flying = [r for r in log.requests if r.sent <= t and not 0 <= r.returned <= t and r.kind in VISIBLE]
        n = len(flying)
        if n <= most_in_flight:
            subsets: Iterator[tuple[Request, ...]] = itertools.chain.from_iterable(
                itertools.combinations(flying, k) for k in range(n + 1)
            )
        else:
            subsets = itertools.chain(
                [()], ((r,) for r in flying), (tuple(x for x in flying if x is not r) for r in flying), [tuple(flying)]
            )
        seen: set[tuple[tuple[str, bytes], ...]] = set()
        for landed in subsets:
            taken = sorted([*done, *landed], key=lambda r: r.returned if r.returned >= 0 else 1 << 62)
            objects = dict(before)
            for r in taken:
                if r.kind == "delete":
                    objects.pop(r.key, None)
                elif r.kind in ("put", "complete"):
                    objects[r.key] = r.data
            key = tuple(sorted(objects.items()))
            if key not in seen:
                seen.add(key)
                how = "returned requests" + (f" + {len(landed)} of {n} in flight" if n else "")
                yield t, how + (" (subsets sampled)" if n > most_in_flight else ""), objects


def digest(objects: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for key in sorted(objects):
        h.update(key.encode() + b"\0" + hashlib.sha256(objects[key]).digest())
    return h.hexdigest()
