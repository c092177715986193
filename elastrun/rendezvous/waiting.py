"""Saying that a node waits in the rendezvous: who joined, who is awaited, how long until the time-out.

A node whose round cannot close yet (the other nodes have not started, or a running group is
full) used to wait in silence until ``join_timeout`` (600 s by default) ended it.  Every backend
now calls :meth:`WaitReport.tick` from its wait loops; at most once per ``interval`` (15 s by
default, ``--rdzv-conf wait_report_interval``; 0: never) it builds one line, such as::

    round 0: 1 of 2 nodes joined (host-123); waiting for 1 more; time-out in 585 s

and hands it to ``say`` (the handler's :meth:`~elastrun.rendezvous.api.RendezvousHandler.say_waiting`:
the console at info level, so ``-q`` silences it).  The line is built only when it is due, so a
backend may read the store for it (the first few joiners' host names) without a cost per loop.

Example::

    report = WaitReport(handler.say_waiting, interval=15.0, deadline=deadline)
    while not closed:
        report.tick(lambda: waiting_line(round_, joined, min_nodes, max_nodes, hosts, deadline))
        ...
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

#: How often a waiting node says so, at most (seconds).
DEFAULT_INTERVAL = 15.0
#: Host names named in a line (the first joiners); the rest are counted.
NAMED = 3


class WaitReport:
    """Calls ``say(line())`` when ``interval`` s have passed since the wait began or since the last line."""

    def __init__(self, say: Callable[[str], None], interval: float) -> None:
        self._say = say
        self.interval = interval
        self._next = time.monotonic() + interval

    def due_in(self) -> float:
        """Seconds until the next line is due (a loop that sleeps may wake for it); inf: never."""
        return float("inf") if self.interval <= 0 else max(0.0, self._next - time.monotonic())

    def tick(self, line: Callable[[], str | None]) -> None:
        """Say ``line()`` if it is due (and not None); ``line`` is only called then."""
        if self.interval <= 0:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        text = line()
        if text:
            self._say(text)


    @contextlib.contextmanager
    def during(self, line: Callable[[], str | None]) -> Iterator[None]:
        """Tick from a thread of its own while the block runs (a call that blocks, e.g. a store's
        connect that retries inside until its own time-out)."""
        if self.interval <= 0:
            yield
            return
        done = threading.Event()

        def run() -> None:
            while not done.wait(max(0.05, self._next - time.monotonic())):
                self.tick(line)

        thread = threading.Thread(target=run, daemon=True, name="elastrun-rdzv-wait")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


def time_left(deadline: float) -> str:
    """``time-out in N s`` for a monotonic ``deadline``."""
    return f"time-out in {max(0, round(deadline - time.monotonic()))} s"


def waiting_line(round_: int, joined: int, min_nodes: int, max_nodes: int, hosts: list[str], deadline: float,
                 why: str = "") -> str:
    """The line of a node waiting for round ``round_`` to close.

    ``hosts``: the host names of the first joiners (at most :data:`NAMED` are shown).  ``why``: what
    the round waits for when enough nodes joined (e.g. the members of the previous round).
    """
    shown = ", ".join(hosts[:NAMED]) + (f" and {joined - len(hosts[:NAMED])} more" if joined > len(hosts[:NAMED])
                                         and hosts else "")
    names = f" ({shown})" if shown else ""
    if min_nodes == max_nodes:
        head = f"{joined} of {min_nodes} nodes joined{names}"
    else:
        head = f"{joined} node{'s' if joined != 1 else ''} joined{names} (--nnodes={min_nodes}:{max_nodes})"
    if joined < min_nodes:
        awaited = f"waiting for {min_nodes - joined} more"
    else:
        awaited = f"waiting for {why or 'the round to close'}"
    return f"rendezvous round {round_}: {head}; {awaited}; {time_left(deadline)}"
