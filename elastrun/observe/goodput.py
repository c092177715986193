"""Goodput and badput of a job, computed from its agents' events and its workers' step records.

Runs in: the agent (its live goodput and end-of-job line) and the CLI (``elastrun goodput`` / ``timeline``).

The definition (docs/observe.md, "Goodput and badput"): every second of every worker slot (a node's
``--nproc-per-node`` places, from its agent's start to its exit) is *good* when it was spent
inside a step that was committed and never redone, and otherwise *badput* of exactly one cause
(:data:`CAUSES`).  Wall seconds classify each moment of the job once: good while any slot is in a
kept step, else the first cause present in :data:`WALL_ORDER`.  Each fault (a crash, a lost
node, a hang, a join, a signal) carries the badput it caused.

Pure computation: :func:`compute` takes event dicts (:func:`elastrun.observe.events.read_log_dir`)
and step logs (:func:`elastrun.shared.steplog.read_dirs`) and returns a :class:`Goodput`;
nothing here starts, reads a clock (``now`` is a parameter) or imports torch.
:mod:`elastrun.observe.goodput_report` formats the result.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from elastrun.observe.goodput_history import Fault, Group, Node, Run, faults_of, join_wait, nodes_of, set_backs
from elastrun.shared.steplog import BLOCKED, RESTORE, SPACING, STEP, ProcessLog, Record

#: Badput causes, in the order they are listed.
CAUSES = ("startup", "rendezvous", "detection", "restart", "restore", "redone", "commit", "hang", "idle", "unknown")
CAUSE_LABELS = {
    "good": "goodput: committed steps never redone",
    "startup": "start-up (interpreter, imports, model build; agent set-up)",
    "rendezvous": "rendezvous",
    "detection": "detection (fault to the agent knowing)",
    "restart": "stopping and restarting, or re-forming",
    "restore": "restoring state",
    "redone": "redone steps (and the step a fault cut short)",
    "commit": "blocked in commit() and checkpoints",
    "hang": "hang, until detected",
    "idle": "idle capacity (waiting to join, exit barrier)",
    "unknown": "not measured (workers without step records or heartbeats)",
}
#: Which cause a wall-clock moment takes when slots differ (good first).
WALL_ORDER = ("good", "redone", "commit", "restore", "hang", "detection", "restart", "rendezvous", "startup",
              "unknown", "idle")


@dataclass
class Span:
    """One interval of one worker slot (``node``, local rank ``slot``) with its cause (``good`` or badput)."""

    node: str
    slot: int
    start: float
    end: float
    cause: str
    fault: int | None = None
    detail: str = ""
    #: Seconds of ``commit`` inside a ``good`` span: back-to-back kept steps are one span (a long job has
    #: hundreds of thousands of steps), their commits counted here.
    inner: float = 0.0

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass
class Goodput:
    """The result of :func:`compute` (times are Unix times; seconds are device-seconds unless ``wall_``)."""

    run_id: str
    start: float
    end: float
    slots: int
    device_seconds: float
    good: float
    badput: dict[str, float]
    wall_good: float
    wall_badput: dict[str, float]
    faults: list[Fault]
    spans: list[Span]
    #: How progress was measured: ``steps`` (elastrun.train records), ``heartbeats``, ``none``, or ``mixed``.
    basis: str
    #: Measured while some node still ran (a figure "so far", not the job's final one).
    live: bool = False
    restore_sources: dict[str, float] = field(default_factory=dict)
    #: The memory snapshots' latest chosen spacing: (every k steps, a step's seconds, a
    #: snapshot's cost in seconds), or None (every commit, or not recorded).
    snapshots: tuple[int, float, float] | None = None

    @property
    def wall(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def ratio(self) -> float | None:
        """Goodput as a share of device-seconds (None for an empty job)."""
        return self.good / self.device_seconds if self.device_seconds > 0 else None

    @property
    def wall_ratio(self) -> float | None:
        return self.wall_good / self.wall if self.wall > 0 else None


# ---------------------------------------------------------------------------------------- slots
class _Rollbacks:
    """Restores, to tell which committed steps were redone later (and by which fault)."""

    def __init__(self, restores: list[tuple[float, int]], faults: list[Fault]) -> None:
        self.points = sorted(restores)
        self.times = [t for t, _ in self.points]
        self.suffix_min = [0] * len(self.points)
        low = None
        for i in range(len(self.points) - 1, -1, -1):
            low = self.points[i][1] if low is None else min(low, self.points[i][1])
            self.suffix_min[i] = low
        self.faults = sorted(faults, key=lambda f: f.at)
        self.fault_times = [f.at for f in self.faults]

    def redone_by(self, step: int, committed: float) -> Fault | None | bool:
        """False when the step was kept; else the fault whose restore rolled it back (None: no fault known)."""
        i = bisect.bisect_left(self.times, committed)
        if i >= len(self.points) or self.suffix_min[i] >= step:
            return False
        for t, s in self.points[i:]:
            if s < step:
                j = bisect.bisect_right(self.fault_times, t) - 1
                return self.faults[j] if j >= 0 else None
        return False


def _slot_spans(node: Node, slot: int, logs: dict[tuple[str, Any], ProcessLog], rollbacks: _Rollbacks,
                joined_idle: float | None, out: list[Span]) -> set[str]:
    """Append the spans of one slot over its node's life; returns the bases used (steps, heartbeats, none)."""
    bases: set[str] = set()

    def add(a: float, b: float, cause: str, fault: Fault | None = None, detail: str = "", inner: float = 0.0) -> None:
        a, b = max(a, node.start), min(b, node.end)
        if b > a:
            out.append(Span(node.node, slot, a, b, cause, fault.index if fault else None, detail, min(inner, b - a)))

    first_rdzv = node.groups[0].rdzv_start if node.groups else (node.open_rdzv or node.end)
    add(node.start, first_rdzv, "startup", detail="agent set-up (and its imports, where a join waited for them)")
    prev_end: float | None = None
    prev: Group | None = None
    for g in node.groups:
        if prev is not None and prev_end is not None:
            add(prev_end, g.rdzv_start, "restart", prev.fault, "stopping the workers")
        if prev is None and joined_idle is not None and joined_idle > g.rdzv_start:
            add(g.rdzv_start, min(joined_idle, g.closed), "idle", detail="waiting to join a running job")
            add(min(joined_idle, g.closed), g.closed, "rendezvous", g.after)
        else:
            add(g.rdzv_start, g.closed, "rendezvous", g.after if prev is not None else None)
        end = g.end if g.end is not None else node.end
        pre = "restart" if prev is not None else "startup"
        pre_fault = g.after if prev is not None else None
        run = g.runs.get(slot)
        if run is None:
            add(g.closed, end, "idle", detail="no worker of this slot in the round")
        else:
            add(g.closed, run.start, pre, pre_fault, "starting the workers")
            # a worker that ended well after its group did (pre-empted: it checkpoints, then exits 0) is
            # counted to the group's end; the node's tail after it is the fault's
            stop = min(run.exit_at, end) if run.ok and run.exit_at is not None else end
            bases.add(_run_spans(node, g, run, stop, pre, pre_fault, logs, rollbacks, add))
            if stop < end:
                add(stop, end, "idle", detail="worker done, others still running")
        prev, prev_end = g, end
    if prev is not None and prev_end is not None:
        if prev.how == "ok":
            add(prev_end, node.end, "idle", detail="exit barrier")
        elif node.open_rdzv is not None and node.open_rdzv >= prev_end:
            add(prev_end, node.open_rdzv, "restart", prev.fault, "stopping the workers")
            add(node.open_rdzv, node.end, "rendezvous", prev.fault)
        else:
            add(prev_end, node.end, "restart", prev.fault, "stopping the workers")
    elif node.open_rdzv is not None:
        add(node.open_rdzv, node.end, "rendezvous")
    return bases


