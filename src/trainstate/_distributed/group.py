"""The coordination group: where the ranks of a collective save or load agree, apart from training.

Checkpoint coordination runs on a gloo group of its own, created once per process group (collectively,
the first time a rank saves or loads under it). The training loop's own collectives (NCCL on GPUs) never
wait behind a checkpoint's, and an async save's commit can run on a background thread. Every exchange
has a timeout: a rank that died or hangs makes the others raise :class:`DistributedError` instead of
waiting forever. Messages are small Python objects (plans, file lists, error texts) sent with torch's
object collectives. The one exchange of tensor bytes is a collective load's (``_restore/shared.py``): a tensor
read by one rank goes to the others that hold it, point to point (:meth:`GlooCoordinator.exchange`).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from trainstate.errors import DistributedError, InvalidArgumentError

log = logging.getLogger("trainstate")
DEFAULT_TIMEOUT = 600.0  # seconds; TRAINSTATE_DIST_TIMEOUT or timeout= overrides it
# How long the ranks wait for each other to come to a coordination group's creation (a rank that died before
# it never comes); TRAINSTATE_DIST_ARRIVAL_TIMEOUT overrides it, a smaller timeout= shortens it.
ARRIVAL_TIMEOUT = 60.0
HEARTBEAT = 1.0  # seconds between a rank's heartbeats, by which the others tell which rank is gone
_groups: dict[tuple[int, float, str], Any] = {}
# (channel, members) -> coordination groups made on it so far: the same count on every member
_arrivals: dict[tuple[str, str], int] = {}
_lock = threading.Lock()
_beating: int | None = None  # the pid whose heartbeat thread runs


@dataclass(frozen=True)
class Failure:
    """What a rank sends instead of its result when its own part failed."""

    rank: int
    message: str
    fatal: bool = False  # a user error to raise everywhere, not damage to step past


class Coordinator:
    """Rank, world size and the small-message exchanges of one group of processes; every method is collective.

    Two kinds: :class:`GlooCoordinator` under torch.distributed, and ``jax_group.KeyValueCoordinator`` under
    ``jax.distributed`` (the JAX runtime's key-value store). Both run apart from the training loop's own
    collectives and time out instead of waiting forever.
    """

    rank: int
    world: int
    timeout: float
    sends_bytes = False  # whether exchange() can move tensor bytes between the ranks

    def gather(self, value: Any, what: str) -> list[Any] | None:
        """Every rank's ``value`` on rank 0 (None elsewhere)."""
        raise NotImplementedError

    def broadcast(self, value: Any, what: str) -> Any:
        """Rank 0's ``value`` on every rank."""
        raise NotImplementedError

    def scatter(self, values: list[Any] | None, what: str) -> Any:
        """Rank 0's ``values[rank]`` on each rank."""
        raise NotImplementedError

    def all_gather(self, value: Any, what: str) -> list[Any]:
        raise NotImplementedError

    def max(self, values: list[int], what: str) -> list[int]:
        """The element-wise maximum of every rank's ``values``."""
        return [max(column) for column in zip(*self.all_gather(list(values), what))]

    def exchange(
        self, sends: list[tuple[memoryview, int, int]], receives: list[tuple[memoryview, int, int]], what: str
    ) -> None:
        """Send and receive flat bytes point to point: ``(bytes, peer rank, tag)`` each (a receive's bytes are
        filled in place), every one posted before any is waited for."""
        raise NotImplementedError

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed: the first failure's message, naming its rank."""
        mine = None if error is None else Failure(self.rank, _text(error))
        failures = [f for f in self.all_gather(mine, what) if f is not None]
        if error is not None:
            raise error
        if failures:
            f = failures[0]
            raise DistributedError(f"{what} failed on rank {f.rank} of {self.world}: {f.message}")


class GlooCoordinator(Coordinator):
    """The coordinator of a torch.distributed process group: a gloo group of its own per channel."""

    sends_bytes = True

    def __init__(self, group: Any, timeout: float, channel: str = "save") -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timeout
        self.group = _gloo_group(group, timeout, channel)

    def gather(self, value: Any, what: str) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._call(what, lambda: self.dist.gather_object(value, out, dst=self._global(0), group=self.group))
        return out

    def broadcast(self, value: Any, what: str) -> Any:
        box = [value if self.rank == 0 else None]
        self._call(what, lambda: self.dist.broadcast_object_list(box, src=self._global(0), group=self.group))
        return box[0]

    def scatter(self, values: list[Any] | None, what: str) -> Any:
        box: list[Any] = [None]
        self._call(
            what,
            lambda: self.dist.scatter_object_list(box, values, src=self._global(0), group=self.group),
        )
        return box[0]

    def all_gather(self, value: Any, what: str) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._call(what, lambda: self.dist.all_gather_object(out, value, group=self.group))
        return out

    def max(self, values: list[int], what: str) -> list[int]:
        """One small tensor all-reduced: cheaper than objects."""
        import torch

        box = torch.tensor(values, dtype=torch.int64)
        self._call(what, lambda: self.dist.all_reduce(box, op=self.dist.ReduceOp.MAX, group=self.group))
        return [int(v) for v in box.tolist()]

    def exchange(
        self, sends: list[tuple[memoryview, int, int]], receives: list[tuple[memoryview, int, int]], what: str
    ) -> None:
        """Bytes sent and received on the gloo group as CPU byte tensors over the same memory (all posted, then
        all waited for)."""
        dist = self.dist

        def run() -> None:
            works = [
                dist.irecv(_wire(v), src=self._global(peer), group=self.group, tag=tag) for v, peer, tag in receives
            ]
            works += [dist.isend(_wire(v), dst=self._global(peer), group=self.group, tag=tag) for v, peer, tag in sends]
            for work in works:
                work.wait(datetime.timedelta(seconds=self.timeout))

        self._call(what, run)

    def _global(self, rank: int) -> int:
        return int(self.dist.get_global_rank(self.group, rank))

    def _call(self, what: str, op: Any) -> None:
        try:
            op()
        except DistributedError:
            raise
        except Exception as e:  # noqa: BLE001 - gloo: a peer closed the connection (died), or timed out
            outcome = _outcome(what)
            if not self.dist.is_initialized() or "not registered" in str(e):
                raise DistributedError(
                    f"{what}: the process group was destroyed (dist.destroy_process_group()) while this call "
                    f"needed it; {outcome}. Close trainstate's CheckpointManager (leave its with "
                    "block, or mgr.close()) before destroying the group: an async save still in flight "
                    "commits there"
                ) from None
            gone = _gone([self._global(r) for r in range(self.world) if r != self.rank])
            if gone:
                raise DistributedError(
                    f"{what}: {_named(gone)} of {self.world} (global numbering) gone: its process died or left "
                    f"the process group (a rank that raised an error leaves too: the first error in the ranks' logs "
                    f"is the cause), so rank {self.rank} cannot go on without it; {outcome} "
                    f"({type(e).__name__}: {_first_line(e)})"
                ) from None
            raise DistributedError(
                f"{what}: rank {self.rank} of {self.world} lost contact with the other ranks ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else 'no message'}). A rank died or did not reach this "
                f"point within {self.timeout:g} s (timeout=, or TRAINSTATE_DIST_TIMEOUT); {outcome}"
            ) from None


def _wire(view: memoryview) -> Any:
    """A CPU uint8 tensor over ``view``'s memory, as gloo sends and receives."""
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(view, np.uint8))


