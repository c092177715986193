"""Shared plumbing of the benchmarks: launcher command lines, process trees, workload logs, medians.

Every benchmark runs torchrun (``python -m torch.distributed.run``) and elastrun on the same
workload (:mod:`bench.workload`) in the same run; the figures are wall-clock times read from the
workload's own timestamps, so both launchers are measured by the same clock and the same code.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
WORKLOAD = str(ROOT / "bench" / "workload.py")
LAUNCHERS = ("torchrun", "elastrun")


def launcher_argv(which: str, flags: list[str]) -> list[str]:
    """The command line of ``which`` launcher running the workload with ``flags``."""
    if which == "torchrun":
        return [PYTHON, "-m", "torch.distributed.run", *flags, WORKLOAD]
    # Default flags on both sides: what a user gets by changing one word.
    return [PYTHON, "-m", "elastrun", *flags, WORKLOAD]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(argvs: list[list[str]], envs: list[dict[str, str]], timeout: float) -> list[tuple[int, str]]:
    """Run one process per rank of a job without a launcher (``RANK``, ``WORLD_SIZE``, a fresh
    ``MASTER_PORT`` on loopback, ``OMP_NUM_THREADS=1``, plus ``envs[rank]``); their exit codes and
    stdouts.  Whatever still runs after ``timeout`` or an error is killed."""
    port = free_port()
    procs = []
    for rank, (argv, extra) in enumerate(zip(argvs, envs, strict=True)):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(len(argvs)), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", **extra)  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


@dataclass
class Trial:
    """One run of one launcher: its temp dir, its processes, and the workload's events."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"elastrun-bench-{self.name}-"))
        self.log = self.dir / "log"
        self.log.mkdir()
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_LOG": str(self.log),
                    "TORCH_CPP_LOG_LEVEL": "ERROR", **self.env}

    def start(self, argv: list[str], tag: str = "agent") -> subprocess.Popen:
        out = open(self.dir / f"{tag}{len(self.procs)}.out", "wb")  # noqa: SIM115 - closed with the trial
        proc = subprocess.Popen(argv, env=self.env, cwd=self.dir, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        out.close()
        self.procs.append(proc)
        return proc

    def events(self) -> list[dict]:
        """All workload events so far, each with its process id, sorted by time."""
        out = []
        for path in self.log.glob("*.jsonl"):
            pid = int(path.stem)
            for line in path.read_text().splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line being written
                event["pid"] = pid
                out.append(event)
        return sorted(out, key=lambda e: e["t"])

    def all_ranks_stepped(self, world: int, after: float = 0.0, min_step: int = 0) -> float | None:
        """When every rank of a ``world``-sized group had logged a step after ``after`` (None: not yet)."""
        first: dict[int, float] = {}
        for e in self.events():
            if e["ev"] == "step" and e["world"] == world and e["t"] > after and e["n"] >= min_step:
                first.setdefault(e["rank"], e["t"])
        return max(first.values()) if len(first) == world else None

    def kill_tree(self, proc: subprocess.Popen) -> None:
        """SIGKILL an agent and everything below it (torchrun's workers would otherwise live on)."""
        kill_tree(proc.pid)
        proc.wait(10)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill_tree(proc)
        for pid in {e["pid"] for e in self.events()}:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.dir.glob("*.out")))


def kill_tree(pid: int) -> None:
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.05):
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` passes (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def fmt(value: float | None, unit: str = "s", digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f} {unit}".strip()


def ratio(elastrun: float | None, torchrun: float | None) -> str:
    if elastrun is None or torchrun is None or torchrun == 0:
        return "—"
    return f"{elastrun / torchrun:.2f}"


@dataclass
class Row:
    """One line of a result table: a metric measured for both launchers."""

    metric: str
    torchrun: list[float | None]
    elastrun: list[float | None]
    unit: str = "s"
    goal: str = ""
    note: str = ""

    def cells(self) -> list[str]:
        t, e = median(self.torchrun), median(self.elastrun)
        digits = 2 if self.unit in ("s", "CPU-s") else (0 if self.unit == "MB" else 1 if self.unit == "%" else 3)
        return [self.metric, fmt(t, self.unit, digits), fmt(e, self.unit, digits), ratio(e, t), self.goal,
                f"{sum(v is not None for v in self.torchrun)}/{len(self.torchrun)}, "
                f"{sum(v is not None for v in self.elastrun)}/{len(self.elastrun)}"
                + (f"; {self.note}" if self.note else "")]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def read_lines(children: list[subprocess.Popen]) -> list[dict]:
    """One JSON line from each child bench process (``{}`` for one that closed its stdout)."""
    return [json.loads(c.stdout.readline() or "{}") for c in children]


def tell(children: list[subprocess.Popen], word: str) -> None:
    """Send ``word`` as one line to every child bench process (e.g. ``go``, ``close``)."""
    for c in children:
        c.stdin.write(word + "\n")
        c.stdin.flush()
