"""A worker on its way out is not "seen running": a SIGKILL pending or the kernel ending the process.

The agent records when it last saw each worker running (``worker_exit``'s ``alive_at``); goodput places a
crash no earlier than that.  On a loaded host a SIGKILLed process can stay unreaped for a second or more,
which once put a crash 1.2 s late and counted that second as steps the fault cut short instead of its
detection (``test_goodput_accuracy``).  Such a worker's threads below normal priority are raised
(``hasten_exit``), so that its end waits on none of them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from elastrun.agent.workers.starter import (
    hasten_exit,
    killed_outright,
    on_its_way_out,
    process_dying,
    process_killed,
    thread_states,
)
from elastrun.shared import priority
from elastrun.shared.procstat import parse_stat
from tests.harness import base_env

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


def _fields(flags: int, pending: int, exit_code: int) -> list[bytes]:
    """Fields of ``/proc/PID/stat`` after the command name (52 in all, as Linux 3.5 on writes them)."""
    fields = [b"0"] * 50
    fields[0], fields[6], fields[28], fields[49] = b"S", b"%d" % flags, b"%d" % pending, b"%d" % exit_code
    return fields


@pytest.mark.unit
@pytest.mark.parametrize(("flags", "pending", "exit_code", "expected"), [
    (0x400000, 0, 0, False),  # running
    (0x400000, 1 << 8, 0, True),  # a SIGKILL pending for the main thread
    (0x400004, 0, 9, True),  # the main thread ended by SIGKILL, other threads still running their exit
    (0x400004, 0, 0, False),  # the main thread left by itself (pthread_exit): the process may run on
    (0x400004, 0, 3 << 8, False),  # exit(3): its status is the script's, not a kill
    (0x400004, 0, 15, False),  # SIGTERM: it may have been the script's own handler's doing
    (0x400000, 1 << 14, 0, False),  # SIGTERM pending: the script may still run (its handler)
])
def test_the_stat_file_tells_a_process_killed_outright(flags, pending, exit_code, expected):
    assert killed_outright(_fields(flags, pending, exit_code)) is expected
    # Without the exit-code field (before Linux 3.5) only a pending SIGKILL tells.
    assert killed_outright(_fields(flags, pending, exit_code)[:40]) is bool(pending & 1 << 8)
    assert killed_outright([]) is False


@pytest.mark.e2e
def test_a_killed_unreaped_child_counts_killed_and_one_that_exited_does_not():
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    try:
        assert process_killed(killed.pid) is False
        killed.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10  # neither is reaped (no wait): zombies with their status
        while not (process_killed(killed.pid) and process_dying(exited.pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_killed(killed.pid) is True
        assert process_dying(exited.pid) is True and process_killed(exited.pid) is False
    finally:
        killed.kill()
        assert killed.wait(10) == -signal.SIGKILL and exited.wait(10) == 3
    assert process_killed(killed.pid) is False  # reaped: gone, unknown


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
        if raised == 0 and not priority.may_raise():
            pytest.skip("without CAP_SYS_NICE or RLIMIT_NICE >= 20 no thread's priority can be raised here")
        assert raised == 2
        assert os.sched_getscheduler(idle) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, niced) == 0
        assert os.sched_getscheduler(child.pid) == os.SCHED_OTHER
        assert hasten_exit(child.pid) == 0  # nothing left to raise
    finally:
        child.kill()
        child.wait(10)
    assert hasten_exit(child.pid) == 0  # gone: nothing, no error


_WAITING_THREADS = """
import os, socket, sys, threading, time
r, w = os.pipe()
a, b = socket.socketpair()
tids = {}
def low():  # put at idle priority by the test once it waits (as a worker's snapshot copier between copies)
    tids["low"] = threading.get_native_id()
    os.read(r, 1)
def read():
    tids["reader"] = threading.get_native_id()
    a.recv(1)
threading.Thread(target=low, daemon=True).start()
threading.Thread(target=read, daemon=True).start()
while len(tids) < 2:
    time.sleep(0.001)
