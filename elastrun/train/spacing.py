"""How many commits apart memory snapshots are: the rule, and what it is fed on a GPU.

Every ``commit()`` commits its step (sampler position, step count, RNG states).  The memory
snapshot of the state, which a crash restores from, is taken every ``k`` commits: a crash redoes
the steps since the last one, at most ``k - 1``.

* ``State(snapshot_every=k)`` sets ``k``.
* By default (``snapshot_every=None``) ``k`` is the smallest that keeps what snapshots cost within
  :data:`BUDGET` of the training time (:func:`choose_every`), measured as training runs, for a
  state on a GPU and in host memory alike.  A host state small enough to be copied at once in
  ``commit()`` (under 1 MiB, tens of microseconds) is never measured: ``k`` stays 1.

What a GPU snapshot costs is measured, not modelled: each commit records an event on the
training stream, so the device time of every step is known; a step that overlapped a snapshot's
copy (the device-to-device staging, the copy over the bus, or ``optimizer.step()`` waiting for
it) is compared with the median of recent steps that did not.  The sum of the differences, at
most the copy's own duration (and at least the optimizer's wait for it), is what one snapshot
cost (:class:`Meter`).  A time between commits over :data:`OUTLIER` clean steps is a pause of
the program, not a step, and counts for nothing.

In host memory the same comparison runs on the training thread's clock (:class:`HostMeter`): the
step after a commit that started a snapshot (the idle-priority helper of ``copier.py`` copies
beside it, and the training thread finishes the copy before ``optimizer.step()``) against the
median of steps that overlapped none; at least what the training thread itself waited.  Before
the first measurement a snapshot is followed by one step without one.  Where the step leaves a core
idle the helper copies in that time and costs about nothing: ``k`` comes out 1.  Where it keeps
every core busy the copy costs the step its length and more (memory bandwidth, caches).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

#: The share of training time snapshots may cost by default.
BUDGET = 0.05
#: A crash should redo at most this much training (seconds), where the budget allows it.
REDO_S = 1.0
#: A time between two commits longer than this many clean steps is not a step (a pause of the program).
OUTLIER = 4.0


def choose_every(step_s: float, cost_s: float, copy_s: float, staged: bool, budget: float = BUDGET) -> int:
    """The smallest number of commits between snapshots such that

    * their cost stays within ``budget`` of the steps' time: ``cost_s / k <= budget * step_s``;
    * with a staging buffer (``staged``), a snapshot's copy over the bus has finished before the
      next one starts (that one would otherwise wait for it): ``k * step_s >= copy_s``.

    ``step_s``: a step's device time without a snapshot; ``cost_s``: what one snapshot adds to the
    steps it overlaps; ``copy_s``: the copy's duration.  The redo bound (:data:`REDO_S`) is not a
    term: where it and the budget disagree (a state too large for its step time), the budget wins,
    and :func:`describe` says so.
    """
    if step_s <= 0:
        return 1
    k = max(1, math.ceil(max(cost_s, 0.0) / (budget * step_s) - 1e-9))
    if staged:
        k = max(k, math.ceil(max(copy_s, 0.0) / step_s - 1e-9))
    return k


def describe(every: int, nbytes: int, step_s: float, cost_s: float, copy_s: float, staged: bool,
             host: bool = False) -> str:  # fmt: skip
    """One line saying the spacing chosen and why (logged once, and in the goodput breakdown);
    ``host``: a state in host memory (no device copy to describe)."""
    rate = nbytes / copy_s / 1e9 if copy_s > 0 else 0.0
    share = cost_s / every / step_s * 100 if step_s > 0 else 0.0
    redo = (every - 1) * step_s
    if host:
        what = f"{nbytes / 1e9:.2f} GB copied in host memory in {copy_s * 1e3:.0f} ms beside the step, costing it"
    else:
        what = (f"{nbytes / 1e9:.2f} GB copied in {copy_s * 1e3:.0f} ms ({rate:.0f} GB/s, "
                f"{'staged on the device' if staged else 'direct'}), costing")  # fmt: skip
    line = (f"snapshots every {every} step(s): {what} {cost_s * 1e3:.1f} ms each = {share:.1f} % of a "
            f"{step_s * 1e3:.1f} ms step; a crash redoes at most {redo:.2f} s")  # fmt: skip
    if redo > REDO_S:
        line += f" (over {REDO_S:.0f} s: the {BUDGET * 100:.0f} % budget needs it at this state size)"
    return line


@dataclass
class Snap:
    """One snapshot's device copy as the meter sees it: ``job`` has ``done`` (an event, or None
    until queued) and ``timings()`` (``stall`` seconds, once every event has passed)."""

    job: Any
    nbytes: int
    staged: bool
    index: int = 0  # the commit that started it: the steps after that one overlap it
    cost_s: float = 0.0


class Meter:
    """Step times and snapshot costs on the device, from events (``seconds(a, b)``, ``done(e)``).

    The training thread calls :meth:`step` at every commit with an event it recorded on the
    training stream, then :meth:`started` when that commit queued a snapshot's copy.  Nothing here
    waits: steps whose end the device has not passed are looked at again at the next commit.
    """

    #: Clean steps kept for the median.
    WINDOW = 32
    #: Before the first measurement, a snapshot is followed by this many steps without one.
    probe = 8
    #: Snapshots whose figures make the median.
    RECENT = 5

    def __init__(self, seconds: Any, done: Any) -> None:
        self._seconds = seconds
        self._done = done
        self._events: deque[tuple[int, Any]] = deque()  # (commit index, training-stream event)
        self._count = 0
        self._clean: deque[float] = deque(maxlen=self.WINDOW)
        self._snaps: deque[Snap] = deque()  # started, not yet fully accounted for
        self.step_s = 0.0  # median device time of a step that no snapshot overlapped
        self.cost_s: float | None = None  # what one snapshot costs (median of the recent ones)
        self.copy_s = 0.0  # how long a snapshot's copy takes (median of the recent ones)
        self.nbytes = 0
        self.staged = False
        self.samples = 0  # snapshots measured
        self._warm = False  # the first snapshot was seen (and not counted)
        self._costs: deque[float] = deque(maxlen=self.RECENT)
        self._copies: deque[float] = deque(maxlen=self.RECENT)

    def step(self, event: Any) -> None:
        self._count += 1
        self._events.append((self._count, event))
        self._classify()

    def started(self, job: Any, nbytes: int, staged: bool) -> None:
        self._snaps.append(Snap(job, nbytes, staged, self._count))

    def _landed(self, s: Snap) -> bool:
        return s.job.done is not None and self._done(s.job.done)

    def _classify(self) -> None:
        while len(self._events) >= 2 and self._done(self._events[1][1]):
            (_, a), (i, b) = self._events.popleft(), self._events[0]
            seconds = self._seconds(a, b)
            while self._snaps and self._landed(self._snaps[0]) and self._seconds(a, self._snaps[0].job.done) <= 0:
                self._settle(self._snaps.popleft())  # it landed before this step began
            snap = next((s for s in self._snaps if s.index < i), None)
            if self.step_s and seconds > OUTLIER * self.step_s:
                continue  # not a step's time: a pause between commits (evaluation, a block's end)
            if snap is None:
                self._clean.append(seconds)
                self.step_s = statistics.median(self._clean)
            elif self.step_s:
                snap.cost_s += max(0.0, seconds - self.step_s)

    def _settle(self, snap: Snap) -> None:
        """Every step ``snap`` overlapped is counted: what it cost joins the recent ones.  The
        first snapshot is not counted (its copy is the first into fresh staging and slot memory,
        beside steps still warming up); the figures are medians of the last :data:`RECENT`."""
        if not self.step_s:
            return
        if not self._warm:
            self._warm = True
            return
        t = snap.job.timings()
        # A copy cannot cost the steps more than its own duration; what the steps lost beyond it
        # was something else (noise, the program's own pauses).  The optimizer's wait is all its own.
        self._costs.append(max(min(snap.cost_s, t["copy"]), t["stall"]))
        self._copies.append(t["copy"])
        self.cost_s = statistics.median(self._costs)
        self.copy_s = statistics.median(self._copies)
        self.nbytes, self.staged = snap.nbytes, snap.staged
        self.samples += 1

    def every(self) -> int | None:
        """The spacing the measurements so far ask for, or None before the first one."""
        if self.cost_s is None or not self.step_s:
            return None
        return choose_every(self.step_s, self.cost_s, self.copy_s, self.staged)

    def reset(self) -> None:
        """Forget the step events (a re-form: the training stream's history no longer compares)."""
        self._events.clear()
        self._snaps.clear()


class HostMeter:
    """Step times and snapshot costs of a state in host memory, on the training thread's clock.

    The pipeline calls :meth:`step` at every commit, :meth:`started` when a commit handed a
    snapshot's copy to the background, and :meth:`stalled` with each wait of the training thread
    for that copy (finishing it before ``optimizer.step()``, its publication at the next commit).
    A snapshot overlaps the one step after the commit that started it; that step's time beyond the
    median of recent steps that overlapped none is its cost: at most the copy's own duration (what
    the step lost beyond it was something else: a pause of the program, noise), at least the waits.
    (The waits alone miss most of it: where the helper copies beside the step, the step pays in
    memory bandwidth and caches, not in waiting.)  Same fields and :meth:`every` as :class:`Meter`, so
    that the pipeline and the step log read either.
    """

    WINDOW = Meter.WINDOW
    RECENT = Meter.RECENT
    #: Snapshots not counted at first: they fault in the pages of slots written for the first time
    #: (three slots, four with a checkpoint directory: ``snapshot.slots_needed``); the steps between
    #: them are not counted either (a process's first steps are slower: allocations, first touches).
    WARM = 4
    #: Clean steps needed before a spacing is chosen (one slow step must not make every snapshot look free).
    MIN_CLEAN = 3
    #: At a spacing of 1 no step is clean: after this many commits without one, the next snapshot
    #: is put off by one commit, so that the clean steps' time follows the job (a slower host, a
    #: new world size) and the spacing cannot stay at 1 on a stale figure.
    REPROBE = 32

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self._clock = clock
        self._last: float | None = None
        self._stall = 0.0  # the training thread's waits for a snapshot since the last commit
        self._pending = 0  # bytes of the snapshot the last commit started (0: none)
        self._copy: Any = None  # its copy (``seconds``: its duration, once it is done)
        self._seen = 0
        self._since_clean = 0
        self._clean: deque[float] = deque(maxlen=self.WINDOW)
        self._costs: deque[float] = deque(maxlen=self.RECENT)
        self._copies: deque[float] = deque(maxlen=self.RECENT)
        #: Whether a snapshot was ever copied in the background (else none is measured: every commit's is taken).
        self.measuring = False
        self.step_s = 0.0
        self.cost_s: float | None = None
        self.copy_s = 0.0  # how long a snapshot's copy takes (median of the recent ones)
        self.nbytes = 0
        self.staged = False
        self.samples = 0

    @property
    def probe(self) -> int:
        """The spacing before the first measurement: every other commit, so that a crash meanwhile
        redoes at most one step; every commit for a state never copied in the background."""
        return 2 if self.measuring else 1

    def stalled(self, seconds: float) -> None:
        self._stall += max(0.0, seconds)

    def step(self, _event: Any = None) -> None:
        now = self._clock()
        if self._last is not None:
            self._classify(now - self._last)
        self._last, self._stall, self._pending, self._copy = now, 0.0, 0, None

    def _classify(self, seconds: float) -> None:
        if not self._pending:
            if self._seen < self.WARM or (self.step_s and seconds > OUTLIER * self.step_s):
                return  # a first step, or a pause of the program (an evaluation, a checkpoint)
            self._clean.append(seconds)
            self.step_s = statistics.median(self._clean)
            self._since_clean = 0
            return
        self._since_clean += 1
        # A snapshot's step is not left out as a pause: a copy can cost many steps (a large state,
        # short steps), and that is what must be measured; a pause there is capped by the copy's length.
        self._seen += 1
        copy_s = getattr(self._copy, "seconds", None)
        if self._seen <= self.WARM or not self.step_s or copy_s is None:
            return
        self._costs.append(max(min(seconds - self.step_s, copy_s), self._stall))
        self._copies.append(copy_s)
        self.cost_s = statistics.median(self._costs)
        self.copy_s = statistics.median(self._copies)
        self.nbytes = self._pending
        self.samples += 1

    def started(self, copy: Any, nbytes: int, _staged: bool = False) -> None:
        """The last commit handed ``copy`` (its ``seconds`` once done) of ``nbytes`` to the background."""
        self._pending, self._copy = nbytes, copy
        self.measuring = True

    def every(self) -> int | None:
        """The spacing the measurements so far ask for, or None before the first one."""
        if self.cost_s is None or len(self._clean) < self.MIN_CLEAN:
            return None
        every = choose_every(self.step_s, self.cost_s, 0.0, staged=False)
        return 2 if every == 1 and self._since_clean >= self.REPROBE else every

    def reset(self) -> None:
        """Forget the last commit's time (a re-form: the next interval is not a step)."""
        self._last, self._stall, self._pending, self._copy = None, 0.0, 0, None