def _run_spans(node: Node, g: Group, run: Run, stop: float, pre: str, pre_fault: Fault | None,
               logs: dict[tuple[str, Any], ProcessLog], rollbacks: _Rollbacks, put) -> str:
    plog = logs.get((node.node, run.pid))
    recs: list[Record] = []
    if plog is not None:
        recs = [r for r in plog.records if r.kind != SPACING and r.t1 > run.start - 1e-3 and r.t0 < stop + 1e-3]
    fault = g.fault

    def add(a: float, b: float, cause: str, fault: Fault | None = None, detail: str = "", inner: float = 0.0) -> None:
        put(max(a, run.start), min(b, stop), cause, fault, detail, inner)  # a step that ends after the stop is cut

    if not recs:
        if run.first_beat is None:
            add(run.start, stop, "unknown", detail="no step records or heartbeats")
            return "none"
        add(run.start, run.first_beat, pre, pre_fault, "until the first heartbeat")
        cut = min(stop, fault.at) if fault is not None else stop
        add(run.first_beat, cut, "good", detail="stepping (heartbeats: not known if kept)")
        _fault_tail(cut, stop, fault, add)
        return "heartbeats"
    cursor = run.start
    add(cursor, recs[0].t0, pre, pre_fault, "process start, imports, model build" if pre == "startup" else
        "re-forming or restarting the workers")
    cursor = recs[0].t0
    block: list | None = None  # kept steps back to back: [start, end, commit seconds, first step, last step,
    #                            the last step's commit() call]
    # From the fault on, a slot's time belongs to the fault: a step that a hung peer held up, then
    # finished, spent that time waiting on the hang, whatever happened to the step afterwards.
    limit = min(stop, fault.at) if fault is not None and g.how != "ok" else stop

    def rec(a: float, b: float, cause: str, fault: Fault | None = None, detail: str = "", inner: float = 0.0) -> None:
        add(a, min(b, limit), cause, fault, detail, inner)

    def flush() -> None:
        nonlocal block
        if block is not None:
            what = f"step {block[3]}" if block[3] == block[4] else f"steps {block[3]}-{block[4]}"
            rec(block[0], block[1], "good", detail=what, inner=block[2] - _cut_commit(block[5], block[1], limit))
            block = None

    for r in recs:
        if r.t0 >= limit:
            break
        if r.t0 > cursor + 1e-6:
            flush()
            add(cursor, r.t0, "unknown", detail="between records")
        by = rollbacks.redone_by(r.step, r.t2) if r.kind == STEP else True
        if by is False:
            if block is not None and r.t0 - block[1] < 1e-6:
                block[1], block[2], block[4], block[5] = r.t2, block[2] + (r.t2 - r.t1), r.step, r.t1
            else:
                flush()
                block = [r.t0, r.t2, r.t2 - r.t1, r.step, r.step, r.t1]
        else:
            flush()
            if r.kind == RESTORE:
                rec(r.t0, r.t1, "restore", pre_fault, f"from {r.source or 'fresh-start'} to step {r.step}")
            elif r.kind == BLOCKED:
                rec(r.t0, r.t1, "commit", detail="checkpoint() or flush()")
            elif r.kind == STEP:
                rec(r.t0, r.t2, "redone", by if isinstance(by, Fault) else None, f"step {r.step}, rolled back")
        cursor = min(max(cursor, r.end), limit)
    flush()
    if g.how == "ok":
        add(cursor, stop, "idle", detail="after the last step: the script's end")
    elif fault is None:
        add(cursor, stop, "good", detail="step in progress")
    else:
        cut = max(cursor, min(stop, fault.at))
        add(cursor, cut, "redone", fault, "the step the fault cut short")
        _fault_tail(cut, stop, fault, add)
    return "steps"


