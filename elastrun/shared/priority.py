"""How low a helper thread's priority goes: ``SCHED_IDLE`` where it can be raised again, else nice 19.

Both sides copy snapshots on low-priority threads, so that training loses no CPU to the copies: the
worker's copier (:mod:`elastrun.train.copier`, and the slot allocation of :mod:`elastrun.train.snapshot`)
and the agent's replicator (:mod:`elastrun.agent.replicator`).  Two facts of Linux set how low:

- **A killed process ends only once each of its threads has run its exit.**  On a host whose cores are
  all busy, a thread at ``SCHED_IDLE`` can wait seconds for one; meanwhile the process keeps its
  sockets and is not reaped, so its peers and its agent see no death.
- **Leaving ``SCHED_IDLE``, or going back from a positive nice value, takes ``CAP_SYS_NICE`` or an
  ``RLIMIT_NICE`` of at least 20.**  Root in a container usually has neither: Docker, and so most
  Kubernetes pods, drop ``CAP_SYS_NICE``, and the limit defaults to 0.  There the remedies for the
  first fact do nothing: the boost a waiting training thread gives its copier, and the agent's
  ``hasten_exit`` on a dying worker.

So by default a thread goes to ``SCHED_IDLE`` only where it can be raised again (:func:`may_raise`);
elsewhere it goes to nice 19, which the fair scheduler still gives a share of a contended core
(weight 15 against a normal thread's 1024), so it is never starved.  Measured on two cores kept busy
by six other threads, from a SIGKILL to the reaping of a small process with one such thread copying:
1.4 to 4.8 s at ``SCHED_IDLE``, 0.06 to 0.7 s at nice 19, 2 to 22 ms with no low-priority thread
(docs/benchmarks.md, "Low priority without CAP_SYS_NICE").  The agent's replicator takes that rule.

That share is not free where training keeps every core busy: the worker's snapshot copier at nice 19
cost a 10.5M-parameter CPU step that snapshots every step 7 points more than at ``SCHED_IDLE`` (+40 %
against +33 %, 2 cores).  The copier therefore asks for ``SCHED_IDLE`` whatever the privileges
(``idle_for_good``): its cost is paid at every step, a kill's wait only at a death.
"""

from __future__ import annotations

import functools
import os
import threading

#: The nice value of a low-priority thread where ``SCHED_IDLE`` could not be left again.
LOW_NICE = 19
#: ``CAP_SYS_NICE``'s bit in ``/proc/PID/status``'s ``CapEff`` (linux/capability.h).
_CAP_SYS_NICE = 23
#: The ``RLIMIT_NICE`` that lets a thread take nice 0 again (the limit is ``20 - lowest nice``).
_NICE_ZERO_LIMIT = 20


@functools.cache
def may_raise() -> bool:
    """Whether this process's threads may raise their priority again: ``CAP_SYS_NICE`` in effect, or an
    ``RLIMIT_NICE`` that allows nice 0.  False where neither can be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:") and int(line.split()[1], 16) >> _CAP_SYS_NICE & 1:
                    return True
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)  # type: ignore[attr-defined]
    except (ImportError, AttributeError, OSError, ValueError):
        return False
    return soft == resource.RLIM_INFINITY or soft >= _NICE_ZERO_LIMIT


#: Scheduling policies below normal (real-time ones are above it, and left as they are).
_LOW_POLICIES = tuple(getattr(os, name) for name in ("SCHED_IDLE", "SCHED_BATCH") if hasattr(os, name))


def lower(tid: int = 0, *, idle_for_good: bool = False) -> str:
    """Put thread ``tid`` (0: the calling one) at low priority: ``SCHED_IDLE`` where it can be raised again
    or where ``idle_for_good`` says to take it anyway, nice 19 elsewhere (see the module docstring).
    Which it got: ``"idle"``, ``"nice"``, or ``""`` where the platform refused both."""
    if idle_for_good or may_raise():
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
            return "idle"
        except (AttributeError, OSError):
            pass
    return "nice" if nice_at_least(LOW_NICE, tid) else ""


def nice_at_least(nice: int, tid: int = 0) -> bool:
    """Put thread ``tid`` (0: the calling one) at nice ``nice`` unless it already runs at that or lower
    (Linux: this thread only); whether it is there now."""
    try:
        tid = tid or threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except (AttributeError, OSError):
        return False


def is_low(tid: int) -> bool:
    """Whether thread ``tid`` runs below normal priority (``SCHED_IDLE``, ``SCHED_BATCH``, a positive nice
    value); False when it is gone."""
    try:
        return os.sched_getscheduler(tid) in _LOW_POLICIES or os.getpriority(os.PRIO_PROCESS, tid) > 0
    except (AttributeError, OSError):
        return False


def restore(tid: int) -> bool:
    """Put thread ``tid`` back at normal priority (``SCHED_OTHER`` from a low policy, nice 0); whether it is
    there now.  Best effort: without :func:`may_raise` only a thread that was never lowered is."""
    ok = True
    try:
        if os.sched_getscheduler(tid) in _LOW_POLICIES:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        ok = False
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) > 0:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
    except (AttributeError, OSError):
        ok = False
    return ok
