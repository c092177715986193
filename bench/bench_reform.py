"""In-process re-form (``elastrun.train.run``) against restarts: a 100M-parameter model, 2 agents × 1 worker.

Three ways to run the same script (``bench/reform_workload.py``, elastrun.train with a memory
snapshot every commit):

- ``elastrun+run``: elastrun, the training body run by ``et.run`` (survivors keep their process);
- ``elastrun``: elastrun, the script written the usual way (every worker restarted, warm pool);
- ``torchrun``: torchrun, the usual script (every worker restarted, fresh interpreters).

Figures, each from the fault until every rank of the new group has committed a step:

- worker crash: rank 1 exits with code 1 at step 6 (once);
- node loss: the second agent and its worker are SIGKILLed; split into detection (until the
  survivor's agent logs the change) and the rest (re-form or restart);
- node join: a second agent starts beside one that trains alone; also measured from the joiner's
  worker start (its agent's ``worker_start`` event: the agent is past its imports and rendezvous),
  and by how long the ranks already training stood still (their last step before, first after);
- hang: rank 1's worker is SIGSTOPped (``--hang-timeout=2``); split into detection (until the first
  ``hang_detected`` event) and the rest, with the ranks the agents blamed (torchrun has no hang
  detection: it waits for ever, so it is not run);
- steady state: the step time with and without ``et.run`` (``--standalone``, 2 workers).

``--fsdp``: the same figures for an FSDP2 model (``bench/reform_workload.py``, ``FSDP=1``), whose
lost shards come from peer replicas under elastrun and from the DCP checkpoint under torchrun; the
time to the first step is split from the workload's own lines (until restored, the first step
itself, and for the joiner: group formed, model built, restore), and the first step is read beside
the new group's steady step (the median of the next ``STEADY_STEPS``).

``--agents n`` (loss and join only): node loss n → n-1 (the last agent killed) and join n-1 → n.

``--pin``: agent i and its workers run on CPU i only (``taskset``), as each on a node of its own.

Usage: ``python bench/bench_reform.py [--repeat 1] [--only crash,loss,join,hang,steady] [--size 100] [--fsdp]
[--agents 2] [--pin]``.
Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PYTHON, ROOT, Trial, fmt, free_port, log, median, wait_for  # noqa: E402

WORKLOAD = str(ROOT / "bench" / "reform_workload.py")
WAYS = ("elastrun+run", "elastrun", "torchrun")
CAP = 60.0


def argv(way: str, flags: list[str], logs: Path | None) -> list[str]:
    if way == "torchrun":
        cmd = [PYTHON, "-m", "torch.distributed.run", *flags, WORKLOAD]
    else:
        extra = ["--preload=torch,elastrun.train"] + ([f"--log-dir={logs}"] if logs is not None else [])
        cmd = [PYTHON, "-m", "elastrun", *flags, *extra, WORKLOAD]
    if PIN and logs is not None:  # agent i (logs<i>) and its workers on CPU i: one node per CPU
        cmd = ["taskset", "-c", str(int(logs.name.removeprefix("logs")) % (os.cpu_count() or 1)), *cmd]
    return cmd


SIZE_M = "100"


class RunTrial(Trial):
    """A trial whose torchrun workers' snapshot directory (named after the run id) goes with it."""

    def close(self) -> None:
        super().close()
        for path in Path("/dev/shm").glob("elastrun-snap-bench-*"):
            shutil.rmtree(path, ignore_errors=True)


FSDP = False
#: ``--pin``: each agent with its workers on a CPU of its own, as on nodes of their own (two agents on
#: one machine otherwise share every core: a joiner's imports then slow the running group, and back).
PIN = False
#: Agents (1 worker each) of the loss and join figures: n → n-1 and n-1 → n.
AGENTS = 2
#: Steps at the new size after its first, whose median interval is the steady step.
STEADY_STEPS = 3


def trial(name: str, way: str, **env: str) -> Trial:
    t = RunTrial(name, env={"MODE": "reform" if way == "elastrun+run" else "restart", "SIZE_M": SIZE_M, **env})
    if FSDP:  # issue 24: the FSDP2 model, a DCP checkpoint every 5 steps (what torchrun's survivors reload)
        t.env.update(FSDP="1", CKPT=str(t.dir / "ckpt"))
    return t


