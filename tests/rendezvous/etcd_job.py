"""Helpers for the etcd end-to-end tests: start real agents (``python -m elastrun``) running
tests/scripts/steps.py, read their step logs, and stop them by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests import warm
from tests.harness import base_env, remove_runtime_dirs, wait_until

REPO = Path(__file__).resolve().parents[2]
STEPS_SCRIPT = REPO / "tests" / "scripts" / "steps.py"


def start_agent(endpoints: str, run_id: str, steps_dir: Path, log: Path, *, nnodes: str = "1:3",
                steps: int = 100000, conf: str = "", wrap: list[str] | None = None,
                extra_env: dict[str, str] | None = None, max_restarts: int = 3) -> subprocess.Popen:
    """One agent (its own session, so its whole process group can be killed) with one worker."""
    env = base_env(STEPS_LOG=str(steps_dir), STEPS=str(steps), STEP_SECONDS="0.05", CKPT=str(steps_dir / "ckpt.json"),
                   **(extra_env or {}))
    argv = [*(wrap or []), sys.executable, "-m", "elastrun", f"--nnodes={nnodes}", "--nproc-per-node=1",
            "--rdzv-backend=etcd", f"--rdzv-endpoint={endpoints}", f"--rdzv-id={run_id}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1"]
    if conf:
        argv.append(f"--rdzv-conf={conf}")
    argv.append(str(STEPS_SCRIPT))
    with open(log, "ab") as out:
        return warm.popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def read_steps(steps_dir: Path) -> list[dict]:
    """Every logged step of every rank: {step, rank, world, gen, t}."""
    rows = []
    for path in sorted(steps_dir.glob("rank*.log")):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 10 and parts[0] == "step":
                rows.append({"step": int(parts[1]), "rank": int(parts[3]), "world": int(parts[5]),
                             "gen": parts[7], "t": float(parts[9])})
    return rows


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it returns a truthy value (bounded); AssertionError naming ``what``."""
    return wait_until(predicate, timeout, interval=interval, what=what)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the agent's process group (agent and workers), reap the agent, and remove its directories
    when it is gone (a SIGKILLed agent cannot)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    remove_runtime_dirs({proc.pid})


def world_steps(rows: list[dict], world: int, after: float = 0.0) -> list[dict]:
    return [r for r in rows if r["world"] == world and r["t"] > after]
