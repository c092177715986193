"""deploy/slurm/elastrun.sbatch under a real SLURM: submitted with sbatch, pre-empted, requeued, resumed.

A one-node cluster (``tests/deploy/slurm_cluster.py``: Debian's slurmctld and slurmd, configuration
in a temporary directory) runs the batch script as it is; only resources are overridden on sbatch's
command line, as a user would (one node of this machine instead of four with 8 CPUs each).  The job
trains ``examples/train_imagenet_style.py`` with two workers; once it steps, the test sends the time
limit's warning signal the way ``--signal=B:USR1@120`` does (``scancel --batch --signal=USR1``).
Then the script must stop the agents with SIGTERM, the workers must write a checkpoint and exit
cleanly, the script must requeue the job, and the requeued job must resume from that checkpoint and
finish.  Skipped, with the reason, when not root or when SLURM is not installed or does not start.

SLURM holds a requeued job until its step credentials expired (``cred_expire`` + 1 s, 121 s by
default) so that no node still treats the job id as killed; the test cluster sets ``cred_expire=5``.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun.observe.events import read_log_dir
from tests.deploy.podenv import REPO
from tests.deploy.slurm_cluster import SlurmCluster, missing_reason
from tests.harness import alive, base_env, free_port, wait_until

SBATCH = REPO / "deploy" / "slurm" / "elastrun.sbatch"
EPOCHS = 3
#: examples/train_imagenet_style.py's defaults: 2048 samples, 32 per rank and step; two ranks.
STEPS = EPOCHS * 2048 // (32 * 2)

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or "")]


@pytest.fixture
def slurm() -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="elastrun-slurm-")))
    try:
        why = cluster.start()
        if why is not None:
            pytest.skip(why)
        yield cluster
    finally:
        cluster.close()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_sbatch_job_is_preempted_checkpoints_requeues_and_resumes(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    log_dir = tmp_path / "events"
    env = slurm.env(
        base_env(),
        PATH=f"{Path(sys.executable).parent}:{base_env()['PATH']}",  # `elastrun` as the job's PATH finds it
        ELASTRUN_NPROC_PER_NODE="2",
        ELASTRUN_RDZV_PORT=str(free_port()),
        ELASTRUN_CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
        ELASTRUN_STOP_TIMEOUT="30",
        PET_LOG_DIR=str(log_dir),  # the agents' event logs: when workers start and step
    )
    submitted = time.time()
    job = slurm.sbatch(["--nodes=1", "--cpus-per-task=2", "--time=10", f"--output={out}", str(SBATCH),
                        "--epochs", str(EPOCHS)], env=env, cwd=REPO)

    def stepping() -> bool:
        return bool(re.search(r"rank0\]: step +10 ", _read(out)))

    try:
        wait_until(stepping, 180, interval=0.05, what="the job's first ten steps")
    except AssertionError:
        raise AssertionError(f"{slurm.job(job)}\n{_read(out)[-3000:]}\n{slurm.logs()}") from None
    preempted = time.time()
    slurm.run("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@120 sends

    def requeued() -> bool:  # pending again, or already past that when the test looks
        return slurm.job(job).get("Restarts") == "1"

    wait_until(requeued, 90, what=f"job {job} requeued; output:\n{_read(out)[-3000:]}")

    def finished() -> dict[str, str] | None:
        info = slurm.job(job)
        return info if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None

    info = wait_until(finished, 180, what=f"job {job} to finish after its requeue")
    text = _read(out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-6000:], slurm.logs())
    first, _, second = text.partition(f"id slurm-{job}-1,")
    assert second, f"the requeued run did not start:\n{text[-4000:]}"
    # The first run: fresh, stepped, told of the time limit, stopped its agents, requeued itself.
    assert "fresh start" in first
    assert "time limit near: stopping the agents (SIGTERM)" in first
    assert f"requeueing job {job}" in first
    last_printed = max(int(n) for n in re.findall(r"rank0\]: step +(\d+) ", first))
    # The requeued run: resumed from the checkpoint the workers wrote on SIGTERM, and finished.
    restored = re.search(r"rank0\]: world size 2: restored step (\d+) from disk", second)
    assert restored, text[-6000:]
    assert last_printed <= int(restored[1]) < STEPS
    assert f"done: {STEPS} steps" in second
    assert "fresh start" not in second
    # The agents' own record: run 0 stopped by SIGTERM (forwarded to the workers), run 1 succeeded.
    events = read_log_dir(log_dir)
    runs = {e["node"]: e["run_id"] for e in events if e["event"] == "agent_start"}
    exits = {runs[e["node"]]: e["exitcode"] for e in events if e["event"] == "agent_exit"}
    assert exits == {f"slurm-{job}-0": 143, f"slurm-{job}-1": 0}, exits
    assert any(e["event"] == "signal" and e["signal"] == "SIGTERM" for e in events)

    def first_step(run: str) -> float:
        return min(e["first_heartbeat"] for e in events
                   if e["event"] == "worker_stepping" and runs[e["node"]] == run)

    def at(kind: str, run: str) -> float:
        return next(e["ts"] for e in events if e["event"] == kind and runs[e["node"]] == run)

    to_first_step = first_step(f"slurm-{job}-0") - submitted
    to_resumed_step = first_step(f"slurm-{job}-1") - preempted
    print(f"SLURM: submit -> first step {to_first_step:.1f} s (agent started "
          f"{at('agent_start', f'slurm-{job}-0') - submitted:.1f} s); pre-emption -> requeued job's first step "
          f"{to_resumed_step:.1f} s (first agent exited {at('agent_exit', f'slurm-{job}-0') - preempted:.1f} s, "
          f"requeued agent started {at('agent_start', f'slurm-{job}-1') - preempted:.1f} s; "
          "requeue hold: cred_expire=5 s + 1 s)")
    assert 0 < to_first_step < 180 and 0 < to_resumed_step < 270


def test_close_stops_the_daemons_and_removes_their_directory() -> None:
    root = Path(tempfile.mkdtemp(prefix="elastrun-slurm-"))
    cluster = SlurmCluster(root)
    try:
        why = cluster.start()
        if why is not None:
            pytest.skip(why)
        pids = [d.pid for d in cluster.daemons]
        assert alive(pids) == pids
    finally:
        cluster.close()
    assert not root.exists()
    assert alive(pids) == []
    assert cluster.leftovers() == []
