"""A job's history as goodput needs it: each node's worker groups, and the faults that ended them.

Runs in: the agent (its live goodput) and the CLI (``elastrun goodput`` / ``timeline``).

:func:`nodes_of` reads one node's events into its groups (a round's workers, from the round
closing to the group's end) and :func:`faults_of` groups every early end across nodes into
:class:`Fault` objects, one per new round, with the fault's kind, time and detection.  Used by
:mod:`elastrun.observe.goodput`, which classifies every second against them.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

from elastrun.shared.steplog import STEP, ProcessLog

#: Agent events that end a worker group early (the node's detection of a fault or change).
_ENDING = ("worker_failure", "hang_detected", "restart", "nodes_waiting", "signal")
_SILENT_FOR = re.compile(r"no heartbeat for ([\d.]+) s")


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
class Run:
    """One slot's worker in one group."""

    pid: Any
    start: float
    kept: bool
    exit_at: float | None = None
    ok: bool = False
    first_beat: float | None = None


@dataclass
class Group:
    """One round's workers on one node: from the round closing to the group's end (``how``: ok, fault, open)."""

    round: int
    rdzv_start: float
    closed: float
    end: float | None = None
    how: str = "open"  # ok, fault, open
    runs: dict[int, Run] = field(default_factory=dict)
    fault: Fault | None = None  # the fault that ended it
    after: Fault | None = None  # the fault that formed it


@dataclass
class Node:
    """One agent's history: its events, its groups, and when its slots end (``end``: exit, loss or now)."""

    node: str
    nproc: int
    start: float
    exit: float | None
    last_seen: float
    events: list[dict[str, Any]]
    groups: list[Group] = field(default_factory=list)
    open_rdzv: float | None = None  # a round_start with no round_closed after it
    end: float = 0.0
    lost_at: float | None = None


def nodes_of(events: list[dict[str, Any]]) -> dict[str, Node]:
    by_node: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_node.setdefault(str(e.get("node")), []).append(e)
    nodes = {}
    for name, evs in by_node.items():
        first = next((e for e in evs if e.get("event") == "agent_start"), evs[0])
        exit_ev = next((e for e in evs if e.get("event") == "agent_exit"), None)
        node = Node(name, int(first.get("nproc") or 1), float(first["ts"]),
                     float(exit_ev["ts"]) if exit_ev else None, float(evs[-1]["ts"]), evs)
        _groups(node)
        nodes[name] = node
    return nodes


def _groups(node: Node) -> None:
    rdzv: float | None = None
    group: Group | None = None
    for e in node.events:
        kind, ts = e.get("event"), float(e["ts"])
        if kind == "round_start":
            if group is not None and group.end is None:
                group.end, group.how = ts, "fault"
            rdzv = ts
        elif kind == "join_resumed":  # a deferred first join: the wait was this node's own start-up
            rdzv = ts
        elif kind == "round_closed":
            group = Group(int(e.get("round", 0)), rdzv if rdzv is not None else ts, ts)
            node.groups.append(group)
            rdzv = None
        elif group is None:
            continue
        elif kind == "worker_start":
            group.runs[int(e.get("local_rank", 0))] = Run(e.get("pid"), ts, e.get("start_method") == "kept")
        elif kind == "worker_exit":
            run = group.runs.get(int(e.get("local_rank", 0)))
            if run is not None and run.exit_at is None:
                run.exit_at, run.ok = ts, e.get("exitcode") == 0 and not e.get("signal")
                if not run.ok and group.end is None:
                    group.end, group.how = ts, "fault"
                elif group.end is None and all(r.ok for r in group.runs.values()):
                    # Every worker finished: the group's end is known now, not at the agent's exit (a
                    # live figure taken at the exit barrier must not count the script's end as a step).
                    group.end, group.how = ts, "ok"
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
def faults_of(nodes: dict[str, Node], logs: dict[tuple[str, Any], ProcessLog]) -> list[Fault]:
    """Group every early group end (and lost node) into faults, keyed by the round they led to.

    A node whose group ended for good (pre-empted: ``SIGTERM``, its agent gone after it) leads to no
    round of its own: its end joins the round the others formed without it (their ``node_lost``),
    else (every node stopped at once) the other ends of its round.  Keyed all alike, every
    pre-emption of a job was one fault, timed at the first: each later pre-empted node's whole
    training counted as that fault's restart (a soak of 15 minutes: 129 worker-s of 3,153).
    """
    lost_in: dict[str, tuple[int, str]] = {}
    for node in nodes.values():
        for e in node.events:
            if e.get("event") == "node_lost":
                for n in e.get("lost") or []:
                    lost_in.setdefault(str(n), (int(e.get("round", 0)), str((e.get("causes") or {}).get(n, ""))))
    by_round: dict[Any, list[tuple[Node, Group]]] = {}
    for node in nodes.values():
        for i, g in enumerate(node.groups):
            if g.how != "fault":
                continue
            if i + 1 < len(node.groups):
                key: Any = node.groups[i + 1].round
            elif node.node in lost_in:
                key = lost_in[node.node][0]
            else:
                key = ("ended in", g.round)
            by_round.setdefault(key, []).append((node, g))
    for name, (rnd, _) in lost_in.items():
        node = nodes.get(name)
        if node is not None and node.groups and node.groups[-1].end is None and node.exit is None:
            by_round.setdefault(rnd, []).append((node, node.groups[-1]))
    faults = []
    for key, ends in sorted(by_round.items(), key=lambda kv: min(g.end or kv[1][0][0].last_seen for _, g in kv[1])):
        rnd = key if isinstance(key, int) else None
        fault = _describe(len(faults), rnd, ends, lost_in, nodes, logs)
        for _, g in ends:
            g.fault = fault
        faults.append(fault)
    for node in nodes.values():
        for g in node.groups:
            g.after = next((f for f in faults if f.round == g.round), None)
    return faults


