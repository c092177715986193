"""Goodput of a long job with a fault every minute: elastrun with et.run, elastrun with the plain loop, torchrun.

One node, 2 workers (``--standalone``), bench/reform_workload.py (an MLP trained with
elastrun.train, memory snapshots every step: under torchrun too, whose restarts find them in
/dev/shm).  From the first step on, every ``--every`` seconds a worker is SIGKILLed (ranks 1, 0,
1, ...; a fault that falls due while the workers are still recovering strikes as soon as they
step); after ``--minutes`` the job is stopped.  Goodput is measured for every variant the same
way, from the workload's own step log: the kept steps' time over 2 workers x the wall time from
the launch to the stop (bench/goodput_steps.py).  For elastrun, ``elastrun goodput`` on its log
directory is printed beside it (its window is the agent's life, so it differs a little).

    python bench/bench_goodput.py [--minutes 10] [--every 60] [--size-m 10] [--only reform,plain,torchrun]

The full run (10 minutes per variant, 30 in all) needs a quiet machine: take it under
``flock -x /tmp/elastrun-quiet.lock`` one variant at a time (``--only reform``, then ``plain``,
then ``torchrun``) and note the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PYTHON, Trial, log, wait_for  # noqa: E402
from bench.goodput_steps import from_workload  # noqa: E402

WORKLOAD = str(Path(__file__).with_name("reform_workload.py"))
VARIANTS = {
    "reform": ("elastrun", "reform", "elastrun, et.run (workers keep their process)"),
    "plain": ("elastrun", "restart", "elastrun, plain loop (workers restarted)"),
    "torchrun": ("torchrun", "restart", "torchrun, plain loop (workers restarted)"),
}


def _stepping_worker(trial: Trial, rank: int, after: float) -> int | None:
    """The live process of ``rank`` that has stepped since ``after`` (None while a restart is under way)."""
    steps = [e for e in trial.events() if e["ev"] == "step" and e["rank"] == rank and e["t"] > after]
    if not steps:
        return None
    try:
        os.kill(steps[-1]["pid"], 0)
    except ProcessLookupError:
        return None
    return steps[-1]["pid"]


def run_variant(name: str, minutes: float, every: float, size_m: int) -> dict:
    launcher, mode, label = VARIANTS[name]
    trial = Trial(f"goodput-{name}", env={"MODE": mode, "SIZE_M": str(size_m), "BATCH": "8", "STEPS": "100000000"})
    logs = trial.dir / "agent-logs"
    flags = ["--standalone", "--nproc-per-node=2", "--max-restarts=100000"]
    if launcher == "torchrun":
        argv = [PYTHON, "-m", "torch.distributed.run", *flags, WORKLOAD]
    else:
        argv = [PYTHON, "-m", "elastrun", f"--log-dir={logs}", *flags, WORKLOAD]
    try:
        launched = time.time()
        trial.start(argv)
        stop_at = launched + 60 * minutes
        first = wait_for(lambda: trial.all_ranks_stepped(2), 300)
        if first is None:
            log(f"{name}: never stepped\n{trial.output()}")
            return {"variant": name, "label": label, "error": "never stepped"}
        faults, last = 0, 0.0
        due = first + every
        while due < stop_at:
            time.sleep(max(0.0, due - time.time()))
            # Due: strike the rank's worker as soon as it steps (a restart may still be under way), so
            # every launcher gets the same faults; a slower recovery only delays the next strike.
            rank = 1 if faults % 2 == 0 else 0
            pid = wait_for(lambda r=rank, a=last: _stepping_worker(trial, r, a), max(0.0, stop_at - time.time()))
            if pid is None:
                log(f"{name}: rank {rank} did not step again before the end; the launcher's output:\n"
                    f"{trial.output()[-2500:]}")
                break
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            faults, last = faults + 1, time.time()
            log(f"{name}: fault {faults}: SIGKILL rank {rank} (pid {pid}) at {last - launched:.1f} s")
            due = max(due + every, last)
        time.sleep(max(0.0, stop_at - time.time()))
        ended = time.time()
        events = trial.events()
        got = from_workload(events, 2, launched, ended)
        row = {"variant": name, "label": label, "faults": faults, **got.row()}
        if launcher == "elastrun":
            from elastrun.observe.goodput_report import load

            gp = load(logs)
            row["elastrun_goodput"] = round(gp.ratio or 0.0, 4)
            row["elastrun_badput"] = {c: round(v, 1) for c, v in gp.badput.items() if v >= 0.05}
        log(f"{name}: {row}")
        return row
    finally:
        trial.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--minutes", type=float, default=10.0, help="length of each job (default 10)")
    p.add_argument("--every", type=float, default=60.0, help="seconds between faults (default 60)")
    p.add_argument("--size-m", type=int, default=10, help="model size in millions of parameters (default 10)")
    p.add_argument("--only", default="reform,plain,torchrun", help="variants to run, comma-separated")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    rows = [run_variant(v, args.minutes, args.every, args.size_m) for v in args.only.split(",")]
    load = os.getloadavg()
    print(f"{args.minutes:g} min per job, a worker SIGKILLed every {args.every:g} s, {args.size_m}M-parameter MLP, "
          f"2 workers; load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}\n")
    print("| variant | faults | goodput (step log) | wall goodput | redone steps | elastrun goodput |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | — | {r['error']} | | | |")
            continue
        own = f"{100 * r['elastrun_goodput']:.1f} %" if "elastrun_goodput" in r else "—"
        print(f"| {r['label']} | {r['faults']} | {100 * r['goodput']:.1f} % | {100 * r['wall_goodput']:.1f} % | "
              f"{r['redone_steps']} | {own} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
