"""A process forked while a background job is in flight exits without waiting for it (the job's thread was
not forked: it would wait forever); a queue used in the child runs its own jobs on a thread of its own."""

from __future__ import annotations

import multiprocessing as mp
import threading

from trainstate._save.queue import BackgroundQueue

FORK = mp.get_context("fork")


def _child_uses_the_queue(queue: BackgroundQueue, out: object) -> None:
    assert len(queue.jobs) == 0  # the parent's job is the parent's
    job = queue.submit(lambda: 42, None, "the child's job")
    out.put(job.future.result(timeout=5))  # type: ignore[attr-defined]
    queue.shutdown()


def test_a_child_forked_mid_job_exits_at_once_and_can_use_the_queue():
    queue = BackgroundQueue(buffers=1, name="trainstate-test-fork")
    release = threading.Event()
    job = queue.submit(lambda: release.wait(30), None, "a slow save")
    try:
        child = FORK.Process(target=lambda: None)  # returns at once, then runs the exit hooks
        child.start()
        child.join(timeout=10)
        assert not child.is_alive(), "the forked child waits at exit for the parent's job"
        assert child.exitcode == 0
        out = FORK.Queue()
        user = FORK.Process(target=_child_uses_the_queue, args=(queue, out))
        user.start()
        user.join(timeout=10)
        assert user.exitcode == 0 and out.get(timeout=1) == 42
    finally:
        for p in (child, user) if "user" in locals() else (child,):
            if p.is_alive():
                p.kill()
        release.set()
    assert job.future.result(timeout=5) is True  # the parent's job ran to its end
    queue.shutdown()
