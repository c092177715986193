"""The demo's fault and its verdict (tools/demo.sh).

``kill AUDIT_DIR --rank R --at-step S``: waits until rank R of the first attempt has committed
step S (read from the example's ``--audit-dir`` records), then SIGKILLs that worker from outside
and records when.  ``report AUDIT_DIR LOG_DIR``: reads those records and the agent's event log and
prints what happened: the failure, the recovery time, which workers kept their process (``et.run``)
and which were started anew, the committed steps lost, whether every sample was used exactly once
per epoch, and the job's goodput (computed as ``elastrun goodput`` and the agent's last line compute
it).  Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path


def _records(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def kill(audit: Path, rank: int, at_step: int, timeout: float) -> int:
    path = audit / f"samples-g0-r{rank}.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [r for r in _records(path) if "step" in r]
        if steps and steps[-1]["step"] >= at_step:
            last = steps[-1]
            os.kill(last["pid"], signal.SIGKILL)
            (audit / "kill.json").write_text(json.dumps({"t": time.time(), "pid": last["pid"], "step": last["step"]}))
            print(f"demo: SIGKILL -> rank {rank} (pid {last['pid']}), just after it committed step {last['step']}",
                  flush=True)
            return 0
        time.sleep(0.02)
    print(f"demo: rank {rank} never reached step {at_step} within {timeout:g} s; no fault injected", file=sys.stderr)
    return 1


def report(audit: Path, log_dir: Path, samples: int) -> int:
    kill_rec = json.loads((audit / "kill.json").read_text())
    events = [json.loads(line) for f in sorted(glob.glob(str(log_dir / "events-*.jsonl")))
              for line in Path(f).read_text().splitlines() if line.strip()]
    by_attempt: dict[int, list[dict]] = {}
    for f in audit.glob("samples-g*-r*.jsonl"):
        by_attempt.setdefault(int(f.name.split("-")[1][1:]), []).extend(_records(f))
    ok = True
    failure = next((e for e in events if e["event"] == "worker_failure"), None)
    if failure:
        how = failure["signal"] or f"exit code {failure['exitcode']}"
        print(f"failure:    rank {failure['rank']} (pid {kill_rec['pid']}) killed from outside ({how}) "
              f"at step {kill_rec['step']}")
    restores = {r["rank"]: r for r in by_attempt.get(1, []) if "restored" in r}
    pid_before = {r["rank"]: r["pid"] for r in by_attempt.get(0, [])}
    kept = sorted(rank for rank, r in restores.items() if pid_before.get(rank) == r["pid"])
    anew = sorted(rank for rank in restores if rank not in kept)
    reform = next((e for e in events if e["event"] == "reform"), None)
    recovered = next((e for e in events if e["event"] == "recovered"), None)
    after = [r for r in by_attempt.get(1, []) if "step" in r]
    if (reform or recovered) and after:
        back = min(r["t"] for r in after) - kill_rec["t"]
        if reform and kept:
            what = (f"rank {_ranks(anew)} started anew, rank {_ranks(kept)} re-formed in its process "
                    f"{reform['duration']:.2f} s after the failure")
        else:
            what = f"every worker restarted {recovered['duration']:.2f} s after the failure" if recovered else "?"
        print(f"recovery:   {what}; training again {back:.1f} s after the kill (first step after the restore)")
    else:
        print("recovery:   none recorded")
        ok = False
    for rank in kept:
        r = restores[rank]
        print(f"survivor:   rank {rank} kept its process (pid {r['pid']} before and after the kill) and rolled back "
              f"to step {r['restored']} ({'its own last commit' if r['source'] == 'live' else r['source']})")
    if not kept and restores:
        moves = ", ".join(f"rank {rank}: pid {pid_before.get(rank)} -> {r['pid']}"
                          for rank, r in sorted(restores.items()))
        print(f"survivor:   none: every worker was restarted (the plain loop; {moves})")
    committed = min(max((r["step"] for r in recs if "step" in r), default=0)
                    for rank in {r["rank"] for r in by_attempt.get(0, [])}
                    for recs in [[r for r in by_attempt[0] if r["rank"] == rank]])
    restored = min((r["restored"] for r in restores.values()), default=-1)
    # commit(S) returns before its memory copy ends; S is safe at the latest once step S+1 reaches
    # optimizer.step() (docs/train.md).  So S-1 is the newest step the kill could not take away.
    lost = max(0, committed - 1 - restored)
    sources = ", ".join(f"rank {rank}: {r['source']}" for rank, r in sorted(restores.items()))
    note = "" if restored >= committed or lost else (
        f" (step {committed}'s background copy was still running when the job stopped: redone)")
    print(f"committed:  last commit() on every rank before the kill: step {committed}; restored: step "
          f"{restored} ({sources}); committed steps lost: {lost}{note}")
    ok &= lost == 0
    latest: dict[int, int] = {}  # step -> the last attempt that committed it (it replaces earlier ones)
    for attempt in sorted(by_attempt):
        for r in by_attempt[attempt]:
            if "step" in r:
                latest[r["step"]] = attempt
    epochs: dict[int, Counter] = {}
    for attempt, recs in by_attempt.items():
        for r in recs:
            if "step" in r and latest[r["step"]] == attempt:
                epochs.setdefault(r["epoch"], Counter()).update(r["samples"])
    once = all(set(c) == set(range(samples)) and set(c.values()) == {1} for c in epochs.values())
    steps = sorted(latest)
    contiguous = steps == list(range(1, len(steps) + 1))
    redone = sum(1 for r in by_attempt.get(0, []) if "step" in r and r["step"] > restored and r["rank"] == 0)
    print(f"samples:    {'all' if once else 'NOT all'} {samples} used exactly once in each of {len(epochs)} epochs "
          f"(steps 1-{steps[-1] if steps else 0}{'' if contiguous else ', with gaps'}); "
          f"uncommitted steps redone: {redone}")
    ok &= once and contiguous
    print(f"goodput:    {_goodput(log_dir)}")
    print(f"            (the agent's last line above; by cause and fault: elastrun goodput {log_dir})")
    return 0 if ok else 1


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _goodput(log_dir: Path) -> str:
    """The job's goodput, from the one computation that ``elastrun goodput`` and the agent use."""
    from elastrun.observe.goodput_report import load

    gp = load(log_dir)
    if gp.ratio is None or gp.basis == "none":
        return "not measured"
    return (f"{100 * gp.ratio:.1f} % of the workers' time went into steps that were kept "
            f"({gp.good:.1f} of {gp.device_seconds:.1f} worker-s)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kill")
    k.add_argument("audit", type=Path)
    k.add_argument("--rank", type=int, default=1)
    k.add_argument("--at-step", type=int, required=True)
    k.add_argument("--timeout", type=float, default=600)
    r = sub.add_parser("report")
    r.add_argument("audit", type=Path)
    r.add_argument("log_dir", type=Path)
    r.add_argument("--samples", type=int, required=True)
    a = p.parse_args()
    if a.cmd == "kill":
        return kill(a.audit, a.rank, a.at_step, a.timeout)
    return report(a.audit, a.log_dir, a.samples)


if __name__ == "__main__":
    sys.exit(main())
