"""Every state a local disk may be left in by a crash during a recorded piece of work.

The model (ext4 in its default ``data=ordered`` mode allows each of these states, and the model allows more:
where ext4 orders things, the model does not rely on it):

* **Namespace operations** (create, mkdir, rename, exchange, unlink, rmdir) are durable once every directory they
  touch was fsynced after them. Before that they are *volatile*: a crash keeps them in program order up to some
  point and loses the rest (a journal commits in order), or, reordered, loses one rename while keeping what
  came after it. (ext4 commits every earlier namespace operation at any fsync; this model waits for the
  directory's own.)
* **File data** written since the file's last fsync is volatile. A crash keeps all of it; or drops it back to
  what the last fsync saw (nothing, for a file never fsynced); or keeps the file's bytes up to where it ended
  before its first such write; or keeps a prefix of its writes since then: the first *j* whole, and the next
  one's first half (a torn write); or keeps its last write and loses the earlier ones (pages written back out
  of order: what they covered reads as before them, or as zeros past the old end).
* Everything before the work began (:attr:`Recorder.before`) is durable.

For each crash point (after each operation, and before the first) :func:`crash_states` yields the distinct
directory trees these rules allow: everything kept; the volatile data dropped; each suffix of the volatile
namespace operations lost (with the data kept, then dropped); each volatile rename lost alone; each file's
volatile writes cut short, torn or reordered as above, one file at a time.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .record import Image, Op

NAMESPACE = frozenset({"create", "mkdir", "rename", "exchange", "link", "unlink", "rmdir"})


def _parent(path: str) -> str:
    return os.path.dirname(path) or "."


def _touches(op: Op) -> set[str]:
    """The directories whose fsync makes ``op`` durable."""
    dirs = {_parent(op.path)}
    if op.path2:
        dirs.add(_parent(op.path2))
    return dirs


@dataclass
class _FS:
    """An in-memory tree: paths to inodes, inodes' bytes and the bytes their last fsync saw."""

    dirs: set[str] = field(default_factory=set)
    names: dict[str, int] = field(default_factory=dict)
    data: dict[int, bytearray] = field(default_factory=dict)
    synced: dict[int, bytes] = field(default_factory=dict)
    first_unsynced: dict[int, int] = field(default_factory=dict)  # inode -> file length before its first
    # write since the last fsync (where a cut-short file ends)
    writes: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)  # inode -> (offset, bytes) of
    # each write since its last fsync; absent for a file truncated since then (its partial states not made)
    truncated: set[int] = field(default_factory=set)  # inodes truncated since their last fsync
    next_inode: int = 0

    @classmethod
    def of(cls, image: Image) -> _FS:
        fs = cls(dirs=set(image.dirs))
        for path, content in image.files.items():
            fs.names[path] = fs._new(content)
            fs.synced[fs.names[path]] = content
        return fs

    def _new(self, content: bytes = b"") -> int:
        self.next_inode += 1
        self.data[self.next_inode] = bytearray(content)
        return self.next_inode

    def apply(self, op: Op) -> None:
        """Apply ``op`` as the running system did; one that cannot apply (its source lost) is lost too."""
        k = op.kind
        if k == "mkdir":
            self.dirs.add(op.path)
        elif k == "create":
            if op.path not in self.names:
                self.names[op.path] = self._new()
                self.synced[self.names[op.path]] = b""
        elif k == "write":
            inode = self.names.get(op.path)
            if inode is not None:
                buf = self.data[inode]
                self.first_unsynced.setdefault(inode, len(buf))
                if inode in self.writes or inode not in self.truncated:
                    self.writes.setdefault(inode, []).append((op.offset, op.data))
                if len(buf) < op.offset:
                    buf.extend(b"\0" * (op.offset - len(buf)))
                buf[op.offset : op.offset + len(op.data)] = op.data
        elif k == "truncate":
            inode = self.names.get(op.path)
            if inode is not None:
                self.first_unsynced.setdefault(inode, len(self.data[inode]))
                del self.data[inode][op.size :]
                self.writes.pop(inode, None)
                self.truncated.add(inode)
        elif k == "fsync":
            inode = self.names.get(op.path)
            if inode is not None:
                self.synced[inode] = bytes(self.data[inode])
                self.first_unsynced.pop(inode, None)
                self.writes.pop(inode, None)
                self.truncated.discard(inode)
        elif k == "rename":
            self._rename(op.path, op.path2)
        elif k == "exchange":
            a, b = self._take(op.path), self._take(op.path2)
            self._put(op.path2, a, op.path)
            self._put(op.path, b, op.path2)
        elif k == "link":
            inode = self.names.get(op.path)
            if inode is not None:
                self.names[op.path2] = inode
        elif k == "unlink":
            self.names.pop(op.path, None)
        elif k == "rmdir":
            if not any(p.startswith(op.path + "/") for p in [*self.names, *self.dirs]):
                self.dirs.discard(op.path)

    def _take(self, path: str) -> tuple[dict[str, int], set[str]]:
        """Everything at ``path`` (a file, or a directory and all under it), removed from the tree."""
        files = {p: i for p, i in self.names.items() if p == path or p.startswith(path + "/")}
        dirs = {d for d in self.dirs if d == path or d.startswith(path + "/")}
        for p in files:
            del self.names[p]
        self.dirs -= dirs
        return files, dirs

    def _put(self, path: str, taken: tuple[dict[str, int], set[str]], old: str) -> None:
        """What :meth:`_take` took from ``old``, put at ``path``."""
        files, dirs = taken
        for p, i in files.items():
            self.names[path + p[len(old) :]] = i
        self.dirs |= {path + d[len(old) :] for d in dirs}

    def _rename(self, src: str, dst: str) -> None:
        taken = self._take(src)
        if not taken[0] and not taken[1]:
            return  # its source was lost: the rename is lost too
        self._take(dst)  # a rename replaces what was there (an empty directory, or a file)
        self._put(dst, taken, src)

    def partial(self, inode: int, writes: list[tuple[int, bytes]]) -> Image:
        """The tree with everything kept but ``inode``, which holds what its last fsync saw and then ``writes``
        (a file extended past its end reads zeros in between)."""
        content = bytearray(self.synced.get(inode, b""))
        for offset, data in writes:
            if len(content) < offset:
                content.extend(b"\0" * (offset - len(content)))
            content[offset : offset + len(data)] = data
        image = self.image(drop=False)
        for path, i in self.names.items():
            if i == inode and path in image.files:
                image.files[path] = bytes(content)
        return image

    def image(self, drop: bool, cut: int | None = None) -> Image:
        """The tree: each file's bytes, or (``drop``) what its last fsync saw; ``cut``: that inode ends where
        it ended before its first write since the last fsync. A directory whose own entry was lost takes what
        is under it along."""
        files = {}
        dirs = {d for d in self.dirs if self._reachable(d)}
        for path, inode in self.names.items():
            if not self._reachable(_parent(path)):
                continue
            content = self.synced.get(inode, b"") if drop else bytes(self.data[inode])
            if cut == inode:
                content = bytes(self.data[inode][: self.first_unsynced.get(inode, len(self.data[inode]))])
            files[path] = content
        return Image(dirs, files)

    def _reachable(self, directory: str) -> bool:
        """Whether ``directory`` and every directory above it are there (``.``, the root, always is)."""
        while directory not in (".", ""):
            if directory not in self.dirs:
                return False
            directory = _parent(directory)
        return True