print(tids["low"], tids["reader"], flush=True)
sys.stdin.read()
"""


def _settled(pid: int, tids: list[int], looks: int = 5) -> bool:
    """Whether every thread of ``tids`` (and the main one) sleeps at each of ``looks`` looks 20 ms apart: each
    then waits in its own blocking call (none holds the interpreter lock, so none waits for it)."""
    for _ in range(looks):
        for tid in (pid, *tids):
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                if fh.read().rpartition(")")[2].split()[0] != "S":
                    return False
        time.sleep(0.02)
    return True


@pytest.mark.e2e
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_a_workers_threads_are_summed_up_from_the_kernel():
    """What the agent says of a worker that did not answer its pause: the main thread's state (here blocked
    reading stdin), then the others by state and wait channel, the one at idle priority marked (a pipe's
    reader and a socket's reader: two labels); nothing for a process gone.  The idle one is lowered only
    once it waits, so that it needs no CPU on busy cores."""
    child = subprocess.Popen([sys.executable, "-c", _WAITING_THREADS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        low, reader = (int(t) for t in child.stdout.readline().split())
        deadline = time.monotonic() + 30
        while not _settled(child.pid, [low, reader]) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.sched_setscheduler(low, os.SCHED_IDLE, os.sched_param(0))
        summary = thread_states(child.pid)
        main, _, rest = summary.partition("; others: ")
        others = rest.split(", ")
        assert main.startswith("main S") and "(" not in main, summary
        assert len(others) == 2 and all(part.startswith("1 x S") for part in others), summary
        assert sorted(part.endswith(" (idle)") for part in others) == [False, True], summary
        assert "(" not in next(part for part in others if not part.endswith(" (idle)")), summary
    finally:
        child.kill()
        child.wait(10)
    assert thread_states(child.pid) == ""


#: Run without CAP_SYS_NICE (as root in a Docker container): the priorities that ``priority.lower`` gives a
#: thread (the agent's replicator's rule), the copier's helper once it copies, and the calling thread's.
_NO_CAP_SYS_NICE = """
import os, threading
from elastrun.shared import priority
from elastrun.shared.procstat import parse_stat
from elastrun.train import copier

class Job:  # stands in for a snapshot copy: the helper runs it until it is let go
    running, release = threading.Event(), threading.Event()
    def _work(self):
        self.running.set()
        self.release.wait(10)

def lowered():
    tid = threading.get_native_id()
    got = priority.lower()
    print(got, os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid), priority.restore(tid), flush=True)

t = threading.Thread(target=lowered)
t.start()
t.join(10)
job = Job()
copier._IDLE_WORKER.give(job)
assert job.running.wait(10)
helper, main = copier._IDLE_WORKER._tid, threading.get_native_id()
print(priority.may_raise(), os.sched_getscheduler(helper), os.sched_getscheduler(main),
      os.getpriority(os.PRIO_PROCESS, main), flush=True)
job.release.set()
"""


@pytest.mark.e2e
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or shutil.which("setpriv") is None or os.geteuid() != 0,
                    reason="needs Linux, util-linux's setpriv and root (to drop CAP_SYS_NICE)")
def test_without_cap_sys_nice_a_low_priority_thread_takes_nice_19_and_the_copier_stays_idle():
    """Where a thread could never leave SCHED_IDLE again (no CAP_SYS_NICE, RLIMIT_NICE 0: root in most
    containers), ``hasten_exit`` cannot raise it as its process dies, and on busy cores it holds the
    process's end up for seconds.  There ``priority.lower`` (the agent's replicator) gives nice 19, which the
    scheduler never starves; the worker's copier keeps SCHED_IDLE (at nice 19 it cost the step,
    docs/benchmarks.md); the calling thread stays at normal priority."""
    argv = ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", "--",
            sys.executable, "-c", _NO_CAP_SYS_NICE]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=base_env(), check=False)
    if done.returncode != 0 and done.stderr.startswith("setpriv:"):  # e.g. no CAP_SETPCAP to change the bounding set
        pytest.skip(f"setpriv cannot drop CAP_SYS_NICE here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    got, policy, nice, restored = lines[0].split()
    assert (got, int(policy), int(nice), restored) == ("nice", os.SCHED_OTHER, priority.LOW_NICE, "False"), lines
    may_raise, helper_policy, main_policy, main_nice = lines[1].split()
    assert may_raise == "False" and int(helper_policy) == os.SCHED_IDLE, lines
    assert (int(main_policy), int(main_nice)) == (os.SCHED_OTHER, 0), lines