def _next_closed(node: Node, g: Group) -> float:
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


def _alive_in_commit(logs: dict[tuple[str, Any], ProcessLog], victims: list[tuple[str, Any]], at: float,
                     detected: float) -> float:
    """``at`` (the victims' last step end), or later when their peers' records prove they lived on.

    Every ``commit()`` of a group of more than one rank makes one all-reduce of its flags, so a step
    that any rank of the group finished recording was in every rank's commit: a victim (a hung,
    killed or lost rank) whose own record of that step is missing was stopped after taking part in
    it (between the all-reduce and its record).  The fault is then at the end of the earliest
    peer's record of the first step past the victims' last one, before the detection; without it,
    the peers' whole step (rolled back) counted as the hang's and the victim's as nothing cut short.
    """
    last: tuple[int, int] | None = None  # (round, step) of the victims' last recorded step
    for key in victims:
        for r in reversed(logs[key].records if key in logs else []):
            if r.kind == STEP and r.t2 <= detected:
                last = max(last, (r.round, r.step)) if last else (r.round, r.step)
                break
    if last is None:
        return at
    later: list[tuple[int, float]] = []
    for key, plog in logs.items():
        if key in victims:
            continue
        records = plog.records  # in time order: start at the detection, not at the end of a long job
        for i in range(bisect_right(records, detected, key=lambda r: r.end) - 1, -1, -1):
            r = records[i]
            if r.kind != STEP or r.t2 > detected:
                continue
            if r.round != last[0] or r.step <= last[1]:
                break
            later.append((r.step, r.t2))
    if not later:
        return at
    first = min(s for s, _ in later)
    return max(at, min(t2 for s, t2 in later if s == first))


def _describe(index: int, rnd: int | None, ends: list[tuple[Node, Group]], lost_in: dict[str, tuple[int, str]],
              nodes: dict[str, Node], logs: dict[tuple[str, Any], ProcessLog]) -> Fault:
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
        at = _alive_in_commit(logs, [k for k in logs if k[0] in names], at, detected)
        why = lost_in[names[0]][1]
        # a node that left on a signal (pre-empted: its agent got SIGTERM) says so
        stopped_by = next((str(e["signal"]) for n in lost for e in n.events if e.get("event") == "signal"
                           and e.get("signal") and float(e["ts"]) <= detected), None)
        hosts = ", ".join(host(n) for n in names)
        label = (f"node {hosts} left ({stopped_by} received)" if stopped_by else
                 f"node {hosts} lost" + (f" ({why})" if why else ""))
        return Fault(index, "node_lost", min(at, detected), detected, label, rnd, names[0])
    ordered = sorted(window, key=lambda ne: ne[1]["ts"])
    first = {k: next(((n, e) for n, e in ordered if e.get("event") == k), None)
             for k in ("hang_detected", "worker_failure", "nodes_waiting", "signal", "restart")}
    # A failure on a peer's closed connection (``peer_error``) is the consequence of one that is not.
    first["worker_failure"] = next(((n, e) for n, e in ordered if e.get("event") == "worker_failure"
                                    and not e.get("peer_error")), first["worker_failure"])
    # Of a crash, a join and a signal, the one reported first is the fault; what other nodes report
    # after it is its consequence: a node that stops its workers for a joining node kills their
    # collectives, and a peer's agent may see its own worker die of that before it reads the
    # rendezvous's news (a worker_failure after the join's nodes_waiting).
    cause = min((first[k] for k in ("worker_failure", "nodes_waiting", "signal") if first[k]),
                key=lambda ne: float(ne[1]["ts"]), default=None)
    if first["hang_detected"]:
        n, e = first["hang_detected"]
        g = next(g for nn, g in ends if nn is n)
        run = g.runs.get(int(e.get("local_rank", 0)))
        at = _last_end(logs, n.node, float(e["ts"]), run.pid if run else None)
        m = _SILENT_FOR.search(str(e.get("reason", "")))
        if at is None and m:
            at = float(e["ts"]) - float(m[1])
        if at is not None and run is not None:
            at = _alive_in_commit(logs, [(n.node, run.pid)], at, detected)
        return Fault(index, "hang", min(at or float(e["ts"]), detected), detected,
                     f"rank {e.get('rank')} hung", rnd, n.node, e.get("rank"))
    if cause is not None and cause[1].get("event") == "worker_failure":
        n, e = cause
        culprit = _killed_peer(ordered, e) if e.get("peer_error") else None
        if culprit is not None:  # a killed worker whose agent reported no failure: the fault is its death
            cn, x = culprit
            return Fault(index, "worker_failure", _crash_moment(cn, x, logs, detected), detected,
                         f"rank {x.get('rank')} killed by {x['signal']}", rnd, cn.node, x.get("rank"))
        how = f"killed by {e['signal']}" if e.get("signal") else f"exit code {e.get('exitcode')}"
        return Fault(index, "worker_failure", _death_moment(n, e, logs, detected), detected,
                     f"rank {e.get('rank')} {how}", rnd, n.node, e.get("rank"))
    if cause is not None and cause[1].get("event") == "nodes_waiting":
        n, e = cause
        return Fault(index, "join", detected, detected, f"{e.get('count', 1)} node(s) joined", rnd, n.node)
    if cause is not None:
        n, e = cause
        return Fault(index, "signal", detected, detected, f"{e.get('signal')} received", rnd, n.node)
    reason = str(first["restart"][1].get("reason", "")) if first["restart"] else ""
    return Fault(index, "restart", detected, detected, reason or "the group was re-formed", rnd,
                 ends[0][0].node)


