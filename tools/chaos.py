"""The long chaos run: many faults over several jobs (c10d and etcd on loopback, etcd across network
namespaces when root), every invariant checked after each job, and a report written.

    .venv/bin/python tools/chaos.py --faults 100 --seed 1 --report docs/chaos.md

Jobs rotate c10d → etcd → etcd in namespaces (root only), and alternate between the plain
training loop (every worker restarted after a change) and ``et.run`` (survivors re-form in their
process), so that every backend runs both and half of the faults hit ``et.run`` jobs.  Once every
backend has run with both trainers, the rotation starts again with the model sharded by FSDP2
(every rank snapshots its shard, each restore reshards it), and so on, alternating.  Each job
takes ``--faults-per-job`` faults until ``--faults`` are injected or ``--max-minutes`` would be
exceeded (the report then says how many fitted).  Exit code 0 when every invariant held, 1 otherwise.

``--until-failure`` hunts instead: jobs with new seeds, one after another, until one violates an
invariant (a stall included: the job must step again within ``JobSpec.stall_after`` after every
fault) or ``--max-minutes`` is spent.  The failing job's work directory, with every process's
stacks taken when it went wrong, is kept (``tests/evidence.py``) and its path printed; exit code 1.
Exit code 0 when no job failed in the time.

    .venv/bin/python tools/chaos.py --until-failure --max-minutes 120 --seed 7
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.chaos.harness import JobSpec, RunResult  # noqa: E402
from tests.chaos.report import render  # noqa: E402
from tests.chaos.run import reference_sha, run_job  # noqa: E402

LOOPBACK_KINDS = ("worker_kill", "worker_exit", "worker_hang", "agent_kill", "agent_term", "node_join", "slow_node")


def job_specs(seed: int, per_job: int, netns: bool):
    """An endless rotation of job specs with distinct seeds: backends in turn, trainers alternating
    so that each backend runs both (with an even number of backends, the pairing shifts each cycle),
    and the model replicated for one such cycle of every pair, then sharded (FSDP2) for the next."""
    backends = ["c10d", "etcd", "netns"] if netns else ["c10d", "etcd"]
    i = 0
    while True:
        which = backends[i % len(backends)]
        reform = (i + (i // len(backends) if len(backends) % 2 == 0 else 0)) % 2 == 1
        sharded = (i // (2 * len(backends))) % 2 == 1
        job_seed = seed * 1000 + i
        if which == "c10d":
            yield JobSpec(backend="c10d", seed=job_seed, faults=per_job, kinds=LOOPBACK_KINDS, reform=reform,
                          sharded=sharded)
        elif which == "etcd":
            yield JobSpec(backend="etcd", seed=job_seed, faults=per_job, kinds=(*LOOPBACK_KINDS, "etcd_kill"),
                          reform=reform, sharded=sharded)
        else:
            yield JobSpec(backend="etcd", seed=job_seed, faults=per_job, netns=True,
                          kinds=(*LOOPBACK_KINDS, "etcd_kill", "partition"), reform=reform, sharded=sharded)
        i += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=100, help="faults to inject in all (default 100)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults-per-job", type=int, default=17,
                   help="default 17: 100 faults make 6 jobs, each backend once with each trainer")
    p.add_argument("--max-minutes", type=float, default=25.0, help="no new job starts after this wall time")
    p.add_argument("--report", default=None, help="write the markdown report here (e.g. docs/chaos.md)")
    p.add_argument("--no-netns", action="store_true", help="skip the network-namespace jobs even as root")
    p.add_argument("--until-failure", action="store_true",
                   help="run jobs with new seeds until one fails (its evidence is kept) or --max-minutes is spent")
    a = p.parse_args(argv)
    if a.faults <= 0 or a.faults_per_job <= 0:
        p.error("--faults and --faults-per-job must be positive")
    netns = os.geteuid() == 0 and shutil.which("ip") is not None and not a.no_netns
    if a.until_failure:
        return until_failure(a, netns)
    started = time.monotonic()
    results: list[RunResult] = []
    reference = functools.cache(reference_sha)  # one failure-free run per world, epochs, samples, batch, model
    done = 0
    last_job = 0.0
    note = ""
    loads: list[float] = []
    for spec in job_specs(a.seed, a.faults_per_job, netns):
        if done >= a.faults:
            break
        elapsed = time.monotonic() - started
        if elapsed + last_job > a.max_minutes * 60:
            note = (f"Stopped after {done} of {a.faults} faults: the next job would not have fitted in the "
                    f"{a.max_minutes:g}-minute budget (`--max-minutes`).")
            break
        spec.faults = min(spec.faults, a.faults - done)
        t = time.monotonic()
        result = run_job(spec, reference)
        last_job = time.monotonic() - t
        results.append(result)
        loads.append(os.getloadavg()[0])
        done += len(result.faults)
        print(result.summary(), flush=True)
    if not netns:
        note += " Network-namespace jobs (partitions) were skipped: they need root and `ip`."
    if loads:
        note += (f" Machine load (1-minute load average on {os.cpu_count()} CPUs) after each job: "
                 f"{', '.join(f'{x:.1f}' for x in loads)}; a busy machine stretches the times, not the invariants.")
    wall = time.monotonic() - started
    command = "tools/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(results, a.seed, a.faults, wall, command.strip(), note.strip())
    if a.report:
        Path(a.report).write_text(text)
        print(f"report written to {a.report}")
    else:
        print(text)
    return 0 if results and all(r.ok for r in results) else 1


def until_failure(a: argparse.Namespace, netns: bool) -> int:
    """Jobs with new seeds until one fails or the time is spent (see the module docstring)."""
    started = time.monotonic()
    reference = functools.cache(reference_sha)  # one failure-free run per world, epochs, samples, batch, model
    jobs = faults = 0
    last_job = 0.0
    seeds: list[int] = []
    for spec in job_specs(a.seed, a.faults_per_job, netns):
        if time.monotonic() - started + last_job > a.max_minutes * 60:
            break
        t = time.monotonic()
        result = run_job(spec, reference)
        last_job = time.monotonic() - t
        jobs += 1
        faults += len(result.faults)
        seeds.append(spec.seed)
        print(result.summary(), flush=True)
        if not result.ok:
            where = result.evidence or "(not kept: see the summary above)"
            print(f"until-failure: {spec.name} failed after {jobs} job(s), {faults} fault(s), "
                  f"{(time.monotonic() - started) / 60:.1f} min; evidence: {where}", flush=True)
            if a.report:
                Path(a.report).write_text(render([result], spec.seed, len(result.faults), last_job,
                                                 f"tools/chaos.py --until-failure (seed {spec.seed})"))
            return 1
    span = f"seeds {seeds[0]}-{seeds[-1]}" if seeds else "no seed"
    print(f"until-failure: no failure in {jobs} job(s), {faults} fault(s), {span}, "
          f"{(time.monotonic() - started) / 60:.1f} min (--max-minutes {a.max_minutes:g})", flush=True)
    return 0


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (``kill``, a CI time limit) unwinds the run like Ctrl-C, so each job's clean-up stops its
    agents, etcd members and network namespaces: killed outright, the run left them running."""
    raise KeyboardInterrupt(f"chaos.py got signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)
    sys.exit(main())