def _outcome(what: str) -> str:
    """What a failed exchange left: a save commits nothing; a load may have restored part of the state."""
    if what.startswith("load"):
        return "the load did not complete (the state may be partly restored: load again)"
    return "nothing was committed"


def torch_world() -> Any:
    """torch.distributed's default process group, or None where none was made."""
    if "torch.distributed" not in sys.modules:  # nobody made a process group: no need to import torch
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD


def timeout_seconds(timeout: float | None) -> float:
    if timeout is None:
        raw = os.environ.get("TRAINSTATE_DIST_TIMEOUT")
        try:
            timeout = float(raw) if raw else DEFAULT_TIMEOUT
        except ValueError:
            raise InvalidArgumentError(f"TRAINSTATE_DIST_TIMEOUT must be seconds, got {raw!r:.40}") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e7:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r:.40}")
    return float(timeout)


def _gloo_group(group: Any, timeout: float, channel: str) -> Any:
    """A gloo group over ``group``'s ranks, made once (collectively) per group, timeout and channel."""
    import torch.distributed as dist

    key = (id(group), timeout, channel)
    with _lock:
        found = _groups.get(key)
        if found is None:
            ranks = sorted(dist.get_process_group_ranks(group))
            store = _store()
            if store is not None:
                _start_heartbeat(_liveness_store())
                _arrive(store, channel, ranks, min(timeout, arrival_timeout()))
            found = _new_group(ranks, timeout, channel)
            _groups[key] = found
        return found


