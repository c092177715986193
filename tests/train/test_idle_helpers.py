"""A re-form's pause and the worker's idle-priority helper threads (the snapshot copier's, the slot
preparer's): the pause puts them back at normal priority, so that on a busy host the training and
control threads never wait for the interpreter lock on a thread that gets no CPU."""

from __future__ import annotations

import os
import threading
import time

import pytest

from elastrun.shared import priority
from elastrun.shared.protocol import Pause
from elastrun.train import copier, snapshot
from elastrun.train.reform import Link

pytestmark = pytest.mark.unit


def lowered(tid: int) -> bool:
    """Whether thread ``tid`` is as low as :func:`priority.lower` puts it in this process: ``SCHED_IDLE``
    where it can be raised again, else nice 19 at ``SCHED_OTHER``."""
    if priority.may_raise():
        return os.sched_getscheduler(tid) == os.SCHED_IDLE
    return os.sched_getscheduler(tid) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, tid) == priority.LOW_NICE


def _policy_becomes(tid: int, policy: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.sched_getscheduler(tid) == policy:
            return True
        time.sleep(0.01)
    return False


class _BlockedJob:
    """Stands in for a snapshot copy: the helper thread runs it until the test lets it go."""

    def __init__(self) -> None:
        self.running, self.release = threading.Event(), threading.Event()

    def _work(self) -> None:
        self.running.set()
        self.release.wait(10)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_a_pause_puts_the_idle_priority_helpers_back_at_normal_priority(tmp_path, monkeypatch):
    reserving = _BlockedJob()
    monkeypatch.setattr(snapshot, "fallocate", lambda fd, nbytes: reserving._work())
    snapshot.MemorySnapshots(tmp_path, "job").prepare(1 << 20)  # host-memory slots: allocated at idle priority
    copying = _BlockedJob()
    copier._IDLE_WORKER.give(copying)  # the process's one helper thread, as a copy starts it
    try:
        assert reserving.running.wait(10) and copying.running.wait(10)
        tids = [*copier._IDLE_THREADS, copier._IDLE_WORKER._tid]
        assert len(tids) == 2 and all(_policy_becomes(t, os.SCHED_IDLE) for t in tids)
        Link()._on_message(Pause())  # what the control thread does when the agent's pause arrives
        if not priority.may_raise():
            pytest.skip("without CAP_SYS_NICE or RLIMIT_NICE >= 20 no thread here can raise its priority again")
        assert [os.sched_getscheduler(t) for t in tids] == [os.SCHED_OTHER] * 2
        assert [os.getpriority(os.PRIO_PROCESS, t) for t in tids] == [0, 0]
    finally:
        reserving.release.set()
        copying.release.set()


def test_the_idle_copy_helper_ends_with_its_last_copy():
    """A process ends only when each of its threads has run its exit: an idle-priority helper parked
    between copies kept a killed worker, and the sockets its peers wait on, alive on a busy host."""
    jobs = [_BlockedJob() for _ in range(3)]
    for job in jobs:
        job.release.set()
        copier._IDLE_WORKER.give(job)  # one helper takes them in turn
    assert all(job.running.wait(10) for job in jobs)
    deadline = time.monotonic() + 10
    while any(t.name == "elastrun-idle-copy" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.name == "elastrun-idle-copy"]
    assert copier._IDLE_WORKER._tid == 0


def test_a_closed_background_job_leaves_no_thread_and_a_later_job_starts_one():
    """``State.close()`` closes its snapshot and checkpoint jobs: their helper threads end (the GPU
    benchmark counted one parked thread left behind per ``State`` made), and the job still works after."""
    from elastrun.train.background import BackgroundJob

    ran: list[int] = []
    job = BackgroundJob("test-background-close")
    job.submit(lambda: ran.append(1))
    assert job.close(timeout=10)

    def alive() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "test-background-close"]

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive() and ran == [1]
    job.submit(lambda: ran.append(2))
    assert job.wait(timeout=10) and ran == [1, 2]
    job.close(timeout=10)


def test_a_helper_goes_idle_only_where_it_can_be_raised_again():
    """``priority.lower`` on a thread of its own: ``SCHED_IDLE`` where this process may raise it again
    (then ``restore`` does), nice 19 where it may not (``restore`` then says it could not)."""
    seen: dict[str, object] = {}

    def helper() -> None:
        tid = threading.get_native_id()
        seen["got"] = priority.lower()
        seen["low"] = lowered(tid)
        seen["restored"] = priority.restore(tid)
        seen["after"] = (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))

    t = threading.Thread(target=helper)
    t.start()
    t.join(10)
    assert seen["low"] is True, seen
    if priority.may_raise():
        assert seen["got"] == "idle" and seen["restored"] is True and seen["after"] == (os.SCHED_OTHER, 0), seen
    else:
        assert seen["got"] == "nice" and seen["restored"] is False, seen
        assert seen["after"] == (os.SCHED_OTHER, priority.LOW_NICE), seen