def _build(before: Image, ops: list[Op], lost: set[int]) -> _FS:
    fs = _FS.of(before)
    for i, op in enumerate(ops):
        if i not in lost:
            fs.apply(op)
    return fs


def _volatile(ops: list[Op]) -> list[int]:
    """The namespace operations of ``ops`` not yet made durable by an fsync of every directory they touch."""
    pending: dict[int, set[str]] = {}
    for i, op in enumerate(ops):
        if op.kind in NAMESPACE:
            pending[i] = _touches(op)
        elif op.kind == "fsync":
            for dirs in pending.values():
                dirs.discard(op.path)
            pending = {i: d for i, d in pending.items() if d}
    return sorted(pending)


def replayed(before: Image, ops: list[Op]) -> Image:
    """The tree ``ops`` leave when every one of them lands: what the work left, if nothing was missed."""
    return _build(before, ops, set()).image(drop=False)


def digest(image: Image) -> str:
    h = hashlib.sha256()
    for d in sorted(image.dirs):
        h.update(b"d" + d.encode() + b"\0")
    for p in sorted(image.files):
        h.update(b"f" + p.encode() + b"\0" + hashlib.sha256(image.files[p]).digest())
    return h.hexdigest()


def _variants(before: Image, prefix: list[Op]) -> Iterator[tuple[str, Image]]:
    """The trees a crash right after ``prefix`` may leave (some of them alike)."""
    volatile = _volatile(prefix)
    full = _build(before, prefix, set())
    yield "all kept", full.image(drop=False)
    yield "unsynced data dropped", full.image(drop=True)
    for inode in sorted(full.first_unsynced):
        name = next((p for p, i in full.names.items() if i == inode), f"inode {inode}")
        yield f"{name} cut where it ended at its last fsync", full.image(drop=False, cut=inode)
        writes = full.writes.get(inode, [])
        yield f"{name}: its unsynced writes lost", full.partial(inode, [])
        for j, (offset, data) in enumerate(writes):
            if j:
                yield f"{name}: its first {j} unsynced writes only", full.partial(inode, writes[:j])
            yield (
                f"{name}: write {j + 1} of {len(writes)} torn",
                full.partial(inode, [*writes[:j], (offset, data[: len(data) // 2])]),
            )
        if len(writes) > 1:
            yield f"{name}: its last unsynced write only", full.partial(inode, writes[-1:])
    for j in range(1, len(volatile) + 1):
        fs = _build(before, prefix, set(volatile[-j:]))
        yield f"last {j} namespace ops lost", fs.image(drop=False)
        yield f"last {j} namespace ops and unsynced data lost", fs.image(drop=True)
    for i in volatile:
        if prefix[i].kind in ("rename", "exchange"):
            yield f"{prefix[i].kind} of {prefix[i].path} lost alone", _build(before, prefix, {i}).image(drop=False)


def states_after(before: Image, ops: list[Op]) -> Iterator[tuple[str, Image]]:
    """(how the state was made, the tree) for a crash right after ``ops``, each tree once."""
    seen: set[str] = set()
    for how, image in _variants(before, ops):
        key = digest(image)
        if key not in seen:
            seen.add(key)
            yield how, image


def crash_states(before: Image, ops: list[Op]) -> Iterator[tuple[int, str, Image]]:
    """(crash point: the number of operations that ran, how the state was made, the tree), each tree once per
    crash point."""
    for k in range(len(ops) + 1):
        for how, image in states_after(before, ops[:k]):
            yield k, how, image


def materialize(image: Image, root: Path) -> None:
    """Write ``image`` into the empty directory ``root``."""
    for d in sorted(image.dirs, key=len):
        (root / d).mkdir(parents=True, exist_ok=True)
    for path, content in image.files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