def release(channel: str) -> None:
    """Destroy the gloo groups of ``channel`` and of the channels named after it (``channel-...``): a closed
    manager's. Each holds sockets and two threads, so a process that makes manager after manager would pile
    them up. Local: every rank destroys its own handle when its manager closes, after its last exchange on
    them returned; what it sent is already on the wire for a peer still reading it."""
    import torch.distributed as dist

    with _lock:
        keys = [k for k in _groups if k[2] == channel or k[2].startswith(channel + "-")]
        groups = [_groups.pop(k) for k in keys]
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - the default group already destroyed: nothing left to free
            log.debug("could not destroy trainstate's group of %s: %s", channel, e)


def _new_group(ranks: list[int], timeout: float, channel: str) -> Any:
    """``dist.new_group`` of ``ranks`` (gloo), watched: torch waits for a rank that died after it arrived for as
    long as the process group's store allows (30 minutes and more), so it runs on a thread of its own while
    this one checks the others' heartbeats and the timeout, and raises DistributedError naming a rank that is
    gone. (A call abandoned so stays blocked on its daemon thread; the job is failing then anyway.)"""
    import torch.distributed as dist

    done: dict[str, Any] = {}

    def make() -> None:
        try:
            done["group"] = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
            done["error"] = e

    thread = threading.Thread(target=make, name="trainstate-new-group", daemon=True)
    thread.start()
    others = [r for r in ranks if r != dist.get_rank()]
    deadline = time.monotonic() + timeout
    while True:
        thread.join(0.5)
        if not thread.is_alive() or time.monotonic() > deadline:
            break
        gone = _gone(others)  # about three heartbeats
        if gone:
            break
    if "group" in done:
        return done["group"]
    gone = _gone(others)
    error = done.get("error")
    if gone:
        why = f"{_named(gone)} of {len(ranks)} (global numbering) no longer runs: it died or left after it came"
    elif error is not None:
        why = "a rank this one must connect to did not answer (it died or left after it came, or the network failed)"
    else:
        why = f"rank(s) other than this one did not make it within {timeout:g} s"
    raise DistributedError(
        f"trainstate's coordination group ({channel}) could not be made: {why}. Every rank of the process group "
        "must make the same trainstate call: under a process group trainstate.save, trainstate.load, "
        "CheckpointManager and its save / restore_latest / restore / prune are collective: call them on every "
        "rank, or pass collective=False to save or load from one rank alone"
        + (f" ({_text(error)})" if error is not None else "")
    ) from error


def _text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


