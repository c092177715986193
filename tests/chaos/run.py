"""One chaos job end to end: set up, inject the faults, let it finish, check every invariant
(:mod:`tests.chaos.verify`), clean up; and the failure-free reference run the final parameters are
compared with.

Usage::

    spec = JobSpec(backend="c10d", faults=8, seed=1)
    result = run_job(spec)            # sets up, injects, verifies, cleans up everything
    assert result.ok, result.summary()

A run that fails keeps its evidence (:mod:`tests.evidence`): the stacks of every process taken the
moment it went wrong, then the work directory, whose path ``result.summary()`` names.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests import warm
from tests.chaos import records, verify
from tests.chaos.harness import REPO, TRAINER, ChaosJob, JobSpec, RunResult


def run_job(spec: JobSpec, reference: Callable[[int, int, int, int, bool], str] | None = None) -> RunResult:
    """Run one chaos job end to end and check the invariants; everything is cleaned up.

    ``reference(world, epochs, samples, batch, sharded)`` gives the failure-free parameters' SHA-256 that a
    job at a fixed world size must end with: :func:`reference_sha` by default, or a cache of it, since the value
    depends only on those four numbers."""
    result = RunResult(spec)
    started = time.monotonic()
    with ChaosJob(spec) as job:
        try:
            job.start()
            job.run_faults()
        except (TimeoutError, RuntimeError) as exc:
            job.snapshot(f"the faults could not all be injected: {exc}")  # now, while it is stuck
            result.checks.append(verify.Check("faults injected", False, str(exc)))
        result.faults = job.faults
        result.exit_codes = job.finish()
        result.duration = time.monotonic() - started
        failed = [e for e in job.events() if e["event"] == "job_failed"]
        finished = (job.out / "final.json").exists() and all(c == 0 for c in result.exit_codes)
        detail = "all agents exited 0, final.json written" if finished else (
            f"exit codes {result.exit_codes}; " + ("; ".join(e["reason"][:300] for e in failed[:2]) or "no summary"))
        result.checks.append(verify.Check("job finished", finished, detail))
        job.steps.refresh()
        steps = records.committed(job.steps.records)
        result.steps = len(steps)
        result.worlds = sorted({r["w"] for recs in steps.values() for r in recs})
        result.checks.append(verify.samples_once(steps, spec.samples))
        result.checks.append(verify.complete_steps(steps))
        restored = records.restores(job.out)
        result.checks.append(verify.no_step_lost(job.steps.records, restored))
        result.checks.append(verify.same_parameters(steps, restored, job.steps.records))
        full = spec.nodes * spec.nproc
        expected = None
        if steps and result.worlds == [full] and (job.out / "final.json").exists():  # else nothing to compare
            epochs = max(r["e"] for recs in steps.values() for r in recs) + 1
            expected = (reference or reference_sha)(full, epochs, spec.samples, spec.batch, spec.sharded)
        result.checks.append(verify.final_parameters(job.out, steps, spec.samples, expected))
        unlogged = [f"{f.kind}@node{f.node}" for f in job.faults if not f.logged]
        result.checks.append(verify.Check("every fault and recovery in the logs", not unlogged,
                                          f"not found for {unlogged}" if unlogged
                                          else f"{len(job.faults)} faults, each detected and recovered"))
        stalls = [f for f in job.findings if " stall: " in f"{f} "]
        result.checks.append(verify.steps_again(job.faults, spec.stall_after, stalls, job.steps.records))
        if spec.backend == "etcd":
            result.checks.append(verify.no_etcd_keys(job.etcd_keys, f"/elastrun/{job.run_id}/"))
        bad = [c for c in result.checks if not c.ok]
        if bad:
            job.findings.append("violated: " + "; ".join(f"{c.name}: {c.detail[:300]}" for c in bad))
        job.track()
        tracked = dict(job.tracked)
    result.evidence = job.kept
    result.checks.append(verify.no_orphans(tracked))
    return result


def reference_sha(world: int, epochs: int, samples: int, batch: int, sharded: bool = False) -> str:
    """SHA-256 of the parameters of a failure-free run (one agent, ``world`` workers; ``sharded``: FSDP2)."""
    import json

    work = Path(tempfile.mkdtemp(prefix="elastrun-chaos-ref-"))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    argv = [sys.executable, "-m", "elastrun", "--standalone", f"--nproc-per-node={world}", "--start-method=fork",
            "--preload=torch,elastrun.train", str(TRAINER), "--out", str(work), "--epochs", str(epochs),
            "--samples", str(samples), "--batch", str(batch), *(["--sharded"] if sharded else [])]
    proc = warm.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                      start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"the failure-free reference run failed:\n{output.decode(errors='replace')[-3000:]}")
        return json.loads((work / "final.json").read_text())["sha256"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
