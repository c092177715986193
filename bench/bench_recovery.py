"""Recovery: a worker crash, a lost node and a joining node, each until all ranks step again.

- worker crash: ``--standalone``, 2 workers, rank 1 exits with code 1 at step 10 (once); from
  the crash (the mtime of the file it writes just before exiting) until every rank of the new
  attempt has stepped.  elastrun's time is broken down from its event log and the workload's
  phase timestamps.  The trial's goodput (launch to exit) is measured from the workload's own
  step log for both launchers (bench/goodput_steps.py).
- node loss: N agents (1 worker each) on loopback with ``--rdzv-backend=c10d``,
  ``--nnodes=N-1:N``; a non-host agent and its workers are SIGKILLed; until every rank of the
  (N-1)-rank world has stepped.
- node join: one agent with ``--nnodes=1:2`` steps alone; a second agent starts; until every
  rank of the 2-rank world has stepped.
- lone node: one agent of a ``--nnodes=1:2`` job, each launcher with its *default* last call
  (torchrun 30 s, elastrun 1 s); from the launch until its rank has stepped.

Both launchers get ``--rdzv-conf=is_host=...,last_call_timeout=1``: the host is the first agent
and the last call is elastrun's default (torchrun's is 30 s and would add ~29 s to its figures).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import LAUNCHERS, Row, Trial, free_port, launcher_argv, log, median, wait_for
from bench.goodput_steps import from_workload

CAP = 60.0  # longest wait for a recovery; a trial that takes longer counts as "did not recover"


def _phase_ends(trial: Trial, after: float) -> dict[str, float]:
    """The latest time each workload phase was reached by the processes started after ``after``."""
    events = trial.events()
    pids = {e["pid"] for e in events if e["ev"] == "proc" and e["value"] > after - 0.02}
    ends: dict[str, float] = {}
    first_step: dict[int, float] = {}
    for e in events:
        if e["pid"] not in pids:
            continue
        if e["ev"] == "step":
            first_step.setdefault(e["pid"], e["t"])
        else:
            value = e["value"] if e["ev"] == "proc" else e["t"]
            ends[e["ev"]] = max(ends.get(e["ev"], 0.0), value)
    if first_step:
        ends["step"] = max(first_step.values())
    return ends


def _agent_events(log_dir: Path) -> list[dict]:
    out = []
    for path in log_dir.glob("events-*.jsonl"):
        out.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return sorted(out, key=lambda e: e["ts"])


def worker_crash(which: str) -> tuple[float | None, dict[str, float], float | None]:
    """Seconds from the crash to every rank stepping, elastrun's breakdown, and the trial's goodput (%).

    Goodput is measured from the workload's own step log (bench/goodput_steps.py), launch to exit:
    the workload keeps no state, so both launchers redo the 10 steps before the crash.
    """
    trial = Trial(f"crash-{which}", env={"STEPS": "60", "STEP_SECONDS": "0.05", "CRASH_AT_STEP": "10",
                                          "CRASH_RANK": "1"})
    once = trial.dir / "crashed"
    trial.env["CRASH_ONCE_FILE"] = str(once)
    logs = trial.dir / "agent-logs"
    flags = ["--standalone", "--nproc-per-node=2", "--max-restarts=3"]
    if which == "elastrun":
        flags.append(f"--log-dir={logs}")
    try:
        launched = time.time()
        proc = trial.start(launcher_argv(which, flags))
        if not wait_for(once.exists, 120):
            log(f"crash {which}: never crashed\n{trial.output()}")
            return None, {}, None
        crash = once.stat().st_mtime
        back = wait_for(lambda: trial.all_ranks_stepped(2, after=crash), CAP)
        if back is None:
            log(f"crash {which}: no step of the new attempt within {CAP:g} s\n{trial.output()[-1500:]}")
            return None, {}, None
        phases = _breakdown(trial, crash, logs if which == "elastrun" else None)
        ended = wait_for(lambda: proc.poll() is not None and time.time(), CAP)
        good = None if ended is None or proc.returncode != 0 else \
            100 * from_workload(trial.events(), 2, launched, ended).ratio
        return back - crash, phases, good
    finally:
        trial.close()


def _breakdown(trial: Trial, crash: float, logs: Path | None) -> dict[str, float]:
    ends = _phase_ends(trial, crash)
    marks: list[tuple[str, float]] = [("crash", crash)]
    if logs is not None:
        events = _agent_events(logs)
        after = [e for e in events if e["ts"] >= crash - 0.01]

        def first(kind: str) -> float | None:
            return next((e["ts"] for e in after if e["event"] == kind), None)

        for label, kind in (("detection", "worker_exit"), ("stop (kill, reap, report)", "round_start"),
                            ("rendezvous", "round_closed")):
            ts = first(kind)
            if ts is not None:
                marks.append((label, ts))
        marks.append(("fork/exec until the script runs", ends.get("start", 0.0)))
    else:
        marks.append(("detection, stop, rendezvous, exec", ends.get("proc", 0.0)))
        marks.append(("interpreter start", ends.get("start", 0.0)))
    marks += [("imports (torch, DDP)", ends.get("imported", 0.0)), ("process-group init", ends.get("pg", 0.0)),
              ("DDP model", ends.get("ddp", 0.0)), ("first step", ends.get("step", 0.0))]
    phases = {}
    for (_, before), (label, at) in zip(marks, marks[1:], strict=False):
        if at and before:
            phases[label] = at - before
    return phases


def _multi_node_flags(which: str, port: int, nnodes: str, host: bool) -> list[str]:
    conf = f"is_host={'true' if host else 'false'},last_call_timeout=1"
    return [f"--nnodes={nnodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench", "--max-restarts=3", f"--rdzv-conf={conf}"]


def node_loss(which: str, agents: int) -> float | None:
    trial = Trial(f"loss-{which}-{agents}", env={"STEPS": "100000", "STEP_SECONDS": "0.05"})
    port = free_port()
    try:
        procs = []
        for i in range(agents):
            procs.append(trial.start(launcher_argv(which, _multi_node_flags(which, port, f"{agents - 1}:{agents}",
                                                                              i == 0))))
            if i == 0:
                time.sleep(0.5)
        if not wait_for(lambda: trial.all_ranks_stepped(agents, min_step=5), 120):
            log(f"node loss {which} {agents}: never formed\n{trial.output()}")
            return None
        killed = time.time()
        trial.kill_tree(procs[-1])
        back = wait_for(lambda: trial.all_ranks_stepped(agents - 1, after=killed), CAP)
        return None if back is None else back - killed
    finally:
        trial.close()


def node_join(which: str) -> float | None:
    trial = Trial(f"join-{which}", env={"STEPS": "100000", "STEP_SECONDS": "0.05"})
    port = free_port()
    try:
        trial.start(launcher_argv(which, _multi_node_flags(which, port, "1:2", True)))
        if not wait_for(lambda: trial.all_ranks_stepped(1, min_step=5), 120):
            log(f"node join {which}: first node never stepped\n{trial.output()}")
            return None
        joined = time.time()
        trial.start(launcher_argv(which, _multi_node_flags(which, port, "1:2", False)))
        back = wait_for(lambda: trial.all_ranks_stepped(2, after=joined), CAP)
        if back is None:
            log(f"node join {which}: no step at world size 2 within {CAP:g} s\n{trial.output()[-1500:]}")
        return None if back is None else back - joined
    finally:
        trial.close()


def lone_node(which: str) -> float | None:
    trial = Trial(f"lone-{which}", env={"STEPS": "100000", "STEP_SECONDS": "0.05"})
    flags = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
             "--rdzv-id=bench"]
    try:
        launched = time.time()
        trial.start(launcher_argv(which, flags))
        first = wait_for(lambda: trial.all_ranks_stepped(1), 120)
        if first is None:
            log(f"lone node {which}: no step within 120 s\n{trial.output()[-1500:]}")
        return None if first is None else first - launched
    finally:
        trial.close()


def side_by_side(repeat: int, label: str, measure: Callable[[str], float | None]) -> dict[str, list]:
    """``measure`` each launcher ``repeat`` times, alternating them: {launcher: [seconds or None]}."""
    got: dict[str, list] = {w: [] for w in LAUNCHERS}
    for i in range(repeat):
        for which in LAUNCHERS:
            took = measure(which)
            log(f"{label} {which} #{i}: {took}")
            got[which].append(took)
    return got


def run(repeat: int) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []
    crash: dict[str, list] = {w: [] for w in LAUNCHERS}
    good: dict[str, list] = {w: [] for w in LAUNCHERS}
    phases: dict[str, list[dict]] = {w: [] for w in LAUNCHERS}
    for i in range(repeat):
        for which in LAUNCHERS:
            took, parts, ratio = worker_crash(which)
            log(f"worker crash {which} #{i}: {took} {parts} goodput {ratio}")
            crash[which].append(took)
            good[which].append(ratio)
            phases[which].append(parts)
    rows.append(Row("worker crash → all ranks stepping again", crash["torchrun"], crash["elastrun"], goal="≤ 0.30"))
    rows.append(Row("worker crash trial: goodput, launch to exit (workload's step log)", good["torchrun"],
                    good["elastrun"], unit="%", note="60 steps of 0.05 s, 10 redone by both"))
    for which in LAUNCHERS:
        labels = list(dict.fromkeys(k for p in phases[which] for k in p))
        parts = ", ".join(f"{k} {median(p.get(k) for p in phases[which]):.2f} s" for k in labels)
        notes.append(f"worker-crash breakdown, {which} (medians): {parts}.")
    for agents in (2, 3):
        loss = side_by_side(repeat, f"node loss agents={agents}", lambda which, n=agents: node_loss(which, n))
        rows.append(Row(f"node loss → survivors' next step, {agents} agents", loss["torchrun"], loss["elastrun"],
                        note=f"— = no step within {CAP:g} s"))
    join = side_by_side(repeat, "node join", node_join)
    rows.append(Row("node join → first step at the new world size", join["torchrun"], join["elastrun"],
                    note=f"— = no step within {CAP:g} s"))
    lone = side_by_side(repeat, "lone node", lone_node)
    rows.append(Row("lone node of a 1:2 job: launch → first step (default last call)", lone["torchrun"],
                    lone["elastrun"]))
    return rows, notes
