"""Hang detection: judge each worker by its progress heartbeats (``elastrun.heartbeat``).

Once a worker has sent a heartbeat, silence longer than its hang timeout means it is stuck: in a
collective whose peer vanished, in a deadlock, or stopped (SIGSTOP).  The timeout is
``--hang-timeout`` when given, else learned from the worker itself: ten times the longest gap seen
between its heartbeats, never under 30 s, so a slow step or a checkpoint is not mistaken for a hang.

Before its first heartbeat a worker is judged by a start-up bound (:func:`startup_bound`):
``--startup-timeout`` when given, else learned from this node's earlier workers of the job
(:class:`StartupHistory`): five times the longest time one of them took from its start (or, for a
worker kept through a re-form, from its new assignment) to its first heartbeat, which covers its
process group, its restore and its first step; never under 30 s (under ``--hang-timeout`` when
that is given: a job that calls a few seconds of silence a hang accepts a bound as tight), and
doubled after each start-up stall in a row, so a start that is slow for a good reason (a large
restore from disk) gets through on a later attempt.  A node none of whose workers ever sent a
heartbeat (a plain torchrun script, or a job's very first start) has no bound: such a worker is
never judged before its first heartbeat.
docs/observe.md, "Hangs and stalls", has the numbers.
"""

from __future__ import annotations

import time

from elastrun.agent.workers.reports import read_heartbeat

HANG_FLOOR = 30.0
HANG_FACTOR = 10.0
#: The learned start-up bound: this many times the longest start seen, at least the floor (30 s,
#: or ``--hang-timeout`` when given).
STARTUP_FLOOR = 30.0
STARTUP_FACTOR = 5.0
#: A start-up stall doubles the next bound, at most this many times in a row (16 x).
STARTUP_DOUBLINGS = 4
#: A worker that ran this long made progress even if it never sent a heartbeat (crash-loop rule).
PROGRESS_RUNTIME = 60.0


def startup_bound(explicit: float | None, longest: float | None, stalls: int,
                  floor: float = STARTUP_FLOOR) -> float | None:
    """Seconds a worker may take from its start to its first heartbeat (None: no bound).

    ``explicit``: ``--startup-timeout``.  ``longest``: the longest start → first heartbeat seen on
    this node (None when no worker has sent one).  ``stalls``: start-up stalls in a row since.
    ``floor``: the least learned bound.
    """
    if explicit is not None:
        return explicit
    if longest is None:
        return None
    return max(floor, STARTUP_FACTOR * longest) * 2 ** min(stalls, STARTUP_DOUBLINGS)


class StartupHistory:
    """What this node learnt of its workers' starts (see the module docstring); lives as long as the agent."""

    def __init__(self, explicit: float | None = None, hang_timeout: float | None = None) -> None:
        self.explicit = explicit
        self.floor = hang_timeout if hang_timeout is not None else STARTUP_FLOOR
        #: Starts that reached a first heartbeat, and the longest of them (seconds).
        self.count = 0
        self.longest: float | None = None
        #: Start-up stalls since the last worker that reached its first heartbeat.
        self.stalls = 0

    @property
    def heartbeats(self) -> bool:
        """Whether this job's workers send heartbeats (one of this node's did)."""
        return self.count > 0

    def stepped(self, took: float) -> None:
        """A worker sent its first heartbeat ``took`` seconds after its start."""
        self.count += 1
        self.longest = max(self.longest or 0.0, took)
        self.stalls = 0

    def stalled(self) -> None:
        """A worker was judged stuck before its first heartbeat."""
        self.stalls += 1

    def bound(self) -> float | None:
        return startup_bound(self.explicit, self.longest, self.stalls, self.floor)

    def describe(self) -> str:
        """How :meth:`bound` was computed, for the console and the event log."""
        bound = self.bound()
        if self.explicit is not None:
            return f"--startup-timeout {self.explicit:g} s"
        if bound is None or self.longest is None:
            return "no bound: no worker of this node has sent a heartbeat"
        times = min(self.stalls, STARTUP_DOUBLINGS)
        doubled = f", doubled {times} time(s) after start-up stalls" if self.stalls else ""
        return (f"{round(bound, 1):g} s, learned: {STARTUP_FACTOR:g} x the slowest of {self.count} start(s) on this "
                f"node ({self.longest:.1f} s to the first heartbeat), at least {self.floor:g} s{doubled}")


class HangTracker:
    """Follows one worker's heartbeat file.

    ``startup_timeout``: the start-up bound (None: none); ``startup_why``: how it was computed (the
    reason names it); ``expects_beats``: the job's workers send heartbeats, so a long run without
    one is no progress (see :meth:`made_progress`).
    """

    def __init__(self, path: str, hang_timeout: float | None, startup_timeout: float | None,
                 startup_why: str = "", expects_beats: bool = False) -> None:
        self.path = path
        self.hang_timeout = hang_timeout
        self.startup_timeout = startup_timeout
        self.startup_why = startup_why or (f"--startup-timeout {startup_timeout:g} s" if startup_timeout else "")
        self.expects_beats = expects_beats
        #: Set once the worker was judged stuck before its first heartbeat.
        self.stalled_at_startup = False
        self.started = time.time()
        self.beats = 0
        self.last_beat: float | None = None
        self.longest_gap = 0.0
        #: Time stamp of the first heartbeat, until :meth:`take_first_beat` hands it out once.
        self._first_beat: float | None = None

    @property
    def timeout(self) -> float:
        """The silence after which this worker counts as hung."""
        if self.hang_timeout is not None:
            return self.hang_timeout
        return max(HANG_FLOOR, HANG_FACTOR * self.longest_gap)

    def made_progress(self, now: float | None = None) -> bool:
        """Whether this worker made progress (the crash-loop rule): two heartbeats; or, in a job whose
        workers do not send them, :data:`PROGRESS_RUNTIME` seconds of running.  Never a worker judged
        stuck before its first heartbeat: a stall in a row of them is a crash loop, said as such."""
        now = time.time() if now is None else now
        if self.beats >= 2:
            return True
        if self.stalled_at_startup or self.expects_beats:
            return False
        return now - self.started >= PROGRESS_RUNTIME

    def take_first_beat(self) -> float | None:
        """The first heartbeat's time stamp the first time it is asked for after it was seen, else None.

        The agent reports it once per worker: the moment a restarted worker steps again.
        """
        first, self._first_beat = self._first_beat, None
        return first

    def check(self, now: float | None = None) -> str | None:
        """Read the heartbeat file; a description of the hang, or None while the worker is fine."""
        now = time.time() if now is None else now
        beat = read_heartbeat(self.path)
        if beat is not None and beat != self.last_beat:
            if self.last_beat is not None:
                self.longest_gap = max(self.longest_gap, beat - self.last_beat)
            if self.last_beat is None:
                self._first_beat = beat
            self.last_beat = beat
            self.beats += 1
        if self.last_beat is None:
            if self.startup_timeout is not None and now - self.started > self.startup_timeout:
                self.stalled_at_startup = True
                return (f"no first heartbeat {now - self.started:.1f} s after its start "
                        f"(start-up bound {self.startup_why})")
            return None
        silent = now - self.last_beat
        if silent > self.timeout:
            return f"no heartbeat for {silent:.1f} s (hang timeout {self.timeout:g} s)"
        return None
