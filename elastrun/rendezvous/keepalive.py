"""Heartbeats and the ring watch: how an agent proves it is alive and how a death is noticed.

Every agent writes ``hb/<node_id>`` every ``heartbeat_interval`` seconds with an increasing
counter and its wall-clock time.  Each member of a closed round watches only its successor in
group-rank order (a ring), so the cost per agent is constant whatever the job size.  A watcher
that sees its successor's counter unchanged for ``heartbeat_timeout`` seconds (measured on its
own monotonic clock, so clocks need not agree) declares it dead in the store and moves on to the
next successor; if two neighbours die, the one before them still notices both.  A watcher also
holds a liveness link to the same successor (:mod:`elastrun.rendezvous.link`): when the
successor's process dies, the link says so within milliseconds and the watcher declares it at
once, through the same path, instead of waiting for the silence.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RingWatch:
    """Tracks one successor's heartbeat counter and says when it went silent.

    Only a counter larger than any seen before counts as a sign of life, so an old heartbeat
    written again (a replay) does not keep a dead node alive.  A target never seen beating gets
    ``first_beat_grace`` more: a node starts beating when it sees its first round closed, and at
    thousands of nodes its watcher may have woken up and read the result a moment before it.
    """

    def __init__(self, timeout: float, first_beat_grace: float = 0.0) -> None:
        self.timeout = timeout
        self.first_beat_grace = first_beat_grace
        self.target: str | None = None
        self._last_counter = -1
        self._last_change = time.monotonic()

    def retarget(self, node_id: str | None) -> None:
        if node_id != self.target:
            self.target = node_id
            self._last_counter = -1
            self._last_change = time.monotonic()

    def observe(self, value: str | bytes | None) -> bool:
        """Feed the latest heartbeat value (``counter:time``); True when the target is silent past the timeout."""
        now = time.monotonic()
        counter = _counter(value)
        if counter is not None and counter > self._last_counter:
            self._last_counter = counter
            self._last_change = now
            return False
        grace = self.first_beat_grace if self._last_counter < 0 else 0.0
        return now - self._last_change >= self.timeout + grace


def _counter(value: str | bytes | None) -> int | None:
    if value is None:
        return None
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    try:
        return int(text.partition(":")[0])
    except ValueError:
        return None


class Heartbeat(threading.Thread):
    """Calls ``beat()`` every ``interval`` seconds until stopped; reports store errors once."""

    def __init__(self, interval: float, beat: Callable[[], None], on_error: Callable[[Exception], None]) -> None:
        super().__init__(daemon=True, name="elastrun-heartbeat")
        self.interval = interval
        self._beat = beat
        self._on_error = on_error
        self._stop_event = threading.Event()
        self._wake_event = threading.Event()

    def run(self) -> None:
        failures = 0
        while not self._stop_event.is_set():
            self._wake_event.clear()
            try:
                self._beat()
                failures = 0
            except Exception as exc:  # store lost or timed out: tell the owner, keep trying
                failures += 1
                self._on_error(exc)
            self._wake_event.wait(self.interval if failures == 0 else min(2.0, self.interval * 2))

    def wake(self) -> None:
        """Beat now rather than at the next interval (e.g. a liveness link saw its peer die)."""
        self._wake_event.set()

    def stop(self) -> None:
        self._stop_event.set()
        self._wake_event.set()
