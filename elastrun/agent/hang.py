"""Hang detection: judge each worker by its progress heartbeats (``elastrun.heartbeat``).

A worker that never sends a heartbeat is never judged hung (a plain torchrun script), except by
an explicit ``--startup-timeout``.  Once it has sent one, silence longer than its hang timeout
means it is stuck: in a collective whose peer vanished, in a deadlock, or stopped (SIGSTOP).
The timeout is ``--hang-timeout`` when given, else learned from the worker itself: ten times the
longest gap seen between its heartbeats, never under 30 s, so a slow step or a checkpoint is
not mistaken for a hang.
"""

from __future__ import annotations

import time

from elastrun.workers.reports import read_heartbeat

HANG_FLOOR = 30.0
HANG_FACTOR = 10.0
#: A worker that ran this long made progress even if it never sent a heartbeat (crash-loop rule).
PROGRESS_RUNTIME = 60.0


class HangTracker:
    """Follows one worker's heartbeat file."""

    def __init__(self, path: str, hang_timeout: float | None, startup_timeout: float | None) -> None:
        self.path = path
        self.hang_timeout = hang_timeout
        self.startup_timeout = startup_timeout
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
        now = time.time() if now is None else now
        return self.beats >= 2 or now - self.started >= PROGRESS_RUNTIME

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
                return f"no first heartbeat within the start-up timeout of {self.startup_timeout:g} s"
            return None
        silent = now - self.last_beat
        if silent > self.timeout:
            return f"no heartbeat for {silent:.1f} s (hang timeout {self.timeout:g} s)"
        return None
