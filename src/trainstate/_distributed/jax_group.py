"""Coordination between the processes of a ``jax.distributed`` job, without torch.distributed.

A multi-process JAX job has no process group trainstate could put a gloo group beside, but it has the JAX
runtime's coordination service: a key-value store every process reaches (``jax.distributed.initialize``).
:class:`KeyValueCoordinator` runs the same exchanges as the gloo coordinator over it -- so the collective
save, the manager's decisions and its background commits work unchanged -- and never through XLA
collectives, which would have to be issued in the same order as the training step's own on every process.

Each exchange is one directory of keys, ``trainstate/<channel>/<n>/<rank>``, numbered per channel in call
order (every process makes the same calls, as under torch.distributed). Values are pickled Python objects --
plans, file lists, error texts, never tensor bytes -- sent between the processes of one job, as torch's
object collectives do; nothing pickled is ever written to a checkpoint. Every read waits at most the
timeout, so a process that died or never came makes the others raise :class:`DistributedError`.

A process that gives up waiting (its timeout) marks the channel abandoned in the store: every process's
next exchange on it is refused, since a process that came late could otherwise pair its call with
another call of the others (one save's shards committed under another's path).

The store is kept small: rank 0 deletes an exchange's keys once every process has been heard from in a
later exchange (by then every process has read them). The client is JAX's own (``jax._src.distributed``,
as Orbax reaches it): JAX has no public key-value API.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import threading
import time
from typing import Any, NoReturn

from trainstate._distributed import group
from trainstate._distributed.group import Coordinator
from trainstate.errors import DistributedError

_PREFIX = "trainstate"
_counters: dict[str, int] = {}  # the number of each channel's next exchange, shared by its coordinators
_pending: dict[str, list[int]] = {}  # rank 0: each channel's exchanges whose keys are still in the store
_abandoned: dict[str, str] = {}  # channels on which some process gave up waiting: why (see _begin)
_lock = threading.Lock()
_beating: int | None = None  # the pid whose heartbeat thread runs
_SLICE = 2.0  # seconds a wait for another process lasts before it is checked for life
_STOPPED = 3 * group.HEARTBEAT + _SLICE  # a heartbeat unchanged this long: the process is gone


def process_and_count() -> tuple[int, int]:
    """This process's index and the process count under ``jax.distributed``; (0, 1) outside it."""
    state = _state()
    return (0, 1) if state is None else (int(state.process_id), int(state.num_processes))


def coordinator(timeout: float, channel: str) -> KeyValueCoordinator | None:
    """The coordinator of this job's processes, or None outside a ``jax.distributed`` job of several."""
    state = _state()
    if state is None or state.num_processes <= 1:
        return None
    return KeyValueCoordinator(state.client, int(state.process_id), int(state.num_processes), timeout, channel)


def _state() -> Any:
    """JAX's distributed state once ``jax.distributed.initialize`` ran, else None. Read without starting JAX's
    backend, which in a multi-process job is itself a step every process takes together."""
    if "jax" not in sys.modules:  # nobody initialized jax.distributed: no need to import JAX
        return None
    import jax

    if not jax.distributed.is_initialized():
        return None
    from jax._src.distributed import global_state

    return global_state if global_state.client is not None else None


def _alive_key(rank: int) -> str:
    return f"{_PREFIX}/alive/{rank}"