def multi_node(port: int, nnodes: str, host: bool) -> list[str]:
    conf = f"is_host={'true' if host else 'false'},last_call_timeout=1"
    return [f"--nnodes={nnodes}", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=bench", "--max-restarts=3", f"--rdzv-conf={conf}"]


def agent_events(logs: Path) -> list[dict]:
    out = []
    for path in logs.glob("events-*.jsonl"):
        out.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return sorted(out, key=lambda e: e["ts"])


def first_event(logs: Path, kind: str, after: float) -> dict | None:
    return next((e for e in agent_events(logs) if e["event"] == kind and e["ts"] >= after), None)


def kept(t: Trial, after: float) -> str:
    """Which restore sources the ranks of the new group used (``live`` = kept its process)."""
    return ",".join(sorted({e.get("source") or "-" for e in t.events() if e["ev"] == "restored" and e["t"] > after}))


def split_first_step(t: Trial, world: int, after: float, back: float | None) -> dict:
    """Where the time to the first step at ``world`` went, from the workload's own lines: until every
    rank's restore returned (the re-form or restart, the model's build, the restore), and the first
    step itself (its compute and its commit), so a slow step on this CPU is not read as recovery."""
    restored: dict[int, float] = {}
    first: dict[int, float] = {}
    for e in sorted(t.events(), key=lambda e: e["t"]):
        if e["ev"] == "restored" and e["world"] == world and e["t"] > after:
            restored.setdefault(e["rank"], e["t"])
        if e["ev"] == "step" and e["world"] == world and e["t"] > after:
            first.setdefault(e["rank"], e["t0"])
    if back is None or len(restored) < world or len(first) < world:
        return {}
    return {"until restored": max(restored.values()) - after, "first step itself": back - max(first.values())}


def joiner_split(t: Trial, world: int, ready: float, back: float) -> dict:
    """Where the time from the joiner's worker start went, from the workload's lines: until the new
    group exists on every rank (the joiner's init, the others' re-form), the model's build, the
    restore, and the joiner's first step (its start, and how long it took)."""
    marks: dict[str, dict[int, float]] = {}
    joiner_step: float | None = None
    for e in sorted(t.events(), key=lambda e: e["t"]):
        if e.get("world") != world or e["t"] <= ready:
            continue
        if e["ev"] in ("group", "built", "restored"):
            marks.setdefault(e["ev"], {}).setdefault(e["rank"], e["t"])
        if e["ev"] == "step" and e["rank"] == world - 1 and joiner_step is None:
            joiner_step = e["t0"]
    if any(len(marks.get(k, {})) < world for k in ("group", "built", "restored")) or joiner_step is None:
        return {}
    group, built, restored = (max(marks[k].values()) for k in ("group", "built", "restored"))
    return {"ready → group formed": group - ready, "model built": built - group, "restore": restored - built,
            "ready → joiner's first step begins": joiner_step - ready}


def crash(way: str) -> dict:
    t = trial(f"reform-crash-{way}", way, CRASH_AT_STEP="6", CRASH_RANK="1")
    once = t.dir / "crashed"
    t.env["CRASH_ONCE_FILE"] = str(once)
    port = free_port()
    try:
        for i in range(2):
            t.start(argv(way, multi_node(port, "2", i == 0), t.dir / f"logs{i}"))
            time.sleep(0.5 if i == 0 else 0)
        if not wait_for(once.exists, 240):
            log(f"crash {way}: never crashed\n{t.output()[-2000:]}")
            return {}
        at = once.stat().st_mtime
        # steps 7 and later come after the recovery (rank 1 left at the top of step 7)
        back = wait_for(lambda: t.all_ranks_stepped(2, after=at, min_step=7), CAP)
        return {"total": None if back is None else back - at, "sources": kept(t, at)}
    finally:
        t.close()


def start_agents(t: Trial, way: str, port: int, nnodes: str, count: int, first: int = 0) -> list:
    """``count`` agents (agent ``i`` logs to ``logs<i>``; agent 0 hosts the c10d store)."""
    procs = []
    for i in range(first, first + count):
        procs.append(t.start(argv(way, multi_node(port, nnodes, i == 0), t.dir / f"logs{i}")))
        if i == 0:
            time.sleep(0.5)
    return procs


def kept_until(t: Trial, world: int, after: float) -> dict[int, float]:
    """For each rank training at ``world - 1``, when its last work that the join kept ended: its last
    ``step`` line, or the call of the commit the new group restored (a join's pause ends the training
    function at the end of that commit, before its ``step`` line)."""
    events = t.events()
    agreed = min((e["step"] for e in events if e["ev"] == "restored" and e["world"] == world and e["t"] > after),
                 default=None)
    ends: dict[int, float] = {}
    for e in events:
        if e.get("world") != world - 1 or e["rank"] >= world - 1:
            continue
        if e["ev"] == "step" or (e["ev"] == "commit" and agreed is not None and e["n"] <= agreed):
            ends[e["rank"]] = max(ends.get(e["rank"], 0.0), e["t"])
    return ends


def survivors_idle(t: Trial, world: int, after: float) -> dict:
    """How long the ranks already training stood still for a join to ``world``: from the end of their
    last kept work at ``world - 1`` to the start of their first step at ``world`` (the longest of them)."""
    last = kept_until(t, world, after)
    first: dict[int, float] = {}
    for e in t.events():
        if e["ev"] == "step" and e["rank"] < world - 1 and e["world"] == world and e["t"] > after:
            first[e["rank"]] = min(first.get(e["rank"], float("inf")), e["t0"])
    gaps = [first[r] - last[r] for r in first if r in last]
    return {"survivors idle": max(gaps)} if len(gaps) == world - 1 else {}


def thrown_away(t: Trial, world: int, after: float, logs: Path) -> dict:
    """What of its step the host's rank 0 (a survivor) threw away at a join: from the end of its last
    kept work at ``world - 1`` (:func:`kept_until`) to the moment it left its group (its agent's
    ``restart`` event plus the ``reform`` event's ``paused_in``; for restarted workers, the ``restart``
    event: they are killed).  A pause at the end of a commit throws away nothing but that commit's
    own time and the leave."""
    end = kept_until(t, world, after).get(0)
    seen = first_event(logs, "restart", after)
    if end is None or seen is None:
        return {}
    reform = first_event(logs, "reform", seen["ts"])
    left = seen["ts"] + (reform["paused_in"] if reform is not None else 0.0)
    return {"survivor's step thrown away": max(0.0, left - end)}


def steady_after(t: Trial, world: int, after: float, steps: int = STEADY_STEPS) -> dict:
    """The new group's steady step, to read its first step against: the median interval between the
    committed steps that follow its first (rank 0's), waited for (bounded)."""
    def lines() -> list[float]:
        return sorted(e["t"] for e in t.events() if e["ev"] == "step" and e["world"] == world and e["rank"] == 0
                      and e["t"] > after)  # fmt: skip

    wait_for(lambda: len(lines()) > steps, CAP)
    times = lines()[: steps + 1]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"steady step (new size)": statistics.median(gaps)} if gaps else {}


