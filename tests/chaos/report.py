"""The chaos report (docs/chaos.md): per fault kind, how fast faults were detected and recovered and
how many steps they cost, the invariants of every job, and the issue's goals against what was measured."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections import defaultdict

from tests.chaos.faults import QUIET_KINDS, WORKER_KINDS, Fault
from tests.chaos.harness import RunResult

NODE_GOAL_KINDS = ("agent_kill", "agent_term", "partition")

#: Where the recovery time goes (structural, from the agents' events and the settings used).
WHERE_TIME_GOES = """## Where the time goes

* **Worker killed or exiting 1**: the agent waits on each worker's pidfd, so detection is immediate
  (~0.03 s); the next round closes in ~0.1 s (with c10d and etcd), the workers are forked from the
  warm pool, restore from the memory snapshot and run their first step ~0.3 s after the fault.  This
  needs `--start-method=fork` (the harness passes it): with the CLI's default `spawn`, `--preload`
  is ignored and every restarted worker imports torch again — measured 3.6 s for `import torch` plus
  2.2 s for the first model and optimizer in each worker, ~6 s per restart on this machine.
* **Hung worker**: detected when its heartbeats have been silent for `--hang-timeout` (3 s here),
  counted from its last heartbeat, so detection comes at or just under 3 s after the SIGSTOP; the
  SIGABRT stack dump plus SIGKILL and restart add ~0.4 s.  Without `--hang-timeout` the timeout is
  learned (10 x the slowest step, at least 30 s): a hang then costs at least 30 s.
* **Agent SIGKILLed**: its watcher's liveness link to it closes at once, so detection is ~0.1 s
  (then ~0.2 s to the first step).  **Node cut off**: nothing closes, so detection is the liveness
  timeout — c10d's `heartbeat_timeout` (2.5 s, detection 2.5-3 s) and etcd's `lease_ttl` (3 s,
  whole seconds, so 3-4 s after the last renewal, up to 5 s measured).
* **Agent SIGTERMed (pre-emption)**: nothing times out: the workers finish the step, write a
  durable checkpoint and exit 0, the agent leaves the rendezvous and the others re-form (~1-2 s).
* **Node join**: a new agent process starts, its pool template imports torch (2-4 s on two busy
  cores), then it joins and the others restart; the first step at full size comes 3-7 s after the
  start, mostly spent in that import.
