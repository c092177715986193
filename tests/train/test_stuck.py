"""The rule that tells a training thread stuck for good in a collective (``elastrun.train.stuck``), on
real threads.  The whole path, a real gloo send that can never return under a real agent, is
``test_reform.py::test_survivor_stuck_in_a_lost_send_says_so_and_is_restarted_at_once``."""

from __future__ import annotations

import threading
import time

import pytest

from elastrun.train import stuck
from elastrun.train.stuck import Sample, cannot_return

pytestmark = pytest.mark.unit

IN_C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
WAITING = Sample(file=IN_C10D, where="all_reduce (distributed_c10d.py:3252)", state="S", cpu=40)


@pytest.mark.parametrize(
    ("last", "connections_open", "stuck_for_good"),
    [
        (WAITING, 0, True),
        (Sample(IN_C10D, WAITING.where, "D", 40), 0, True),
        (WAITING, 1, False),  # a connection can still bring what the call waits for
        (WAITING, None, False),  # a group with no connection to watch
        (Sample(IN_C10D, WAITING.where, "S", 41), 0, False),  # it used CPU: it computes
        (Sample(IN_C10D, WAITING.where, "R", 40), 0, False),  # it runs
        (Sample(IN_C10D, "barrier (distributed_c10d.py:4810)", "S", 40), 0, False),  # it moved on
    ],
)
def test_the_rule(last, connections_open, stuck_for_good):
    assert cannot_return(WAITING, last, connections_open) is stuck_for_good


def test_only_collective_frames_count():
    for file, counted in [("/x/torch/autograd/graph.py", True), ("/x/torch/nn/parallel/distributed.py", True),
                          ("/x/torch/utils/data/dataloader.py", False), ("/x/user/train.py", False)]:
        first = Sample(file, "f (g.py:1)", "S", 0)
        assert cannot_return(first, first, 0) is counted, file


def _for(seconds: float):
    """``leaving()`` that holds for ``seconds``."""
    end = time.monotonic() + seconds
    return lambda: time.monotonic() < end


def _thread_in(kind: str):
    """A thread whose innermost frame claims torch.distributed's file: asleep in a C call (as in
    ``work.wait()``), or spinning.  Returns it, its kernel thread id and what ends it."""
    source = (
        "def body(tid, native):\n"
        "    tid.append(native())\n"
        "    if KIND == 'asleep':\n"
        "        GATE.acquire(timeout=30)\n"
        "    while KIND == 'spinning' and not DONE.is_set():\n"
        "        sum(range(1000))\n"
    )
    gate, done = threading.Lock(), threading.Event()
    gate.acquire()
    scope: dict = {"KIND": kind, "GATE": gate, "DONE": done}
    exec(compile(source, IN_C10D, "exec"), scope)
    tid: list[int] = []
    thread = threading.Thread(target=scope["body"], args=(tid, threading.get_native_id), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not tid and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread.ident is not None and tid, "the thread did not start"

    def end() -> None:
        done.set()
        gate.release()
        thread.join(10)

    return thread.ident, tid[0], end


def test_a_thread_asleep_in_a_collective_is_reported_once_and_a_computing_one_is_not(monkeypatch):
    monkeypatch.setattr(stuck, "GRACE_S", 0.3)
    for kind, expected in (("asleep", True), ("spinning", False)):
        ident, tid, end = _thread_in(kind)
        try:
            seen = stuck.sample(ident, tid)
            assert seen is not None and seen.file == IN_C10D, seen
            reports: list[str] = []
            assert stuck.watch(ident, tid, _for(0.8), lambda: 0, reports.append) is expected, (kind, reports)
            assert len(reports) == int(expected)
            if expected:
                assert reports[0].startswith("stuck in body (distributed_c10d.py:4) 0.3 s after every"), reports
        finally:
            end()


def test_nothing_is_reported_while_a_connection_is_open_or_once_the_thread_left():
    ident, tid, end = _thread_in("asleep")
    try:
        reports: list[str] = []
        assert not stuck.watch(ident, tid, _for(0.8), lambda: 1, reports.append)
        assert not stuck.watch(ident, tid, lambda: False, lambda: 0, reports.append)
        assert reports == []
    finally:
        end()