def _cut_commit(called: float, returned: float, limit: float) -> float:
    """Seconds of a kept step's ``commit()`` (``called`` to ``returned``) that lie past ``limit``.

    A slot's time from its group's fault on is the fault's (hang or detection, then restart): a
    commit held up by a hang (the hung worker's own, stopped inside it, or a peer's, waiting on it
    in a collective) and let through when the hang was detected (the agent wakes the hung worker
    with SIGCONT to dump its stacks, and it may run on for a moment before it dies) waited on the
    hang.
    The kept steps' span is cut at the fault, so its commit seconds must lose that part too: left
    in, they are charged to ``commit`` and taken out of the steps' goodput before the cut, while
    the same moments after the cut are charged to the hang.  Only the last step of a back-to-back
    run can reach past the cut (a record that starts past it is not classified).
    """
    return max(0.0, returned - max(called, limit))


def _fault_tail(cut: float, stop: float, fault: Fault | None, add) -> None:
    if fault is None:
        return
    seen = max(cut, min(stop, fault.detected))
    add(cut, seen, "hang" if fault.kind == "hang" else "detection", fault)
    add(seen, stop, "restart", fault, "stopping the workers")


# ---------------------------------------------------------------------------------------- the job
def compute(events: list[dict[str, Any]], logs: dict[tuple[str, Any], ProcessLog] | None = None,
            now: float | None = None) -> Goodput:
    """Goodput of the job the ``events`` (all nodes, any order) and ``logs`` (by (node, pid)) describe.

    ``now``: for a running job, the moment to measure up to (nodes without an ``agent_exit`` run
    until then).  Without it such nodes end at their last event or record.
    """
    events = sorted((e for e in events if "ts" in e), key=lambda e: float(e["ts"]))
    if not events:
        raise ValueError("no events: was the job run with --log-dir?")
    logs = logs or {}
    nodes = nodes_of(events)
    faults = faults_of(nodes, logs)
    for node in nodes.values():
        seen = [node.last_seen] + [r.end for (n, _), p in logs.items() if n == node.node for r in p.records[-1:]]
        lost = next((f for f in faults if f.kind == "node_lost" and f.node == node.node), None)
        if node.exit is not None:
            node.end = node.exit
        elif lost is not None:
            node.end = max(lost.at, node.start)
            node.lost_at = lost.at
        else:
            node.end = now if now is not None else max(seen)
    restores = [(r.t0, r.step) for p in logs.values() for r in p.records if r.kind == RESTORE]
    spacing = max(((r.t2, r) for p in logs.values() for r in p.records if r.kind == SPACING), default=(0, None))[1]
    rollbacks = _Rollbacks(restores, faults)
    spans: list[Span] = []
    bases: set[str] = set()
    for node in nodes.values():
        idle_until = join_wait(node, nodes)
        for slot in range(node.nproc):
            bases |= _slot_spans(node, slot, logs, rollbacks, idle_until, spans)
    spans.sort(key=lambda s: (s.start, s.node, s.slot))
    set_backs(faults, nodes, logs)
    start = min(n.start for n in nodes.values())
    end = max(n.end for n in nodes.values())
    badput = {c: 0.0 for c in CAUSES}
    good = 0.0
    sources: dict[str, float] = {}
    for s in spans:
        if s.cause == "good":
            good += s.seconds - s.inner
            badput["commit"] += s.inner
        else:
            badput[s.cause] += s.seconds
            if s.fault is not None:
                cost = faults[s.fault].cost
                cost[s.cause] = cost.get(s.cause, 0.0) + s.seconds
        if s.cause == "restore":
            src = s.detail.split(" ")[1] if s.detail.startswith("from ") else "?"
            sources[src] = sources.get(src, 0.0) + s.seconds
    wall_good, wall_bad = _wall(spans, start, end)
    basis = "none" if not bases - {"none"} else (bases.pop() if len(bases) == 1 else "mixed")
    run_id = next((str(e.get("run_id")) for e in events if e.get("event") == "agent_start"), "?")
    return Goodput(run_id, start, end, sum(n.nproc for n in nodes.values()),
                   sum(n.nproc * max(0.0, n.end - n.start) for n in nodes.values()), good, badput, wall_good,
                   wall_bad, faults, spans, basis, live=now is not None and any(n.exit is None and n.lost_at is None
                                                                                for n in nodes.values()),
                   restore_sources=sources,
                   snapshots=(spacing.step, spacing.t0, spacing.t1) if spacing is not None else None)