def loss(way: str) -> dict:
    t = trial(f"reform-loss-{way}", way)
    port = free_port()
    n = AGENTS
    try:
        agents = start_agents(t, way, port, f"{n - 1}:{n}", n)
        # FSDP: after the first checkpoint (step 5) is written, so torchrun's survivors have one to reload
        if not wait_for(lambda: t.all_ranks_stepped(n, min_step=8 if FSDP else 4), 240):
            log(f"loss {way}: never formed\n{t.output()[-2000:]}")
            return {}
        killed = time.time()
        t.kill_tree(agents[-1])
        back = wait_for(lambda: t.all_ranks_stepped(n - 1, after=killed), CAP)
        out: dict = {"total": None if back is None else back - killed, "sources": kept(t, killed)}
        seen = first_event(t.dir / "logs0", "restart", killed) if way != "torchrun" else None
        if seen is not None and back is not None:
            out["detection"] = seen["ts"] - killed
            out["after detection"] = back - seen["ts"]
        out.update(split_first_step(t, n - 1, killed, back))
        if back is not None and FSDP:
            out.update(steady_after(t, n - 1, killed))
        return out
    finally:
        t.close()


def join(way: str) -> dict:
    t = trial(f"reform-join-{way}", way)
    port = free_port()
    n = AGENTS
    logs = t.dir / f"logs{n - 1}"
    try:
        start_agents(t, way, port, f"{n - 1}:{n}", n - 1)
        if not wait_for(lambda: t.all_ranks_stepped(n - 1, min_step=4), 240):
            log(f"join {way}: never stepped at {n - 1}\n{t.output()[-2000:]}")
            return {}
        joined = time.time()
        start_agents(t, way, port, f"{n - 1}:{n}", 1, first=n - 1)
        back = wait_for(lambda: t.all_ranks_stepped(n, after=joined), CAP)
        out: dict = {"total": None if back is None else back - joined, "sources": kept(t, joined)}
        started = first_event(logs, "worker_start", joined) if way != "torchrun" else None
        if started is not None and back is not None:
            out["from joiner ready"] = back - started["ts"]
            out.update(joiner_split(t, n, started["ts"], back))
        out.update(split_first_step(t, n, joined, back))
        if back is not None:
            out.update(survivors_idle(t, n, joined))
            if way != "torchrun":
                out.update(thrown_away(t, n, joined, t.dir / "logs0"))
        if back is not None and FSDP:
            out.update(steady_after(t, n, joined))
        return out
    finally:
        t.close()


