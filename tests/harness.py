"""Helpers for end-to-end tests: start real agents, read their workers' step logs, clean up by PID.

Every process a test starts is tracked; teardown kills it and every descendant it had (found with
psutil while it was alive), so a failing test leaves nothing behind.  Waiting loops are bounded.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests import warm

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
STEPS_SCRIPT = SCRIPTS / "steps.py"

_STEP_LINE = re.compile(r"step (\d+) rank (\d+) world (\d+) gen (\S+) t ([\d.]+)")


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A free port for a test's server, below the kernel's ephemeral range, never handed out twice in one run.

    A port taken from the ephemeral range (``bind(0)``) is free only a moment: the kernel also gives that range
    to outgoing connections, so another process's connection could take the port a test's agent was about to
    listen on ("address already in use": an etcd member's own peer connection, once; an agent's store, once).
    Under pytest-xdist each worker draws from a slice of its own, so two tests running at once are never
    handed the same port either.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    start = max(1024, low - 12000)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = (low - start) // max(1, workers)
    start += size * (worker % max(1, workers))
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(start, start + size)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port below {low} on {host} after 200 tries")


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.update(extra)
    return env


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on ``host:port`` (e.g. a c10d store host agent)."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.1, what: str = "") -> object:
    """Poll ``predicate`` until truthy (returned) or raise AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what or predicate}")


@dataclass
class Step:
    step: int
    rank: int
    world: int
    gen: str
    t: float


def read_steps(log_dir: Path) -> list[Step]:
    """Every step line of every rank file under ``log_dir``, in time order."""
    steps = []
    for path in log_dir.glob("rank*.log"):
        for line in path.read_text().splitlines():
            m = _STEP_LINE.match(line)
            if m:
                steps.append(Step(int(m[1]), int(m[2]), int(m[3]), m[4], float(m[5])))
    return sorted(steps, key=lambda s: s.t)


class Agent:
    """One ``elastrun`` agent started as a subprocess; output goes to a file."""

    def __init__(self, proc: subprocess.Popen, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.known_pids: set[int] = {proc.pid}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def descendants(self) -> list[int]:
        try:
            pids = [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            pids = []
        self.known_pids.update(pids)
        return pids

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {self.pid} still running after {timeout:g} s; output:\n{self.output()[-3000:]}"
            ) from None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.descendants()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)


class Cluster:
    """Starts agents of one or more jobs for a test and guarantees their clean-up."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.agents: list[Agent] = []

    def start(self, flags: list[str], script: list[str] | None = None, env: dict[str, str] | None = None,
              name: str | None = None) -> Agent:
        name = name or f"agent{len(self.agents)}"
        log_path = self.tmp / f"{name}.out"
        cmd = [sys.executable, "-m", "elastrun", *flags, *(script or [str(STEPS_SCRIPT)])]
        with open(log_path, "wb") as out:
            proc = warm.popen(cmd, cwd=REPO, env=env or base_env(), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        agent = Agent(proc, log_path)
        self.agents.append(agent)
        return agent

    def pids(self) -> set[int]:
        """Every live process this cluster started, and their descendants."""
        pids: set[int] = set()
        for agent in self.agents:
            agent.descendants()
            pids |= set(alive(agent.known_pids))
        return pids

    def cleanup(self) -> None:
        pids: set[int] = set()
        for agent in self.agents:
            agent.descendants()
            pids |= agent.known_pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(10)
        remove_runtime_dirs({agent.proc.pid for agent in self.agents})

    def outputs(self) -> str:
        return "\n".join(f"--- {a.log_path.name} ---\n{a.output()[-4000:]}" for a in self.agents)


def remove_runtime_dirs(agent_pids: set[int]) -> None:
    """The node-memory and temporary directories of these agents (a SIGKILLed agent cannot remove its
    own; the next agent on the host would sweep them, but a test leaves nothing behind)."""
    for pattern in ("/dev/shm/elastrun-*", f"{tempfile.gettempdir()}/elastrun-agent-*"):
        for path in Path("/").glob(pattern.lstrip("/")):
            try:
                owner = int((path / "owner.pid").read_text())
            except (OSError, ValueError):
                continue
            if owner in agent_pids and not alive([owner]):
                shutil.rmtree(path, ignore_errors=True)


def alive(pids: list[int] | set[int]) -> list[int]:
    """The PIDs of ``pids`` that still run (zombies count as gone)."""
    result = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                result.append(pid)
        except psutil.Error:
            pass
    return result


@contextlib.contextmanager
def cluster(tmp: Path) -> Iterator[Cluster]:
    c = Cluster(tmp)
    try:
        yield c
    finally:
        c.cleanup()