def _start_heartbeat(client: Any, rank: int) -> None:
    """Beat every HEARTBEAT seconds from a daemon thread, once per process, until exit (stopped before JAX's
    own exit hook shuts the client down: exit hooks run last registered first)."""
    global _beating
    if _beating == os.getpid():
        return
    _beating = os.getpid()
    stop = threading.Event()

    def beat() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                client.key_value_set_bytes(_alive_key(rank), str(n).encode(), allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the service is gone: nobody is left to tell
                return
            stop.wait(group.HEARTBEAT)

    thread = threading.Thread(target=beat, name="trainstate-heartbeat", daemon=True)
    thread.start()

    def halt() -> None:
        stop.set()
        thread.join(timeout=5)

    atexit.register(halt)


class KeyValueCoordinator(Coordinator):
    """Rank 0 and the others, exchanging small objects through the JAX coordination service's store."""

    def __init__(self, client: Any, rank: int, world: int, timeout: float, channel: str) -> None:
        self.client = client
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.channel = channel
        _start_heartbeat(client, rank)

    def gather(self, value: Any, what: str) -> list[Any] | None:
        n = self._begin(what)
        self._put(n, self.rank, value, what)
        if self.rank != 0:
            return None
        out = [self._get(n, r, what) for r in range(self.world)]
        self._heard_from_all(n)
        return out

    def broadcast(self, value: Any, what: str) -> Any:
        n = self._begin(what)
        if self.rank == 0:
            self._put(n, 0, value, what)
            return value
        return self._get(n, 0, what)

    def scatter(self, values: list[Any] | None, what: str) -> Any:
        n = self._begin(what)
        if self.rank == 0:
            assert values is not None and len(values) == self.world
            for r in range(1, self.world):
                self._put(n, r, values[r], what)
            return values[0]
        return self._get(n, self.rank, what)

    def all_gather(self, value: Any, what: str) -> list[Any]:
        n = self._begin(what)
        self._put(n, self.rank, value, what)
        out = [value if r == self.rank else self._get(n, r, what) for r in range(self.world)]
        if self.rank == 0:
            self._heard_from_all(n)
        return out

    def _begin(self, what: str) -> int:
        """The number of this exchange; refused once any process gave up on an exchange of this channel."""
        given_up = _abandoned.get(self.channel)
        if given_up is None:
            try:
                given_up = self.client.key_value_try_get_bytes(self._abandoned_key()).decode()
            except Exception:  # noqa: BLE001 - NOT_FOUND: no process gave up (the usual case)
                given_up = None
        if given_up is not None:
            _abandoned[self.channel] = given_up
            raise DistributedError(
                f"{what}: the JAX processes are out of step on trainstate's exchanges: {given_up}. A process that "
                "gives up on an exchange cannot tell the late ones which call they are in, so no later save of this "
                "kind can pair the processes' calls safely: restart the job (every process), and see why a process "
                "was late (or raise timeout=)"
            )
        with _lock:
            n = _counters.get(self.channel, 0)
            _counters[self.channel] = n + 1
            if self.rank == 0:
                _pending.setdefault(self.channel, []).append(n)
        return n

    def _key(self, n: int, rank: int | None = None) -> str:
        return f"{_PREFIX}/{self.channel}/{n}/" + ("" if rank is None else str(rank))

    def _put(self, n: int, rank: int, value: Any, what: str) -> None:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        self._call(what, lambda: self.client.key_value_set_bytes(self._key(n, rank), data))

    def _get(self, n: int, rank: int, what: str) -> Any:
        """Wait for ``rank``'s value in slices, between which it is checked for life: a process whose heartbeat
        stopped is named within seconds, one that never beat (it made no coordinator: dead before its first
        exchange, or elsewhere) once the arrival timeout passed; a live one is waited for to the timeout."""
        start = time.monotonic()
        deadline = start + self.timeout
        arrival = start + min(self.timeout, group.arrival_timeout())
        seen: tuple[bytes | None, float] = (self._beat_of(rank), start)  # its last beat, and since when
        while True:
            wait = max(0.001, min(deadline - time.monotonic(), _SLICE))
            try:
                data = self.client.blocking_key_value_get_bytes(self._key(n, rank), max(1, int(wait * 1000)))
            except Exception as e:  # noqa: BLE001 - the runtime's error: this slice's deadline, or the service
                now = time.monotonic()
                if now >= deadline or "DEADLINE_EXCEEDED" not in str(e):
                    self._give_up(what, e)
                beat = self._beat_of(rank)
                if beat != seen[0]:
                    seen = (beat, now)
                elif beat is not None and now - seen[1] > _STOPPED:
                    self._give_up(what, e, f"process {rank} is gone: its heartbeat stopped {now - seen[1]:.0f} s ago")
                elif beat is None and now >= arrival:
                    self._give_up(
                        what,
                        e,
                        f"process {rank} did not come within {arrival - start:g} s (it died before its first "
                        "exchange, or is not making this call; TRAINSTATE_DIST_ARRIVAL_TIMEOUT waits longer)",
                    )
                continue
            return pickle.loads(data)  # noqa: S301 - from this job's own processes (see the module's docstring)

    def _beat_of(self, rank: int) -> bytes | None:
        try:
            return bytes(self.client.key_value_try_get_bytes(_alive_key(rank)))
        except Exception:  # noqa: BLE001 - NOT_FOUND: it never beat
            return None

    def _heard_from_all(self, n: int) -> None:
        """Every process has passed every exchange before ``n``: their keys can go."""
        with _lock:
            waiting = _pending.get(self.channel, [])
            done = [m for m in waiting if m < n]
            _pending[self.channel] = [m for m in waiting if m >= n]
        for m in done:
            try:
                self.client.key_value_delete(self._key(m))
            except Exception:  # noqa: BLE001 - only memory: the service forgets the keys when the job ends
                pass

    def _abandoned_key(self) -> str:
        return f"{_PREFIX}/{self.channel}/abandoned"

    def _call(self, what: str, op: Any) -> None:
        try:
            op()
        except Exception as e:  # noqa: BLE001 - the runtime's error: a deadline passed, or the service is gone
            self._give_up(what, e)

    def _give_up(self, what: str, e: Exception, gone: str | None = None) -> NoReturn:
        """Mark the channel abandoned (see _begin) and raise: ``gone`` names a process known to be gone."""
        first = str(e).splitlines()[0][:200] if str(e) else "no message"
        given_up = f"process {self.rank} gave up waiting in {what} after {self.timeout:g} s"
        _abandoned.setdefault(self.channel, given_up)
        try:  # the late processes learn it when they come to their next exchange of this channel
            self.client.key_value_set_bytes(self._abandoned_key(), given_up.encode(), allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the service itself is gone: nobody will come
            pass
        if gone is not None:
            raise DistributedError(
                f"{what}: {gone}, so process {self.rank} of {self.world} cannot go on without it; nothing was committed"
            ) from None
        raise DistributedError(
            f"{what}: process {self.rank} of {self.world} lost contact with the other JAX processes "
            f"({type(e).__name__}: {first}). A process died or did not reach this point within "
            f"{self.timeout:g} s (timeout=, or TRAINSTATE_DIST_TIMEOUT); nothing was committed"
        ) from None
