"""Goodput from a workload's own step log: the same measure for torchrun and elastrun.

The benchmarks cannot use ``elastrun goodput`` for torchrun (it has no event log), so they
measure both launchers the same way, from what the training script itself logged: each step's
start and end and its position in the training (a step count, or an (epoch, batch) pair).  A step
is *kept* unless a later step that started after it ended has the same or an earlier position
(the work was redone after a restart).  Goodput is the kept steps' time over the worker slots'
time (slots x wall seconds, from the launch to the job's end); wall goodput is the share of wall
time covered by kept steps.  This is docs/observe.md's definition, seen from the script.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepTime:
    """One step as the script logged it: ``pos`` orders the training (``(n,)`` or ``(epoch, batch)``)."""

    pos: tuple
    t0: float
    t1: float


@dataclass
class StepGoodput:
    ratio: float
    wall_ratio: float
    kept: int
    redone: int
    kept_seconds: float
    redone_seconds: float
    slots: int
    wall: float

    def row(self) -> dict[str, Any]:
        return {"goodput": round(self.ratio, 4), "wall_goodput": round(self.wall_ratio, 4), "kept_steps": self.kept,
                "redone_steps": self.redone, "redone_seconds": round(self.redone_seconds, 2),
                "wall_seconds": round(self.wall, 1), "slots": self.slots}


def measure(steps: list[StepTime], slots: int, start: float, end: float) -> StepGoodput:
    """Goodput of ``steps`` (all workers, any order) for ``slots`` workers from ``start`` to ``end``."""
    order = sorted(steps, key=lambda s: s.t0)
    starts = [s.t0 for s in order]
    suffix_min: list[tuple] = [()] * len(order)
    low: tuple | None = None
    for i in range(len(order) - 1, -1, -1):
        low = order[i].pos if low is None or order[i].pos < low else low
        suffix_min[i] = low
    kept, redone = [], []
    for s in order:
        i = bisect.bisect_left(starts, s.t1)
        (redone if i < len(order) and suffix_min[i] <= s.pos else kept).append(s)
    covered, reach = 0.0, start
    for s in sorted(kept, key=lambda s: s.t0):
        a, b = max(s.t0, reach, start), min(s.t1, end)
        if b > a:
            covered += b - a
        reach = max(reach, s.t1)
    wall = max(end - start, 1e-9)
    kept_s = sum(max(0.0, min(s.t1, end) - max(s.t0, start)) for s in kept)
    return StepGoodput(kept_s / (slots * wall), covered / wall, len(kept), len(redone), kept_s,
                       sum(s.t1 - s.t0 for s in redone), slots, wall)


def from_workload(events: list[dict], slots: int, start: float, end: float) -> StepGoodput:
    """:func:`measure` on bench/workload.py or reform_workload.py events (``step`` with ``n``, ``t0``, ``t``).

    A step ends where ``commit()`` was called (``tc``) when the workload says so: time blocked in
    commit is badput, as in docs/observe.md.
    """
    steps = [StepTime((int(e["n"]),), float(e["t0"]), float(e.get("tc", e["t"]))) for e in events
             if e.get("ev") == "step" and "t0" in e]
    return measure(steps, slots, start, end)
