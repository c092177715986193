"""Lost-node detection: how soon the survivor knows, for a process death and for a silent node.

Two agents with one worker each on loopback run :mod:`bench.workload` with default flags (plus
``--log-dir`` for the event log), with ``--rdzv-backend=c10d`` and, where an etcd binary is
installed, ``etcd`` (one member on loopback).  Once both ranks step, the second agent is hit:

- **process death**: it and its worker are SIGKILLed (its sockets close with it);
- **silence**: it is SIGSTOPped (alive, its sockets open: what a partition or a hung host looks
  like from the other node).

*detection*: from the fault to the survivor's first event naming the node lost (``restart`` for
a lost node, or ``node_lost``, whichever comes first; its ``cause`` is read from ``node_lost``).
*next step*: from the fault to the survivor's first step at world size 1.  torchrun's figure
beside is :func:`bench.bench_recovery.node_loss` (agent SIGKILL → survivors' next step) for 2 agents.

    python -m bench.bench_detection --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from bench.bench_recovery import node_loss
from bench.common import LAUNCHERS, Trial, free_port, launcher_argv, log, median, wait_for

CAP = 60.0


def _events(log_dir: Path) -> list[dict]:
    out = []
    for path in log_dir.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return sorted(out, key=lambda e: e["ts"])


def _flags(backend: str, endpoint: str, log_dir: Path, host: bool) -> list[str]:
    flags = ["--nnodes=1:2", "--nproc-per-node=1", f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}",
             "--rdzv-id=detect", "--max-restarts=3", f"--log-dir={log_dir}"]
    if backend == "c10d":
        flags.append(f"--rdzv-conf=is_host={'true' if host else 'false'}")
    return flags


def detection(backend: str, endpoint: str, fault: str) -> tuple[float | None, float | None, str | None]:
    """(detection s, next step s, cause) for one ``fault`` ("kill" or "stop") of the second agent."""
    trial = Trial(f"detect-{backend}-{fault}", env={"STEPS": "100000", "STEP_SECONDS": "0.05"})
    logs = trial.dir / "events"
    try:
        survivor = trial.start(launcher_argv("elastrun", _flags(backend, endpoint, logs, True)))
        time.sleep(1.0)
        victim = trial.start(launcher_argv("elastrun", _flags(backend, endpoint, logs, False)))
        if not wait_for(lambda: trial.all_ranks_stepped(2, min_step=5), 120):
            log(f"detection {backend} {fault}: never formed\n{trial.output()}")
            return None, None, None
        at = time.time()
        if fault == "kill":
            trial.kill_tree(victim)
        else:
            os.kill(victim.pid, signal.SIGSTOP)
        prefix = f"{os.uname().nodename}-{victim.pid}-"

        def seen() -> tuple[float, str | None] | None:
            for e in _events(logs):
                if e["ts"] < at or not str(e["node"]).startswith(f"{os.uname().nodename}-{survivor.pid}-"):
                    continue
                lost = e.get("lost") or []
                if e["event"] == "node_lost" and any(n.startswith(prefix) for n in lost):
                    return e["ts"], next((c for n, c in (e.get("causes") or {}).items() if n.startswith(prefix)), None)
                if e["event"] == "restart" and prefix in str(e.get("reason")):
                    return e["ts"], None
            return None

        first = wait_for(seen, CAP)
        stepped = wait_for(lambda: trial.all_ranks_stepped(1, after=at), CAP)
        cause = next((c for e in _events(logs) if e["event"] == "node_lost" and e["ts"] >= at
                      for n, c in (e.get("causes") or {}).items() if n.startswith(prefix)), None)
        if fault == "stop":
            os.kill(victim.pid, signal.SIGCONT)
        return (None if first is None else first[0] - at), (None if stepped is None else stepped - at), cause
    finally:
        trial.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available

    lines = ["| backend | fault | detection (median s) | survivor's next step (median s) | causes |",
             "|---|---|---|---|---|"]
    backends = ["c10d"] + (["etcd"] if etcd_available() else [])
    for backend in backends:
        for fault in ("kill", "stop"):
            got = []
            for i in range(args.repeat):
                if backend == "etcd":
                    with EtcdCluster(1) as cluster:
                        got.append(detection(backend, cluster.endpoints, fault))
                else:
                    got.append(detection(backend, f"127.0.0.1:{free_port()}", fault))
                log(f"{backend} {fault} #{i}: {got[-1]}")
            det, nxt = median(g[0] for g in got), median(g[1] for g in got)
            causes = ", ".join(sorted({str(g[2]) for g in got}))
            lines.append(f"| {backend} | {'SIGKILL' if fault == 'kill' else 'SIGSTOP'} | "
                         f"{'—' if det is None else f'{det:.2f}'} | {'—' if nxt is None else f'{nxt:.2f}'} | "
                         f"{causes} |")
    loss = {w: [] for w in LAUNCHERS}
    for i in range(args.repeat):
        for which in LAUNCHERS:
            loss[which].append(node_loss(which, 2))
            log(f"node loss (c10d, 2 agents) {which} #{i}: {loss[which][-1]}")
    lines.append("")
    for which in LAUNCHERS:
        m = median(loss[which])
        lines.append(f"agent SIGKILL → survivors' next step, 2 agents × 1 worker, c10d, {which}: "
                     f"{'—' if m is None else f'{m:.2f} s'} (median of {args.repeat}; {loss[which]})")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