* **Slow node (SIGSTOP of a node's whole tree for 1 s) and etcd member kill**: below every timeout,
  nothing restarts; training stalls for the stop and goes on.
* **Through `et.run`**: the survivors are not restarted but paused (their group's sockets shut down,
  `et.Reform` raised in the training thread) and handed the next round in their own process; they
  roll back from their own objects (`live`) or their node's memory, so a worker fault or a lost node
  costs the rendezvous round and a new process group, no import, no model build.  The dead rank's
  new process still starts from the warm pool and restores from memory or a peer.  A hang costs
  `--reform-timeout` (5 s) more than with the plain loop: the agent asks the hung worker to leave
  too (a worker merely blocked behind a stopped peer could), and dumps it only when it has not
  answered in that time.
"""


def _stats(values: list[float | None]) -> str:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return "-"
    return f"{statistics.median(vals):.2f} / {vals[-1]:.2f}"


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{platform.node()}: {os.cpu_count()} CPUs ({model or platform.machine()}), Linux {platform.release()}, " \
           f"Python {platform.python_version()}"


def fault_table(faults: list[Fault]) -> list[str]:
    by_kind: dict[str, list[Fault]] = defaultdict(list)
    for f in faults:
        by_kind[f.kind].append(f)
    lines = [
        "| fault | count | detection (s) | workers restarted (s) | first step (s) | steps lost (total / max) "
        "| logged |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in sorted(by_kind):
        fs = by_kind[kind]
        lost = [f.steps_lost for f in fs if f.steps_lost is not None]
        lines.append(
            f"| {kind} | {len(fs)} | {_stats([f.detect for f in fs])} | {_stats([f.restart for f in fs])} | "
            f"{_stats([f.first_step for f in fs])} | {sum(lost)} / {max(lost, default=0)} | "
            f"{sum(f.logged for f in fs)}/{len(fs)} |"
        )
    return lines


def kept_table(results: list[RunResult]) -> list[str]:
    """Per fault kind of the ``et.run`` jobs: survivors that kept their PID, and the fallbacks."""
    by_kind: dict[str, list[Fault]] = defaultdict(list)
    for r in results:
        if r.spec.reform:
            for f in r.faults:
                by_kind[f.kind].append(f)
    lines = ["| fault | count | survivors | kept their PID | restarted instead |", "|---|---|---|---|---|"]
    for kind in sorted(by_kind):
        fs = by_kind[kind]
        survivors = sum(len(f.survivors) for f in fs)
        kept = sum(len(f.kept) for f in fs)
        lines.append(f"| {kind} | {len(fs)} | {survivors} | {kept} | {sum(len(f.fallbacks) for f in fs)} |")
    return lines


def fallback_lines(results: list[RunResult]) -> list[str]:
    lines = []
    for i, r in enumerate(results):
        for f in r.faults:
            for c in f.fallbacks:
                lines.append(f"* job {i + 1} ({r.spec.name}), {f.kind} on node {f.node}: worker {c}")
    return lines or ["None: every survivor of every fault in the `et.run` jobs kept its process."]


def goals(faults: list[Fault], hang_timeout: float) -> list[str]:
    worker = _median([f.first_step for f in faults if f.kind in WORKER_KINDS and f.kind != "worker_hang"])
    worker_restart = _median([f.restart for f in faults if f.kind in WORKER_KINDS and f.kind != "worker_hang"])
    node = _median([f.first_step for f in faults if f.kind in NODE_GOAL_KINDS])
    node_detect = _median([f.detect for f in faults if f.kind in NODE_GOAL_KINDS])
    hangs = [f.detect for f in faults if f.kind == "worker_hang" and f.detect is not None]
    worst_hang = max(hangs, default=None)

    def verdict(value: float | None, limit: float) -> str:
        return "not measured" if value is None else ("met" if value <= limit else "**missed**")

    rows = [
        "| goal | measured | verdict |",
        "|---|---|---|",
        f"| median recovery of a worker fault (kill, exit 1) ≤ 1 s, fault → first step | "
        f"{_f(worker)} (workers restarted: {_f(worker_restart)}) | {verdict(worker, 1.0)} |",
        f"| median recovery of a node fault (agent kill/term, partition) ≤ 5 s, fault → first step | "
        f"{_f(node)} (detection {_f(node_detect)}) | {verdict(node, 5.0)} |",
        f"| hung worker detected within its timeout ({hang_timeout:g} s) + 1 s (worst case) | "
        f"{_f(worst_hang)} over {len(hangs)} hangs | {verdict(worst_hang, hang_timeout + 1)} |",
    ]
    return rows


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def render(results: list[RunResult], seed: int, asked: int, wall: float, command: str, note: str = "") -> str:
    faults = [f for r in results for f in r.faults]
    plain = [f for r in results if not r.spec.reform for f in r.faults]
    reform = [f for r in results if r.spec.reform for f in r.faults]
    violations = sum(not c.ok for r in results for c in r.checks)
    hang_timeout = results[0].spec.hang_timeout if results else 0.0
    survivors = sum(len(f.survivors) for f in reform)
    kept = sum(len(f.kept) for f in reform)
    out = [
        "# Chaos run: faults injected at random, invariants checked",
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M %Z')}; machine {_machine()}; seed {seed}.",
        f"{len(faults)} faults injected (asked: {asked}) in {len(results)} jobs, {wall / 60:.1f} min wall time; "
        f"**{violations} invariant violation(s)**.  {len(reform)} faults hit the "
        f"{sum(r.spec.reform for r in results)} jobs whose trainer runs through `et.run`: "
        f"**{kept} of {survivors} surviving workers kept their process**, "
        f"{sum(len(f.fallbacks) for f in reform)} were restarted instead (causes below).",
    ]
    if note:
        out += ["", note]
    out += [
        "",
        "How to read it: the harness is `tests/chaos/harness.py` (its docstring defines every figure); the",
        "CI form is `tests/chaos/test_chaos_short.py`.  Each job runs 3 agents (one worker each, world size 3,",
        "`--nnodes=2:3`, `--hang-timeout=" + f"{hang_timeout:g}" + "`, the warm pool, every other flag at its default)",
        "training a small MLP with `elastrun.train`, and injects its faults one at a time once training is",
        "steady.  Jobs alternate between two trainers (`tests/chaos/trainer.py`): the plain loop, whose",
        "workers are all restarted after a change, and the same loop run through `et.run`, whose survivors",
        "re-form in their process.  Once every backend has run both, the rotation starts again with the",
        "model sharded by FSDP2 (`FSDP2` in the job's name, " + f"{sum(r.spec.sharded for r in results)}" + " of these",
        "jobs): every rank snapshots its own shard, and each restore reshards the state to the new world size",
        "(the last layer, one row, leaves every rank but one an empty shard).",
        "Times are seconds from the injection, median / max.  *detection*: the",
        "first event naming the fault; *workers restarted*: the agents' `recovered` event; *first step*: the",
        "first step of the new worker group at the expected world size (for `slow_node` and `etcd_kill`, which",
        "must restart nothing: from the end of the fault to the next step).  *steps lost*: steps run again",
        "after the restore (a step whose commit had not completed on every rank: never a committed one, an",
        "invariant).  Every removal of a node (`agent_kill`, `agent_term`, `partition` — the latter heals by",
        "itself) is followed by a `node_join` that restores capacity; `node_join` times include starting a",
        "new agent.",
        "",
        "## Faults, plain training loop (every worker restarted)",
        "",
        *fault_table(plain),
        "",
        "## Faults, training through `et.run` (survivors re-form in process)",
        "",
        *fault_table(reform),
        "",
        "## `et.run`: who kept their process",
        "",
        "A *survivor* is a worker of the group that the fault did not hit: every worker but the killed,",
        "exited or hung one, and but those of a removed node.  It *kept its PID* when the same process ran",
        "in the new group (its `restore()` record names the new generation).  Every other survivor was",
        "restarted instead: the fallback, whose cause the agent logs (`reform_fallback` event) or, for a",
        "worker that ended by itself, its `worker_exit`.",
        "",
        *kept_table(results),
        "",
        "Fallbacks to a restart, with their cause:",
        "",
        *fallback_lines(results),
        "",
        "## Goals of issue 6",
        "",
        "Plain loop:",
        "",
        *goals(plain, hang_timeout),
        "",
        "Through `et.run`:",
        "",
        *goals(reform, hang_timeout),
        "",
        WHERE_TIME_GOES,
        "## Invariants, per job",
        "",
        "| job | faults | steps | world sizes | duration | invariants |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results):
        bad = [f"**{c.name}: {c.detail}**" for c in r.checks if not c.ok]
        params = next((c.detail for c in r.checks if c.name == "final parameters"), "")
        verdict = "; ".join(bad) if bad else f"all {len(r.checks)} hold ({params})"
        out.append(f"| {i + 1}: {r.spec.name} | {len(r.faults)} | {r.steps} | {r.worlds} | {r.duration:.0f} s "
                   f"| {verdict} |")
    out += [
        "",
        "Invariants (see `tests/chaos/verify.py`): the job finished (every agent exited 0); every sample used",
        "exactly once per epoch by committed steps; every committed step ran on a complete group; no committed",
        "step lost (a step is committed for good once every rank of its group began the step after the next;",
        "every later group restores it or a newer one); parameters bit for bit the same on every rank of a",
        "group, after every committed step and every restore; final parameters bit for bit equal to a",
        "failure-free run when the world size never changed, otherwise within 1e-4 (relative) of an in-process",
        "replay of the committed steps (gloo may sum the ranks' gradients in another order than the replay:",
        "the last bits differ, ~1e-7 measured); every fault and recovery in the agents' event logs (and no",
        "restart at all for " + ", ".join(QUIET_KINDS) + "); no stall: after every fault the job steps again",
        f"within {results[0].spec.stall_after if results else 30.0:g} s, and no two step records are further apart "
        "(the moment the harness sees a stall it takes every process's stacks); no process left; no key left in",
        "etcd.  A job that violates any of them keeps its work directory (logs, step records, stacks, `WHY.txt`;",
        "`tests/evidence.py`), whose path its line in the output names.  `tools/chaos.py --until-failure` runs",
        "jobs with new seeds until one fails.",
        "",
    ]
    kept_dirs = [f"- {r.spec.name}: `{r.evidence}`" for r in results if r.evidence is not None]
    if kept_dirs:
        out += ["Evidence kept:", "", *kept_dirs, ""]
    return "\n".join(out)