def _killed_peer(ordered: list[tuple[Node, dict[str, Any]]], failure: dict[str, Any]) -> tuple[Node, dict] | None:
    """For a failure on a peer's closed connection: the first worker of the same round killed by a
    signal (``worker_exit``), whose agent recorded its death as its group ended for the new round
    (``group.py``) without a failure of its own.  A worker killed by a signal did not fail of a peer."""
    return next(((n, x) for n, x in ordered if x.get("event") == "worker_exit" and x.get("signal")
                 and x.get("round") == failure.get("round") and x.get("rank") != failure.get("rank")), None)


def _death_moment(node: Node, failure: dict[str, Any], logs: dict[tuple[str, Any], ProcessLog],
                  detected: float) -> float:
    """The earliest moment the failed worker's death can have come, for a crash's ``at``.

    Its agent saw it running at ``alive_at`` (``worker_exit``), and it ended its last step record
    later or earlier: it died after both.  An agent short of CPU (a loaded host) reports a death
    late; that delay is the fault's detection, not work the fault cut short.  Without ``alive_at``
    (logs of older agents) the detection stands in, as it did.

    A worker that failed of a peer's closed connection (``peer_error``, the only failure reported
    when the culprit's own agent stopped its group for the new round before it saw the culprit's
    death) was alive, waiting on that peer, long after the fault: its last finished step bounds the
    fault instead (seen on two loaded cores: 0.6 s between the two, which counted as steps the fault
    cut short instead of its detection).
    """
    exits = [x for x in node.events if x.get("event") == "worker_exit" and float(x["ts"]) <= float(failure["ts"])
             and x.get("round") == failure.get("round") and x.get("local_rank") == failure.get("local_rank")]
    if failure.get("peer_error"):
        last = _last_end(logs, node.node, detected, exits[-1].get("pid") if exits else None)
        if last is not None:
            return min(detected, last)
    return _crash_moment(node, exits[-1], logs, detected) if exits else detected


def _crash_moment(node: Node, exit_: dict[str, Any], logs: dict[tuple[str, Any], ProcessLog],
                  detected: float) -> float:
    """The later of when the worker of ``exit_`` (a ``worker_exit``) was last seen running, the end
    of its last step record and a peer's record of a later commit (:func:`_alive_in_commit`): it died
    after all three (and by ``detected``, which stands in without ``alive_at``)."""
    if exit_.get("alive_at") is None:
        return detected
    seen = float(exit_["alive_at"])
    last = _last_end(logs, node.node, detected, exit_.get("pid"))
    at = min(detected, max(seen, last if last is not None else seen))
    return _alive_in_commit(logs, [(node.node, exit_.get("pid"))], at, detected)


def join_wait(node: Node, nodes: dict[str, Node]) -> float | None:
    """For a node that arrived while the job ran elsewhere: when the running group noticed it (else None)."""
    if not node.groups:
        return None
    arrived = node.groups[0].rdzv_start
    ends = [g.end for other in nodes.values() if other is not node for g in other.groups
            if g.closed <= arrived and (g.end is None or g.end > arrived)]
    if not ends:
        return None
    return min((e for e in ends if e is not None), default=node.groups[0].closed)


def set_backs(faults: list[Fault], nodes: dict[str, Node], logs: dict[tuple[str, Any], ProcessLog]) -> None:
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
