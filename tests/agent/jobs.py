"""A job of real agents on loopback, on c10d or on a real etcd (the ``job`` fixture in conftest.py):
the flags they share, the agents started store host first, and the events they log."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tests.harness import Cluster, base_env, listening, wait_until


@dataclass
class Job:
    """One job's rendezvous: every agent of a test gets the same flags, with its own log directory."""

    backend: str
    endpoint: str
    nnodes: str = "1:2"
    run_id: str = "agents"

    def flags(self, log_dir: Path, *extra: str) -> list[str]:
        return [f"--nnodes={self.nnodes}", "--nproc-per-node=1", f"--rdzv-backend={self.backend}",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}", "--max-restarts=0",
                f"--log-dir={log_dir}", *extra]


def events(log_dir: Path, kind: str) -> list[dict]:
    """The ``kind`` events an agent logged to ``log_dir`` so far (a line being written is skipped)."""
    found = []
    for path in log_dir.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line being written
            if event.get("event") == kind:
                found.append(event)
    return found


def start_pair(agents: Cluster, job: Job, tmp_path: Path, env: dict[str, str], script: list[str] | None = None,
               both: tuple[str, ...] = (), second: tuple[str, ...] = ()):
    """Agent 0 (the c10d store host) then agent 1; returns them with their log directories."""
    logs = [tmp_path / "logs0", tmp_path / "logs1"]
    a0 = agents.start(job.flags(logs[0], *both), script=script, env=env, name="agent0")
    if job.backend == "c10d":
        port = int(job.endpoint.rsplit(":", 1)[1])
        wait_until(lambda: listening(port) or a0.proc.poll() is not None, 30, what="store host up")
    a1 = agents.start(job.flags(logs[1], *both, *second), script=script, env=env, name="agent1")
    return a0, a1, logs


def steps_env(tmp_path: Path) -> dict[str, str]:
    """The environment of ``tests/scripts/steps.py`` stepping (almost) forever into ``tmp_path/steps``."""
    steps = tmp_path / "steps"
    steps.mkdir()
    return base_env(STEPS_LOG=str(steps), STEPS="100000", STEP_SECONDS="0.05")
