"""Goodput and badput of a job, computed from its agents' events and its workers' step records.

The definition (docs/observe.md, "Goodput"): every second of every worker slot (a node's
``--nproc-per-node`` places, from its agent's start to its exit) is *good* when it was spent
inside a step that was committed and never redone, and otherwise *badput* of exactly one cause
(:data:`CAUSES`).  Wall seconds classify each moment of the job once: good while any slot is in a
kept step, else the first cause present in :data:`WALL_ORDER`.  Each fault (a crash, a lost
node, a hang, a join, a signal) carries the badput it caused.

Pure computation: :func:`compute` takes event dicts (:func:`elastrun.observe.events.read_log_dir`)
and step logs (:func:`elastrun.observe.steplog.read_dirs`) and returns a :class:`Goodput`;
nothing here starts, reads a clock (``now`` is a parameter) or imports torch.
:mod:`elastrun.observe.goodput_report` formats the result.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any

from elastrun.observe.steplog import BLOCKED, RESTORE, STEP, ProcessLog, Record

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
#: Agent events that end a worker group early (the node's detection of a fault or change).
_ENDING = ("worker_failure", "hang_detected", "restart", "nodes_waiting", "signal")
_SILENT_FOR = re.compile(r"no heartbeat for ([\d.]+) s")


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
class Fault:
    """One fault or change that re-formed the job, and the badput it caused (device-seconds by cause)."""

    index: int
    kind: str  # worker_failure, node_lost, hang, join, signal, restart
    at: float
    detected: float
    label: str
    round: int | None
    node: str = ""
    rank: int | None = None
    #: When every slot of the new group stepped again (restore returned / first heartbeat), or None.
    back: float | None = None
    cost: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.cost.values())


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
    live: bool = False
    restore_sources: dict[str, float] = field(default_factory=dict)

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


# ---------------------------------------------------------------------------------------- a node's history
@dataclass
class _Run:
    """One slot's worker in one group."""

    pid: Any
    start: float
    kept: bool
    exit_at: float | None = None
    ok: bool = False
    first_beat: float | None = None


@dataclass
class _Group:
    round: int
    rdzv_start: float
    closed: float
    end: float | None = None
    how: str = "open"  # ok, fault, open
    runs: dict[int, _Run] = field(default_factory=dict)
    fault: Fault | None = None  # the fault that ended it
    after: Fault | None = None  # the fault that formed it


@dataclass
class _Node:
    node: str
    nproc: int
    start: float
    exit: float | None
    last_seen: float
    events: list[dict[str, Any]]
    groups: list[_Group] = field(default_factory=list)
    open_rdzv: float | None = None  # a round_start with no round_closed after it
    end: float = 0.0
    lost_at: float | None = None


def _nodes(events: list[dict[str, Any]]) -> dict[str, _Node]:
    by_node: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_node.setdefault(str(e.get("node")), []).append(e)
    nodes = {}
    for name, evs in by_node.items():
        first = next((e for e in evs if e.get("event") == "agent_start"), evs[0])
        exit_ev = next((e for e in evs if e.get("event") == "agent_exit"), None)
        node = _Node(name, int(first.get("nproc") or 1), float(first["ts"]),
                     float(exit_ev["ts"]) if exit_ev else None, float(evs[-1]["ts"]), evs)
        _groups(node)
        nodes[name] = node
    return nodes


def _groups(node: _Node) -> None:
    rdzv: float | None = None
    group: _Group | None = None
    for e in node.events:
        kind, ts = e.get("event"), float(e["ts"])
        if kind == "round_start":
            if group is not None and group.end is None:
                group.end, group.how = ts, "fault"
            rdzv = ts
        elif kind == "round_closed":
            group = _Group(int(e.get("round", 0)), rdzv if rdzv is not None else ts, ts)
            node.groups.append(group)
            rdzv = None
        elif group is None:
            continue
        elif kind == "worker_start":
            group.runs[int(e.get("local_rank", 0))] = _Run(e.get("pid"), ts, e.get("start_method") == "kept")
        elif kind == "worker_exit":
            run = group.runs.get(int(e.get("local_rank", 0)))
            if run is not None and run.exit_at is None:
                run.exit_at, run.ok = ts, e.get("exitcode") == 0 and not e.get("signal")
                if not run.ok and group.end is None:
                    group.end, group.how = ts, "fault"
        elif kind == "worker_stepping":
            run = group.runs.get(int(e.get("local_rank", 0)))
            if run is not None and run.first_beat is None:
                run.first_beat = float(e.get("first_heartbeat", ts))
        elif kind in _ENDING and group.end is None:
            group.end, group.how = ts, "fault"
        elif kind in ("agent_exit", "job_failed") and group.end is None:
            if group.runs and all(r.ok for r in group.runs.values()):
                group.end, group.how = max(r.exit_at or ts for r in group.runs.values()), "ok"
            else:
                group.end, group.how = ts, "fault"
    node.open_rdzv = rdzv