def hang(way: str) -> dict:
    if way == "torchrun":
        return {}
    t = trial(f"reform-hang-{way}", way)
    port = free_port()
    logs = [t.dir / "logs0", t.dir / "logs1"]
    try:
        for i in range(2):
            t.start(argv(way, [*multi_node(port, "2", i == 0), "--hang-timeout=2"], logs[i]))
            time.sleep(0.5 if i == 0 else 0)
        if not wait_for(lambda: t.all_ranks_stepped(2, min_step=4), 240):
            log(f"hang {way}: never formed\n{t.output()[-2000:]}")
            return {}
        victim = max((e for e in t.events() if e["ev"] == "step" and e["rank"] == 1), key=lambda e: e["t"])["pid"]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.time()
        back = wait_for(lambda: t.all_ranks_stepped(2, after=stopped), CAP)
        out: dict = {"total": None if back is None else back - stopped, "sources": kept(t, stopped)}
        found = sorted((e for d in logs for e in agent_events(d)
                        if e["event"] == "hang_detected" and e["ts"] > stopped), key=lambda e: e["ts"])
        if found and back is not None:
            out["detection"] = found[0]["ts"] - stopped
            out["after detection"] = back - found[0]["ts"]
        out["blamed"] = ",".join(str(e["rank"]) for e in found) or "-"
        return out
    finally:
        t.close()


def steady(way: str, steps: int = 16) -> float | None:
    """Median interval between committed steps (steps 4 and later), ``--standalone`` with 2 workers."""
    t = trial(f"reform-steady-{way}", way, STEPS=str(steps))
    try:
        proc = t.start(argv(way, ["--standalone", "--nproc-per-node=2"], None))
        proc.wait(600)
        times = sorted(e["t"] for e in t.events() if e["ev"] == "step" and e["rank"] == 0 and e["n"] >= 4)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return statistics.median(gaps) if gaps else None
    finally:
        t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--only", default="crash,loss,join,hang,steady")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--size", default="100", help="model size in millions of parameters")
    ap.add_argument("--fsdp", action="store_true", help="the FSDP2 model (issue 24) instead of DDP")
    ap.add_argument("--agents", type=int, default=2, help="loss n → n-1 and join n-1 → n (n ≥ 2)")
    ap.add_argument("--pin", action="store_true", help="agent i and its workers on CPU i (taskset)")
    a = ap.parse_args()
    if a.agents < 2:
        ap.error("--agents must be at least 2")
    global SIZE_M, FSDP, AGENTS, PIN
    SIZE_M, FSDP, AGENTS, PIN = a.size, a.fsdp, a.agents, a.pin
    only = set(a.only.split(","))
    ways = a.ways.split(",")
    results: dict[str, dict[str, list[dict]]] = {}
    for name, measure in (("crash", crash), ("loss", loss), ("join", join), ("hang", hang)):
        if name not in only:
            continue
        for i in range(a.repeat):
            for way in ways:
                got = measure(way)
                log(f"{name} {way} #{i}: {got}")
                results.setdefault(name, {}).setdefault(way, []).append(got)
    print("| figure | " + " | ".join(ways) + " |")
    print("|---|" + "---|" * len(ways))
    n = AGENTS
    labels = {"crash": "worker crash → all ranks stepping",
              "loss": f"node loss {n} → {n - 1} (agent SIGKILL) → survivors stepping",
              "join": f"node join {n - 1} → {n} → all ranks stepping (from the joiner's launch)",
              "hang": "hang (rank 1 SIGSTOPped, --hang-timeout 2) → all ranks stepping"}
    for name, by_way in results.items():
        keys = list(dict.fromkeys(k for runs in by_way.values() for r in runs for k in r
                                  if k not in ("sources", "blamed")))
        for key in keys:
            label = labels[name] if key == "total" else f"  {name}: {key}"
            cells = [fmt(median(r.get(key) for r in by_way.get(w, []))) for w in ways]
            print(f"| {label} | " + " | ".join(cells) + " |")
        srcs = [";".join(r.get("sources", "") for r in by_way.get(w, [])) or "—" for w in ways]
        print(f"|   {name}: restore sources | " + " | ".join(srcs) + " |")
        if name == "hang":
            blamed = [";".join(r.get("blamed", "") for r in by_way.get(w, [])) or "—" for w in ways]
            print(f"|   {name}: ranks blamed (hang_detected) | " + " | ".join(blamed) + " |")
    if "steady" in only:
        step: dict[str, list] = {}
        for i in range(max(2, a.repeat)):
            for way in ("elastrun+run", "elastrun"):
                got = steady(way)
                log(f"steady {way} #{i}: {got}")
                step.setdefault(way, []).append(got)
        run_s, plain_s = median(step["elastrun+run"]), median(step["elastrun"])
        over = f"{(run_s / plain_s - 1) * 100:+.1f} %" if run_s and plain_s else "—"
        print(f"| steady-state step, with / without et.run | {fmt(run_s)} / {fmt(plain_s)} ({over}) | | |")


if __name__ == "__main__":
    main()
