"""A worker on its way out is not "seen running": a SIGKILL pending or the kernel ending the process.

The agent records when it last saw each worker running (``worker_exit``'s ``alive_at``); goodput places a
crash no earlier than that.  On a loaded host a SIGKILLed process can stay unreaped for a second or more,
which once put a crash 1.2 s late and counted that second as steps the fault cut short instead of its
detection (``test_goodput_accuracy``).  Such a worker's threads below normal priority are raised
(``hasten_exit``), so that its end waits on none of them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from elastrun.agent.workers.starter import hasten_exit, on_its_way_out, parse_stat, process_dying

#: The shape of a real ``/proc/PID/stat`` (a command name with a space and a parenthesis, as Python allows): the
#: flags are field 9, the pending signals field 31.
STAT = (b"4242 (python x) y) S 1 4242 4242 0 -1 %d 98 0 0 0 5 1 0 0 20 0 3 0 8130256 3133440 390 "
        b"18446744073709551615 94431588323328 94431588343209 140734280145280 0 0 %d 0 0 0 0 0 0 17 0 0 0 0 0 0 "
        b"94431588359216 94431588360832 94432598642688 140734280153825 140734280153845 140734280153845 0\n")


@pytest.mark.unit
@pytest.mark.parametrize(("flags", "pending", "expected"), [
    (0x400000, 0, False),  # running: PF_RANDOMIZE only
    (0x400004, 0, True),  # PF_EXITING: being torn down, or a zombie
    (0x400000, 1 << 8, True),  # a SIGKILL for the main thread (the kernel adds a fatal one to every thread)
    (0x400000, 1 << 14, False),  # SIGTERM pending: the script may still run (its handler)
])
def test_the_stat_file_tells_a_process_on_its_way_out(flags, pending, expected):
    assert on_its_way_out(parse_stat(STAT % (flags, pending))) is expected


@pytest.mark.unit
def test_unreadable_text_is_not_a_death():
    assert on_its_way_out(parse_stat(b"")) is False
    assert on_its_way_out(parse_stat(b"1 (x) S 1 2")) is False
    assert on_its_way_out(parse_stat(b"1 (x) S 1 2 3 4 5 zz")) is False


@pytest.mark.e2e
def test_a_killed_unreaped_child_is_dying_and_a_running_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_dying(child.pid) is False
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10  # not reaped (no wait): it stays a zombie, PF_EXITING set
        while not process_dying(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_dying(child.pid) is True
    finally:
        child.kill()
        child.wait(10)
    assert process_dying(child.pid) is False  # reaped: gone, unknown


_LOW_THREADS = """
import os, sys, threading
ready = threading.Barrier(3)
tids = {}
def low(kind):
    tids[kind] = threading.get_native_id()
    if kind == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.setpriority(os.PRIO_PROCESS, 0, 5)  # this thread only (Linux)
    ready.wait()
    threading.Event().wait()
for kind in ("idle", "nice"):
    threading.Thread(target=low, args=(kind,), daemon=True).start()
ready.wait()
print(tids["idle"], tids["nice"], flush=True)
sys.stdin.read()
"""


@pytest.mark.e2e
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_a_workers_low_priority_threads_are_raised_so_that_it_ends_at_once():
    """A killed process ends once each of its threads has run its exit, and on busy cores a thread at
    SCHED_IDLE waits seconds for one: ``hasten_exit`` puts it (and a niced one) back at normal priority.
    The main thread is left as it is."""
    child = subprocess.Popen([sys.executable, "-c", _LOW_THREADS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        idle, niced = (int(t) for t in child.stdout.readline().split())
        assert os.sched_getscheduler(idle) == os.SCHED_IDLE and os.getpriority(os.PRIO_PROCESS, niced) == 5
        raised = hasten_exit(child.pid)
        if raised == 0 and os.geteuid() != 0:
            pytest.skip("an unprivileged process may not raise a thread's priority here (RLIMIT_NICE)")
        assert raised == 2
        assert os.sched_getscheduler(idle) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, niced) == 0
        assert os.sched_getscheduler(child.pid) == os.SCHED_OTHER
        assert hasten_exit(child.pid) == 0  # nothing left to raise
    finally:
        child.kill()
        child.wait(10)
    assert hasten_exit(child.pid) == 0  # gone: nothing, no error
