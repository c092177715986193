"""What the workers of goodput_job.py saw, from their own logs and the test's fault times.

Independent of elastrun's step records: each worker timed its own steps, commits and restores;
the test knows which processes each fault hit, and a fault is placed at their last sign of life in
these logs (:func:`_when_it_hit`).  Only the moment an agent *knew* of a fault (its detection) comes
from the event log, because no worker can see it.  See docs/observe.md
("How accurate it is") for what is compared and the tolerance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

#: Faults after which the victims' node is gone: its slots end with it.
_NODE_GONE = ("node_loss", "preemption")


@dataclass
class Injection:
    """A fault the test caused: ``kind`` (crash, hang, node_loss, join, preemption), when, and the worker
    pids it hit.

    ``joined``, for a join: when the joining node's first round formed (from the event log, like
    the detection: no worker exists yet to see it).  Once the running group knows of the join, the
    new node's slot waits in that rendezvous for the others to stop: the join's cost, as
    docs/observe.md counts it (the fault carries the next rendezvous of every slot).
    """

    kind: str
    t: float
    pids: list[int] = field(default_factory=list)
    joined: float | None = None


@dataclass
class Proc:
    pid: int
    steps: list[tuple[int, float, float, float]] = field(default_factory=list)  # n, t0, t1, t2
    resumes: list[tuple[float, float, int]] = field(default_factory=list)  # began, ended, step restored
    restores: list[tuple[float, float]] = field(default_factory=list)


def read_truth(truth_dir: Path) -> dict[int, Proc]:
    procs: dict[int, Proc] = {}
    for path in truth_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a torn line of a killed worker
            p = procs.setdefault(int(e["pid"]), Proc(int(e["pid"])))
            if e["ev"] == "step":
                p.steps.append((int(e["n"]), e["t0"], e["t1"], e["t2"]))
            elif e["ev"] == "restore":
                p.resumes.append((e["t0"], e["t1"], int(e["step"])))
                p.restores.append((e["t0"], e["t1"]))
            elif e["ev"] == "enter":
                p.resumes.append((e["t"], e["t"], int(e["step"])))
    for p in procs.values():
        p.steps.sort(key=lambda s: s[1])
        _from_the_last_commit(p)
    return procs


def _from_the_last_commit(p: Proc) -> None:
    """Start each step where the process's previous one ended, as elastrun counts a step (docs/observe.md:
    from the previous ``commit()`` returning): the loop's own work between two steps (goodput_job.py's log
    line and stop-file check, 0.3-0.4 ms a step) is part of the next.  Not across a resume, whose step
    starts when the worker's own clock read says (the documented limit: elastrun counts the script's
    work before its first forward as that step's)."""
    resumed = [r[0] for r in p.resumes]
    for i in range(1, len(p.steps)):
        n, t0, t1, t2 = p.steps[i]
        prev_n, prev_end = p.steps[i - 1][0], p.steps[i - 1][3]
        if prev_n == n - 1 and prev_end <= t0 and not any(prev_end <= r <= t0 for r in resumed):
            p.steps[i] = (n, prev_end, t1, t2)


def _redone(procs: dict[int, Proc]) -> list[tuple[int, int, float, float]]:
    """(pid, n, t0, t2) of every step that a later resume rolled back."""
    resumes = sorted(r for p in procs.values() for r in p.resumes)
    out = []
    for p in procs.values():
        for n, t0, _, t2 in p.steps:
            if any(began > t2 and step < n for began, _, step in resumes):
                out.append((p.pid, n, t0, t2))
    return out


def truth(procs: dict[int, Proc], injections: list[Injection], detected: dict[int, float]) -> dict[str, float]:
    """Worker-seconds by what the workers saw: good, commit, redone, restore, detection, hang and per-fault costs.

    ``detected``: for each injection (by index), when the first agent knew (from the event log).
    """
    injections = [_when_it_hit(procs, inj, detected[i]) for i, inj in enumerate(injections)]
    redone = {(pid, n, t0) for pid, n, t0, _ in _redone(procs)}
    out = {"good": 0.0, "commit": 0.0, "redone": 0.0, "restore": 0.0, "detection": 0.0, "hang": 0.0}
    # A worker's time between a fault and its detection is the fault's (hang or detection), even
    # inside a step that a stopped peer held up and let finish later.
    windows = [(inj.t, detected[i]) for i, inj in enumerate(injections) if detected[i] > inj.t]

    def outside(a: float, b: float) -> float:
        return (b - a) - sum(max(0.0, min(b, w1) - max(a, w0)) for w0, w1 in windows)

    for p in procs.values():
        for n, t0, t1, t2 in p.steps:
            if (p.pid, n, t0) in redone:
                out["redone"] += outside(t0, t2)
            else:
                out["good"] += outside(t0, t1)
                out["commit"] += outside(t1, t2)
        out["restore"] += sum(b - a for a, b in p.restores)
    for i, inj in enumerate(injections):
        alive = [p for p in procs.values() if p.steps and p.steps[0][1] < inj.t and _alive_at(p, inj.t)]
        for p in alive:
            if any(s[1] <= inj.t < s[3] for s in p.steps):
                # the step in progress ended later (a join's pause waits for its commit; a peer's commit
                # can end just after a victim's last): kept, it is good, rolled back, redone, counted above
                continue
            last = max((s[3] for s in p.steps if s[3] <= inj.t), default=inj.t)
            out["redone"] += inj.t - last  # the step the fault cut short
        cause = "hang" if inj.kind == "hang" else "detection"
        # a lost (or pre-empted) node's slots end with it (docs/observe.md): only the survivors wait for the
        # detection
        waiting = [p for p in alive if not (inj.kind in _NODE_GONE and p.pid in inj.pids)]
        out[cause] += len(waiting) * max(0.0, detected[i] - inj.t)
        out[f"fault{i}"] = _fault_cost(procs, inj, alive, redone, detected[i])
    return out