def _wall(spans: list[Span], start: float, end: float) -> tuple[float, dict[str, float]]:
    """Wall seconds: each moment takes the first cause in WALL_ORDER that any slot is in.

    While good spans are on top, the commits inside them (``Span.inner``) take their average share.
    """
    rank = {c: i for i, c in enumerate(WALL_ORDER)}
    marks: list[tuple[float, int, int, float]] = []
    for s in spans:
        if s.end > s.start:
            share = s.inner / (s.end - s.start)
            marks.append((s.start, 1, rank[s.cause], share))
            marks.append((s.end, -1, rank[s.cause], -share))
    marks.sort()
    counts = [0] * len(WALL_ORDER)
    totals = [0.0] * len(WALL_ORDER)
    commit_share = 0.0  # sum of the inner-commit shares of the good spans open now
    prev = start
    for t, delta, r, share in marks:
        if t > prev:
            top = next((i for i, c in enumerate(counts) if c > 0), None)
            if top == 0:  # good
                part = (t - prev) * min(1.0, max(0.0, commit_share / counts[0]))
                totals[0] += t - prev - part
                totals[rank["commit"]] += part
            elif top is not None:
                totals[top] += t - prev
            prev = t
        counts[r] += delta
        if r == 0:
            commit_share += share
    bad = {c: totals[rank[c]] for c in CAUSES}
    covered = sum(totals)
    bad["idle"] += max(0.0, (end - start) - covered)  # moments no slot existed (between nodes' lives)
    return totals[rank["good"]], bad
