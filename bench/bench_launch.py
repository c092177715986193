"""Cold launch to the first step of every rank, steady-state step time, and memory.

One ``--standalone`` run per launcher, worker count and repeat.  From the workload's log:
the time from starting the launcher to the moment every rank has stepped; the median step
interval of rank 0 after warm-up (the workload does no sleeping here, so any per-step cost of
the launcher would show); once every rank is stepping, the RSS of the agent and the RSS and PSS
of each worker (PSS charges shared pages pro rata: forked workers share torch's); and the CPU
seconds of the whole run (launcher, template, workers and their 1,500 steps: every process of the
job is reaped inside the launcher's tree, so the bench's own children's rusage counts them all).
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import time

import psutil

from bench.common import LAUNCHERS, Row, Trial, launcher_argv, log, median, wait_for

STEPS = 1500
WARMUP = 100


def _mb(value: float) -> float:
    return value / 2**20


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(which: str, nproc: int) -> dict:
    trial = Trial(f"launch-{which}-{nproc}", env={"STEPS": str(STEPS), "STEP_SECONDS": "0"})
    try:
        t0 = time.time()
        cpu0 = _children_cpu()
        agent = trial.start(launcher_argv(which, ["--standalone", f"--nproc-per-node={nproc}"]))
        first = wait_for(lambda: trial.all_ranks_stepped(nproc), 120)
        result: dict = {"first_step": None if first is None else first - t0}
        if wait_for(lambda: trial.all_ranks_stepped(nproc, min_step=WARMUP), 60):
            workers = sorted({e["pid"] for e in trial.events()})
            mem = []
            for pid in workers:
                try:
                    info = psutil.Process(pid).memory_full_info()
                    mem.append((info.rss, info.pss))
                except psutil.Error:
                    pass
            agent_proc = psutil.Process(agent.pid)
            result["agent_rss"] = _mb(agent_proc.memory_info().rss)
            result["worker_rss"] = _mb(statistics.mean(m[0] for m in mem)) if mem else None
            result["worker_pss"] = _mb(statistics.mean(m[1] for m in mem)) if mem else None
            others = [c for c in agent_proc.children() if c.pid not in workers]
            if which == "elastrun" and others:
                result["template_rss"] = _mb(others[0].memory_info().rss)
                result["template_pss"] = _mb(others[0].memory_full_info().pss)
        try:
            agent.wait(90)
            result["cpu"] = _children_cpu() - cpu0
        except subprocess.TimeoutExpired:
            result["hung_at_exit"] = True
            log(f"{which} {nproc} workers: the job did not end within 90 s of its last step; killed")
        steps = [e["t"] for e in trial.events() if e["ev"] == "step" and e["rank"] == 0]
        deltas = [b - a for a, b in zip(steps[WARMUP:], steps[WARMUP + 1:], strict=False)]
        result["step"] = statistics.median(deltas) * 1000 if deltas else None
        if result["first_step"] is None:
            log(f"{which} {nproc} workers: no first step; output:\n{trial.output()}")
        return result
    finally:
        trial.close()


def run(repeat: int) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []
    steady: dict[str, list] = {w: [] for w in LAUNCHERS}
    cpu: dict[int, dict[str, list]] = {n: {w: [] for w in LAUNCHERS} for n in (2, 4)}
    memory: dict[str, list[dict]] = {w: [] for w in LAUNCHERS}
    hung: dict[str, int] = {w: 0 for w in LAUNCHERS}
    for nproc in (2, 4):
        firsts: dict[str, list] = {w: [] for w in LAUNCHERS}
        for i in range(repeat):
            for which in LAUNCHERS:
                res = one_run(which, nproc)
                log(f"cold launch {which} nproc={nproc} #{i}: {res}")
                firsts[which].append(res["first_step"])
                cpu[nproc][which].append(res.get("cpu"))
                hung[which] += bool(res.get("hung_at_exit"))
                if nproc == 2:
                    steady[which].append(res.get("step"))
                    memory[which].append(res)
        rows.append(Row(f"cold launch → first step of all ranks, {nproc} workers", firsts["torchrun"],
                        firsts["elastrun"], goal="≤ 0.70" if nproc == 4 else ""))
    for nproc in (2, 4):
        rows.append(Row(f"CPU of the whole run, {nproc} workers (start-up and 1,500 steps each)",
                        cpu[nproc]["torchrun"], cpu[nproc]["elastrun"], unit="CPU-s"))
    rows.append(Row("steady-state step time (median, 2 workers)", steady["torchrun"], steady["elastrun"],
                    unit="ms", goal="≈ 1.00"))
    for key, label in (("agent_rss", "agent RSS"), ("worker_rss", "per-worker RSS"),
                       ("worker_pss", "per-worker PSS")):
        rows.append(Row(f"{label} (2 workers)", [m.get(key) for m in memory["torchrun"]],
                        [m.get(key) for m in memory["elastrun"]], unit="MB"))
    for which in LAUNCHERS:
        if hung[which]:
            notes.append(f"{which}: {hung[which]} of {2 * repeat} cold-launch runs did not end after their last "
                         "step (killed after 90 s; their launch figures are valid; see 'Open problems').")
    tpl_rss = median(m.get("template_rss") for m in memory["elastrun"])
    tpl_pss = median(m.get("template_pss") for m in memory["elastrun"])
    if tpl_rss is not None:
        notes.append(f"elastrun's template process (one per agent): RSS {tpl_rss:.0f} MB, PSS {tpl_pss:.0f} MB "
                     "(its pages are shared with the workers, so PSS splits them between it and the workers).")
    return rows, notes