def _when_it_hit(procs: dict[int, Proc], inj: Injection, detected: float) -> Injection:
    """The injection, at its victims' last sign of life in the workers' own logs before it was ``detected``.

    That is where docs/observe.md places a fault, and all anyone can know: the end of the victims' last
    step, or later, the end of the first later step that a peer finished (every ``commit()`` all-reduces
    its flags over the group, so the victim took part in that one).  What a victim did after that, until
    the signal landed, no log shows: it counts as the fault's detection or hang on both sides.

    The test's clock reading is not used: the test reads the clock, then signals, and in between the
    victim goes on stepping (under load its thread was once descheduled 0.6 s there).  Timed by the
    clock, the yardstick put up to a step per slot per fault (about 1 % of the job in all) under redone
    that elastrun, which cannot see the signal, put under detection.

    Only steps that ended before the detection count.  A hung (SIGSTOPped) victim is woken by its agent
    with SIGABRT and SIGCONT to dump its stacks, and it can finish the step it was stopped in before it
    dies: that step ends after the detection, and once moved the injection past it, so the hang's whole
    window (every slot's wait) was counted as commit and redone steps instead (CI, stop 43).
    """
    if not inj.pids or inj.kind == "join":
        return inj
    ends = [s for pid in inj.pids if pid in procs for s in procs[pid].steps if s[3] < detected]
    if not ends:
        return inj
    n, _, _, at = max(ends, key=lambda s: s[3])
    later = [s[3] for p in procs.values() if p.pid not in inj.pids for s in p.steps
             if s[0] == n + 1 and at - 1.0 < s[1] and s[3] < detected]
    return replace(inj, t=max([at, *later]))


def _alive_at(p: Proc, t: float) -> bool:
    """Whether the process was in the group at ``t``: it stepped before and after (or was cut short by t)."""
    before = [s for s in p.steps if s[3] <= t]
    after = [s for s in p.steps if s[1] >= t]
    return bool(before) and (bool(after) or before[-1][3] > t - 1.0)


def _fault_cost(procs: dict[int, Proc], inj: Injection, alive: list[Proc], redone: set, detected: float) -> float:
    """Each slot's gap from its last step before the fault to its first step after, plus the steps redone.

    A step that began between the fault and its detection is not the slot stepping again: its peers held
    it up (the test reads its clock, then signals, and a peer can begin its next step in between; counted
    as the slot's first step after the hang, the hang's 2 s vanished from that slot's cost)."""
    cost = 0.0
    resumes = sorted((r[0], p.pid) for p in procs.values() for r in p.resumes if r[0] > inj.t)
    cutoff = resumes[0][0] if resumes else inj.t
    for p in alive:
        last = max((s[3] for s in p.steps if s[3] <= inj.t), default=inj.t)
        nxt = [s[1] for s in p.steps if s[1] > max(inj.t, detected)]
        if inj.pids and p.pid in inj.pids and inj.kind in _NODE_GONE:
            cost += inj.t - last
            continue
        if nxt:  # the same process steps again (kept, et.run)
            cost += nxt[0] - last
        else:  # a new process took the slot: the first step of the next process in the new group
            cost += _next_first_step(procs, p, inj.t, cutoff) - last
    if inj.joined is not None:  # the new node's one slot, from the detection (inj.t) to its round forming
        cost += max(0.0, inj.joined - inj.t)
    for pid, n, t0 in redone:
        step = next(s for s in procs[pid].steps if s[0] == n and s[1] == t0)
        if step[3] <= inj.t and _rolled_back_by(procs, step, inj.t):
            cost += step[3] - step[1]
    return cost


def _next_first_step(procs: dict[int, Proc], old: Proc, t: float, cutoff: float) -> float:
    """First step of the process that replaced ``old`` (the new process whose first step comes first
    among those not yet matched; ranks may move, so the earliest unmatched start stands in)."""
    firsts = sorted(p.steps[0][1] for p in procs.values() if p.steps and p.steps[0][1] > t and p.pid != old.pid)
    return firsts[0] if firsts else t


def _rolled_back_by(procs: dict[int, Proc], step: tuple[int, float, float, float], t: float) -> bool:
    """Whether the first resume after ``t`` (the fault) restored a step below ``step``'s."""
    later = sorted(r for p in procs.values() for r in p.resumes if r[0] > t)
    return bool(later) and later[0][2] < step[0]
