"""Helpers for the third-party client tests: run an unmodified script under elastrun, inject a fault.

The scripts under ``scripts/`` are written against torch, Accelerate or Lightning only; the tests
see them the way a user does, through their console output (which elastrun prefixes with
``[node<group rank> rank<rank>]: ``), and find the worker to kill in the agent's event log.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

from elastrun.observe.events import read_log_dir
from tests.harness import Agent

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def wait_output(agent: Agent, pattern: str, timeout: float, after: int = 0) -> re.Match[str]:
    """The first match of ``pattern`` in the agent's output past offset ``after``; fails after ``timeout`` s."""
    regex = re.compile(pattern, re.MULTILINE)
    deadline = time.monotonic() + timeout
    while True:
        m = regex.search(agent.output(), after)
        if m:
            return m
        if agent.proc.poll() is not None or time.monotonic() > deadline:
            why = "the agent exited" if agent.proc.poll() is not None else f"{timeout:g} s passed"
            raise AssertionError(f"{why} before /{pattern}/ was printed:\n{agent.output()[-4000:]}")
        time.sleep(0.05)


def worker_pid(log_dir: Path, rank: int) -> int:
    """The PID of the newest worker of ``rank``, from the agents' ``worker_start`` events."""
    starts = [e for e in read_log_dir(log_dir) if e["event"] == "worker_start" and e["rank"] == rank]
    assert starts, f"no worker of rank {rank} started (events in {log_dir})"
    return int(starts[-1]["pid"])


def kill_worker(log_dir: Path, rank: int) -> int:
    """SIGKILL the newest worker of ``rank``; its PID."""
    pid = worker_pid(log_dir, rank)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return pid


def failures(log_dir: Path) -> list[dict]:
    return [e for e in read_log_dir(log_dir) if e["event"] == "worker_failure"]