def _named(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else "no message"


def _store() -> Any:
    """The default process group's key-value store, or None where this torch does not expose it."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a torch without it: no liveness checks
        return None


_liveness: tuple[int, Any] | None = None  # (pid, store) of the connection heartbeats go through


def _liveness_store() -> Any:
    """A connection of trainstate's own to the default group's store, for heartbeats and liveness checks.

    Calls on one store client wait for each other, and torch's ``new_group`` can sit in a call on the default
    client waiting for a rank that died (for as long as the store's timeout, 30 minutes and more): checks made
    through that client would wait behind it. A TCP store gets a second client here; any other store (a file
    store) is used as it is. One per process (a forked child makes its own).
    """
    global _liveness
    if _liveness is not None and _liveness[0] == os.getpid():
        return _liveness[1]
    store = _store()
    inner = store
    while inner is not None and hasattr(inner, "underlying_store"):  # PrefixStore around the real one
        inner = inner.underlying_store
    own = store
    try:
        from torch._C._distributed_c10d import TCPStore

        if isinstance(inner, TCPStore):
            own = TCPStore(
                inner.host, inner.port, is_master=False, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
            )
    except Exception:  # noqa: BLE001 - no second connection: the default client, as before
        own = store
    _liveness = (os.getpid(), own)
    return own


def arrival_timeout() -> float:
    raw = os.environ.get("TRAINSTATE_DIST_ARRIVAL_TIMEOUT")
    if not raw:
        return ARRIVAL_TIMEOUT
    try:
        return timeout_seconds(float(raw))
    except ValueError:
        raise InvalidArgumentError(f"TRAINSTATE_DIST_ARRIVAL_TIMEOUT must be seconds, got {raw!r:.40}") from None


def _arrive(store: Any, channel: str, ranks: list[int], timeout: float) -> None:
    """Wait until every rank of ``ranks`` came to make the coordination group on ``channel``, at most
    ``timeout`` seconds; then raise DistributedError naming those that did not (dead, or elsewhere)."""
    import torch.distributed as dist

    members = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    n = _arrivals[channel, members] = _arrivals.get((channel, members), 0) + 1
    prefix = f"trainstate/arrive/{channel}/{members}/{n}"
    me = dist.get_rank()
    store.set(f"{prefix}/{me}", "1")
    count = int(store.add(f"{prefix}/n", 1))
    deadline = time.monotonic() + timeout
    pause = 0.05
    while count < len(ranks):
        if time.monotonic() > deadline:
            missing = [r for r in ranks if not store.check([f"{prefix}/{r}"])]
            gone = _gone(missing)
            raise DistributedError(
                f"trainstate's coordination group ({channel}): {_named(missing)} of {len(ranks)} did not come "
                f"within {timeout:g} s"
                + (f" ({_named(gone)} no longer runs: died or left)" if gone else "")
                + ". Every rank of the process group must make the same trainstate call: under a process group "
                "trainstate.save, trainstate.load, CheckpointManager and its save / restore_latest / restore / prune "
                "are collective: call them on every rank, or pass collective=False to save or load from one rank "
                "alone. A rank that is only late "
                "can be waited for longer: TRAINSTATE_DIST_ARRIVAL_TIMEOUT=seconds"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
        count = int(store.add(f"{prefix}/n", 0))


def _start_heartbeat(store: Any) -> None:
    """Beat on the store every HEARTBEAT seconds from a daemon thread, once per process (a forked child
    starts none until it makes a group of its own)."""
    global _beating
    if _beating == os.getpid():
        return
    _beating = os.getpid()
    import torch.distributed as dist

    key = f"trainstate/alive/{dist.get_rank()}"

    def beat() -> None:
        while True:
            try:
                store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone (its host died, or the group was destroyed)
                return
            time.sleep(HEARTBEAT)

    threading.Thread(target=beat, name="trainstate-heartbeat", daemon=True).start()


def _gone(ranks: list[int]) -> list[int]:
    """Those of ``ranks`` whose heartbeat stopped, watched for three beats (one that never beat, having made
    no coordination group yet, may be alive elsewhere: it is not named)."""
    store = _liveness_store()
    if store is None or not ranks:
        return []
    try:
        before = {r: int(store.add(f"trainstate/alive/{r}", 0)) for r in ranks}
        beating = [r for r in ranks if before[r] > 0]
        if not beating:
            return []
        time.sleep(3 * HEARTBEAT)
        return [r for r in beating if before[r] == int(store.add(f"trainstate/alive/{r}", 0))]
    except Exception:  # noqa: BLE001 - the store's host is gone too: nothing to tell
        return []
