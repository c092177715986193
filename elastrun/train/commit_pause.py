"""A pause taken at the end of a ``commit()``: how long a worker may wait for it.

A node that joins a running job stops every member's workers: the new round needs their ranks.
The pause a fault needs (:mod:`elastrun.train.reform`) interrupts the training thread wherever it
is: the partial step is thrown away, and a pause inside ``optimizer.step()`` leaves the objects
torn, so that rank restores from its memory slot instead of keeping them.  A join needs no such
haste, since the group is whole: its workers may finish the step they are in and leave at the
end of the ``commit()`` that follows, with nothing discarded.

Every rank must leave at the same commit (a rank that goes on would wait in its next collective
for one that left), so the wish rides on the commit's one flag all-reduce: once any rank of the
group votes, every rank leaves at that commit.  A worker waits for that commit only while it is
near: the agent bounds the wait (``within``), and a script whose commits are further apart than
that (or that has not committed twice yet, or is past its usual time) gets the interrupting pause
at once.  This module holds the pure parts: the clock of recent commits and that rule.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque

#: Commits whose spacing the clock keeps (the median of their gaps is "a step").
KEEP = 9
#: The next commit is waited for until this many steps after the last one.
SLACK = 3.0


class CommitClock:
    """When this worker's recent commits ended (``time.monotonic()``), and the usual gap between them."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=KEEP)

    def committed(self, now: float) -> None:
        self._times.append(now)

    def reset(self) -> None:
        """Forget the spacing (a re-form: the first step after it is not a usual one)."""
        self._times.clear()

    @property
    def last(self) -> float | None:
        return self._times[-1] if self._times else None

    @property
    def gap(self) -> float | None:
        """The median time between two commits; None before three commits."""
        times = list(self._times)
        if len(times) < 3:
            return None
        return statistics.median(b - a for a, b in itertools.pairwise(times))


def commit_deadline(now: float, last: float | None, gap: float | None, within: float) -> float | None:
    """Until when (monotonic) a worker asked to pause may wait for its next commit; None: leave now.

    ``last``: when its last commit ended; ``gap``: its usual time between commits; ``within``: the
    longest wait the agent allows.  The next commit is expected ``gap`` after ``last``; it is waited
    for up to :data:`SLACK` gaps after ``last`` (a step slowed by the joiner's start-up on the same
    cores is still a step), and never past ``now + within``.
    """
    if last is None or gap is None or within <= 0 or gap > within:
        return None
    deadline = min(now + within, last + SLACK * gap)
    return deadline if deadline > now else None