# ---------------------------------------------------------------------------------------- faults
def _faults(nodes: dict[str, _Node], logs: dict[tuple[str, Any], ProcessLog]) -> list[Fault]:
    """Group every early group end (and lost node) into faults, keyed by the round they led to."""
    by_round: dict[int | None, list[tuple[_Node, _Group]]] = {}
    for node in nodes.values():
        for i, g in enumerate(node.groups):
            if g.how != "fault":
                continue
            nxt = node.groups[i + 1].round if i + 1 < len(node.groups) else None
            by_round.setdefault(nxt, []).append((node, g))
    lost_in: dict[str, tuple[int, str]] = {}
    for node in nodes.values():
        for e in node.events:
            if e.get("event") == "node_lost":
                for n in e.get("lost") or []:
                    lost_in.setdefault(str(n), (int(e.get("round", 0)), str((e.get("causes") or {}).get(n, ""))))
    for name, (rnd, _) in lost_in.items():
        node = nodes.get(name)
        if node is not None and node.groups and node.groups[-1].end is None and node.exit is None:
            by_round.setdefault(rnd, []).append((node, node.groups[-1]))
    faults = []
    for rnd, ends in sorted(by_round.items(), key=lambda kv: min(g.end or kv[1][0][0].last_seen for _, g in kv[1])):
        fault = _describe(len(faults), rnd, ends, lost_in, nodes, logs)
        for _, g in ends:
            g.fault = fault
        faults.append(fault)
    for node in nodes.values():
        for g in node.groups:
            g.after = next((f for f in faults if f.round == g.round), None)
    return faults


def _next_closed(node: _Node, g: _Group) -> float:
    """When the node's next group formed after ``g`` (or its last event): the events of ``g``'s end lie before."""
    later = [h.closed for h in node.groups if h.closed > g.closed]
    return min(later) if later else node.last_seen


def _last_end(logs: dict[tuple[str, Any], ProcessLog], node: str | None, before: float,
              pid: Any = None) -> float | None:
    best = None
    for (n, p), plog in logs.items():
        if (node is not None and n != node) or (pid is not None and p != pid):
            continue
        for r in reversed(plog.records):
            if r.end <= before:
                best = max(best or r.end, r.end)
                break
    return best


def _describe(index: int, rnd: int | None, ends: list[tuple[_Node, _Group]], lost_in: dict[str, tuple[int, str]],
              nodes: dict[str, _Node], logs: dict[tuple[str, Any], ProcessLog]) -> Fault:
    lost = [n for n, g in ends if n.node in lost_in and lost_in[n.node][0] == rnd]
    detections = [g.end for n, g in ends if g.end is not None and n not in lost]
    detected = min(detections) if detections else max(n.last_seen for n, _ in ends)
    window = [(n, e) for n, g in ends for e in n.events if g.closed <= float(e["ts"]) <= _next_closed(n, g)]

    def host(name: str) -> str:
        start = next((e for e in nodes[name].events if e.get("event") == "agent_start"), {})
        return f"{start.get('hostname', name)} (pid {start.get('pid', '?')})" if start else name

    if lost:
        names = [n.node for n in lost]
        at = max((t for t in (_last_end(logs, n, detected) for n in names) if t is not None), default=None)
        if at is None:
            at = _last_end(logs, None, detected) or min(n.last_seen for n in lost)
        why = lost_in[names[0]][1]
        label = f"node {', '.join(host(n) for n in names)} lost" + (f" ({why})" if why else "")
        return Fault(index, "node_lost", min(at, detected), detected, label, rnd, names[0])
    first = {k: next(((n, e) for n, e in sorted(window, key=lambda ne: ne[1]["ts"]) if e.get("event") == k), None)
             for k in ("hang_detected", "worker_failure", "nodes_waiting", "signal", "restart")}
    if first["hang_detected"]:
        n, e = first["hang_detected"]
        g = next(g for nn, g in ends if nn is n)
        run = g.runs.get(int(e.get("local_rank", 0)))
        at = _last_end(logs, n.node, float(e["ts"]), run.pid if run else None)
        m = _SILENT_FOR.search(str(e.get("reason", "")))
        if at is None and m:
            at = float(e["ts"]) - float(m[1])
        return Fault(index, "hang", min(at or float(e["ts"]), detected), detected,
                     f"rank {e.get('rank')} hung", rnd, n.node, e.get("rank"))
    if first["worker_failure"]:
        n, e = first["worker_failure"]
        how = f"killed by {e['signal']}" if e.get("signal") else f"exit code {e.get('exitcode')}"
        return Fault(index, "worker_failure", detected, detected, f"rank {e.get('rank')} {how}", rnd, n.node,
                     e.get("rank"))
    if first["nodes_waiting"]:
        n, e = first["nodes_waiting"]
        return Fault(index, "join", detected, detected, f"{e.get('count', 1)} node(s) joined", rnd, n.node)
    if first["signal"]:
        n, e = first["signal"]
        return Fault(index, "signal", detected, detected, f"{e.get('signal')} received", rnd, n.node)
    reason = str(first["restart"][1].get("reason", "")) if first["restart"] else ""
    return Fault(index, "restart", detected, detected, reason or "the group was re-formed", rnd,
                 ends[0][0].node)


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


def _slot_spans(node: _Node, slot: int, logs: dict[tuple[str, Any], ProcessLog], rollbacks: _Rollbacks,
                joined_idle: float | None, out: list[Span]) -> set[str]:
    """Append the spans of one slot over its node's life; returns the bases used (steps, heartbeats, none)."""
    bases: set[str] = set()

    def add(a: float, b: float, cause: str, fault: Fault | None = None, detail: str = "", inner: float = 0.0) -> None:
        a, b = max(a, node.start), min(b, node.end)
        if b > a:
            out.append(Span(node.node, slot, a, b, cause, fault.index if fault else None, detail, min(inner, b - a)))

    first_rdzv = node.groups[0].rdzv_start if node.groups else (node.open_rdzv or node.end)
    add(node.start, first_rdzv, "startup", detail="agent set-up")
    prev_end: float | None = None
    prev: _Group | None = None
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
            stop = run.exit_at if run.ok and run.exit_at is not None else end
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


def _run_spans(node: _Node, g: _Group, run: _Run, stop: float, pre: str, pre_fault: Fault | None,
               logs: dict[tuple[str, Any], ProcessLog], rollbacks: _Rollbacks, put) -> str:
    plog = logs.get((node.node, run.pid))
    recs: list[Record] = []
    if plog is not None:
        recs = [r for r in plog.records if r.t1 > run.start - 1e-3 and r.t0 < stop + 1e-3]
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
    block: list | None = None  # kept steps back to back: [start, end, commit seconds, first step, last step]
    # From the fault on, a slot's time belongs to the fault: a step that a hung peer held up, then
    # finished, spent that time waiting on the hang, whatever happened to the step afterwards.
    limit = min(stop, fault.at) if fault is not None and g.how != "ok" else stop

    def rec(a: float, b: float, cause: str, fault: Fault | None = None, detail: str = "", inner: float = 0.0) -> None:
        add(a, min(b, limit), cause, fault, detail, inner)

    def flush() -> None:
        nonlocal block
        if block is not None:
            what = f"step {block[3]}" if block[3] == block[4] else f"steps {block[3]}-{block[4]}"
            rec(block[0], block[1], "good", detail=what, inner=block[2])
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
                block[1], block[2], block[4] = r.t2, block[2] + (r.t2 - r.t1), r.step
            else:
                flush()
                block = [r.t0, r.t2, r.t2 - r.t1, r.step, r.step]
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
    nodes = _nodes(events)
    faults = _faults(nodes, logs)
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
    rollbacks = _Rollbacks(restores, faults)
    spans: list[Span] = []
    bases: set[str] = set()
    for node in nodes.values():
        idle_until = _join_wait(node, nodes)
        for slot in range(node.nproc):
            bases |= _slot_spans(node, slot, logs, rollbacks, idle_until, spans)
    spans.sort(key=lambda s: (s.start, s.node, s.slot))
    _backs(faults, nodes, logs)
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
                   wall_bad, faults, spans, basis, live=now is not None, restore_sources=sources)


def _join_wait(node: _Node, nodes: dict[str, _Node]) -> float | None:
    """For a node that arrived while the job ran elsewhere: when the running group noticed it (else None)."""
    if not node.groups:
        return None
    arrived = node.groups[0].rdzv_start
    ends = [g.end for other in nodes.values() if other is not node for g in other.groups
            if g.closed <= arrived and (g.end is None or g.end > arrived)]
    if not ends:
        return None
    return min((e for e in ends if e is not None), default=node.groups[0].closed)


def _backs(faults: list[Fault], nodes: dict[str, _Node], logs: dict[tuple[str, Any], ProcessLog]) -> None:
    """When each fault's new group stepped again: every slot's first step (or first heartbeat) in that round."""
    for f in faults:
        firsts = []
        for node in nodes.values():
            for g in node.groups:
                if g.round != f.round:
                    continue
                for run in g.runs.values():
                    plog = logs.get((node.node, run.pid))
                    rec = next((r for r in (plog.records if plog else []) if r.kind == STEP and r.t0 >= g.closed),
                               None)
                    t = rec.t0 if rec is not None else run.first_beat
                    firsts.append(t)
        if firsts and all(t is not None for t in firsts):
            f.back = max(t for t in firsts if t is not None)


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
