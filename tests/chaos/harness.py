"""The chaos harness: one elastic training job (tests/chaos/trainer.py under real elastrun agents),
its processes, its progress and its evidence.  The faults, their schedule and what is measured of
each: :mod:`tests.chaos.faults`; a whole run with its invariants: :mod:`tests.chaos.run`.

A stall (no committed step for ``JobSpec.stall_after`` seconds, seen by every wait of the
harness), a timeout or an agent left running is a finding: the stacks of every process of the run
are taken at once (:meth:`ChaosJob.snapshot`), and the clean-up keeps the work directory
(:mod:`tests.evidence`) and prints where.
Every process is started in its own session and tracked by PID (psutil); nothing is looked up by
name.  Every wait is bounded.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests import evidence, warm
from tests.chaos import records, verify
from tests.chaos.faults import KINDS, Fault, FaultInjection
from tests.chaos.records import StepLog
from tests.harness import free_port, listening

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("trainer.py")

@dataclass
class JobSpec:
    """What one chaos job runs and which faults it may draw."""

    backend: str = "c10d"
    seed: int = 1
    faults: int = 8
    kinds: tuple[str, ...] = ("worker_kill", "worker_exit", "worker_hang", "agent_kill", "agent_term",
                              "node_join", "slow_node")
    nodes: int = 3
    min_nodes: int = 2
    nproc: int = 1
    #: fork: the warm pool (workers forked from a template that imported torch); spawn: exec each one.
    start_method: str = "fork"
    #: Train through ``et.run``: survivors of a change re-form in their process instead of restarting.
    reform: bool = False
    #: Shard the trainer's model with FSDP2: every rank snapshots its shard, restores reshard.
    sharded: bool = False
    netns: bool = False
    samples: int = 96
    batch: int = 4
    pace: float = 0.05
    hang_timeout: float = 3.0
    #: Seconds without a committed step after which the job is stalled: its evidence is taken at once
    #: (stacks first), and after every fault the job must step again within this (the stall invariant).
    stall_after: float = 30.0
    max_restarts: int = 100000
    slow_seconds: float = 1.0
    fault_timeout: float = 60.0
    end_timeout: float = 120.0

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
        if self.backend not in ("c10d", "etcd"):
            raise ValueError(f"backend must be c10d or etcd, got {self.backend!r}")
        if "etcd_kill" in self.kinds and self.backend != "etcd":
            raise ValueError("etcd_kill needs backend='etcd'")
        if "partition" in self.kinds and not self.netns:
            raise ValueError("partition needs netns=True (network namespaces, root)")
        if self.netns and (self.backend != "etcd" or self.nodes != 3):
            raise ValueError("the netns job runs 3 nodes on the etcd backend")
        if not 1 <= self.min_nodes <= self.nodes:
            raise ValueError(f"min_nodes must be in [1, {self.nodes}], got {self.min_nodes}")

    @property
    def name(self) -> str:
        """``c10d et.run FSDP2 seed 3``: backend, namespaces, trainer, model and seed."""
        return (f"{self.backend}{' netns' if self.netns else ''}{' et.run' if self.reform else ''}"
                f"{' FSDP2' if self.sharded else ''} seed {self.seed}")


@dataclass
class RunResult:
    """A finished chaos job: its faults, the invariants' verdicts and a few facts."""

    spec: JobSpec
    faults: list[Fault] = field(default_factory=list)
    checks: list[verify.Check] = field(default_factory=list)
    duration: float = 0.0
    exit_codes: list[int | None] = field(default_factory=list)
    worlds: list[int] = field(default_factory=list)
    steps: int = 0
    #: Where the run's work directory was kept (a violation, a stall, a timeout), else None.
    evidence: Path | None = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def summary(self) -> str:
        lines = [f"{self.spec.name}: "
                 f"{len(self.faults)} faults, {self.steps} steps, {self.duration:.0f} s, exit codes {self.exit_codes}"]
        lines += [f"  [{'ok' if c.ok else 'VIOLATED'}] {c.name}: {c.detail}" for c in self.checks]
        if self.evidence is not None:
            lines.append(f"  evidence kept: {self.evidence}")
        for f in self.faults:
            kept = f" kept {len(f.kept)}/{len(f.survivors)}" if self.spec.reform else ""
            lines.append(f"  {f.kind:<12} node {f.node}: detect {_fmt(f.detect)} restart {_fmt(f.restart)} "
                         f"first step {_fmt(f.first_step)} lost {f.steps_lost}{kept} logged {f.logged} {f.note}"
                         + "".join(f"\n    fallback {c}" for c in f.fallbacks))
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


@dataclass
class Node:
    """One agent slot; ``proc`` is the agent of its latest start."""

    index: int
    proc: subprocess.Popen | None = None
    state: str = "down"  # up | down | cut
    node_id: str | None = None


class ChaosJob(FaultInjection):
    """Runs one job; use as a context manager so that everything is cleaned up."""

    def __init__(self, spec: JobSpec, work: Path | None = None) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.work = work or Path(tempfile.mkdtemp(prefix="elastrun-chaos-"))
        self.out = self.work / "data"
        self.logs = self.work / "logs"
        self.hold = self.work / "hold"
        self.run_id = f"chaos{os.getpid()}x{spec.seed}x{int(time.time() * 1000) % 100000}"
        self.nodes = [Node(i) for i in range(spec.nodes)]
        self.tracked: dict[int, float] = {}
        self.steps = StepLog(self.out)
        self.etcd: Any = None
        self.net: Any = None
        self.endpoint = ""
        self.faults: list[Fault] = []
        self.pending_join = False
        #: What went wrong, in order (a stall, a timeout, an agent that exited by itself): the reasons
        #: the evidence is kept for.  :meth:`snapshot` adds to it.
        self.findings: list[str] = []
        #: The stall under way (the newest step's time when it was seen), so it is snapshotted once.
        self._stall_seen: float | None = None
        #: Where :meth:`cleanup` kept the work directory (None: removed).
        self.kept: Path | None = None
        self._hb_dirs: set[Path] = set()
        self._tmp_before = self._agent_tmp_dirs()

    # ------------------------------------------------------------------ set-up / tear-down
    def __enter__(self) -> ChaosJob:
        try:
            self.out.mkdir(parents=True)
            self.logs.mkdir()
            self.hold.write_text("")
            if self.spec.netns:
                from tests.netns.test_etcd_partition import Net

                self.net = Net()
                self.net.up()
            if self.spec.backend == "etcd":
                from tests.rendezvous.etcd_cluster import EtcdCluster

                if self.net is not None:
                    self.etcd = EtcdCluster(3, host=f"{self.net.subnet}.1", wrap=self._hub())
                else:
                    self.etcd = EtcdCluster(3)
                self.etcd.start()
                self.endpoint = self.etcd.endpoints
            else:
                self.endpoint = f"127.0.0.1:{free_port()}"
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def _hub(self) -> list[str]:
        return ["ip", "netns", "exec", self.net.hub]

    def snapshot(self, why: str) -> None:
        """Something went wrong (``why``): before anything is killed, every live process of the run
        writes its Python stacks to its log (:mod:`tests.evidence`) and is listed in
        ``processes.txt``; the clean-up then keeps the work directory."""
        self.track()
        stamp = time.strftime("%H:%M:%S")
        self.findings.append(f"{stamp} {why}")
        print(f"chaos: {why}; taking the stacks of every process of the run", file=sys.stderr, flush=True)
        with open(self.work / "findings.txt", "a", encoding="utf-8") as fh:
            fh.write(f"{stamp} {why}\n")
        live = [n.proc.pid for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        evidence.dump_stacks([*live, *self.tracked], self.work)

    def watch_stall(self, context: str) -> bool:
        """Whether the job is stalled (no committed step for ``spec.stall_after`` s); the first time a
        stall is seen its evidence is taken (:meth:`snapshot`).  ``context``: what the harness waits for."""
        self.steps.refresh()
        newest = self.steps.newest
        if not newest or time.time() - newest < self.spec.stall_after:
            return False
        if self._stall_seen != newest:
            self._stall_seen = newest
            self.snapshot(f"stall: no committed step for {time.time() - newest:.0f} s (since "
                          f"{time.strftime('%H:%M:%S', time.localtime(newest))}) while waiting for {context}")
        return True

    def cleanup(self, keep: str | None = None) -> None:
        """Kill every process of the run (by PID), remove etcd, namespaces and directories; keep the
        work directory as evidence (:func:`tests.evidence.keep`, the path printed) when something
        went wrong (``keep`` or :attr:`findings`) or ``CHAOS_KEEP`` is set."""
        self.track()
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                try:
                    os.killpg(node.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid, created in self.tracked.items():
            _kill_if_same(pid, created)
        for node in self.nodes:
            if node.proc is not None:
                try:
                    node.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        if self.etcd is not None:
            self.etcd.stop()
        if self.net is not None:
            self.net.down()
        self._remove_leftover_shm()
        why = "\n".join([*self.findings, *([keep] if keep else [])])
        if why or os.environ.get("CHAOS_KEEP"):  # for a post-mortem: logs, records, stacks
            self.kept = evidence.keep(self.work, why or "CHAOS_KEEP was set",
                                      f"chaos-{self.spec.backend}-seed{self.spec.seed}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    @staticmethod
    def _agent_tmp_dirs() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("elastrun-agent-*"))

    def _remove_leftover_shm(self) -> None:
        """What SIGKILLed agents could not remove: their snapshot directories (named by run id), their
        workers' heartbeat directories (read from the workers' environment) and their temporary
        directories (new since the start, empty — this job passes --log-dir — and idle for 5 s)."""
        for d in [*Path("/dev/shm").glob(f"elastrun-{self.run_id}-*"), *self._hb_dirs]:
            shutil.rmtree(d, ignore_errors=True)
        now = time.time()
        for d in self._agent_tmp_dirs() - self._tmp_before:
            try:
                if not any(d.iterdir()) and now - d.stat().st_mtime > 5:
                    d.rmdir()
            except OSError:
                continue

    # ------------------------------------------------------------------ processes
    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO)
        env["OMP_NUM_THREADS"] = "1"
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        env.pop("ELASTRUN_SNAPSHOT_DIR", None)
        if self.net is not None:
            env["GLOO_SOCKET_IFNAME"] = "eth0"
        return env

    def _argv(self, node: Node) -> list[str]:
        s = self.spec
        wrap = ["ip", "netns", "exec", self.net.nodes[node.index]] if self.net is not None else []
        return [
            *wrap, sys.executable, "-m", "elastrun", f"--nnodes={s.min_nodes}:{s.nodes}",
            f"--nproc-per-node={s.nproc}", f"--rdzv-backend={s.backend}", f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}", f"--max-restarts={s.max_restarts}", f"--hang-timeout={s.hang_timeout:g}",
            f"--start-method={s.start_method}", "--preload=torch,elastrun.train", f"--log-dir={self.logs}",
            str(TRAINER), "--out", str(self.out), "--ckpt", str(self.work / "ckpt"), "--every", "50",
            "--hold-file", str(self.hold), "--pace", str(s.pace), "--samples", str(s.samples),
            "--batch", str(s.batch), *(["--reform"] if s.reform else []),
            *(["--sharded"] if s.sharded else []),
        ]  # fmt: skip

    def start_node(self, node: Node) -> None:
        log = open(self.work / f"agent{node.index}.log", "ab")  # noqa: SIM115 - handed to the child
        node.proc = warm.popen(self._argv(node), stdout=log, stderr=subprocess.STDOUT, env=self._env(),
                               cwd=REPO, start_new_session=True)
        log.close()
        node.state = "up"
        node.node_id = None
        self.tracked[node.proc.pid] = psutil.Process(node.proc.pid).create_time()

    def start(self) -> None:
        """Start every node (c10d: node 0 first, once it listens on the endpoint, the others)."""
        self.start_node(self.nodes[0])
        if self.spec.backend == "c10d":
            host, port = self.endpoint.rsplit(":", 1)
            self._wait(lambda: listening(int(port), host), 30, "the c10d store of node 0")
        for node in self.nodes[1:]:
            self.start_node(node)

    def track(self) -> None:
        """Remember every descendant of every live agent (PID and start time)."""
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            try:
                for child in psutil.Process(node.proc.pid).children(recursive=True):
                    if child.pid not in self.tracked:
                        self.tracked[child.pid] = child.create_time()
                        self._note_heartbeat_dir(child)
            except psutil.Error:
                continue

    def _note_heartbeat_dir(self, proc: psutil.Process) -> None:
        """Remember a worker's heartbeat directory: a SIGKILLed agent cannot remove it."""
        try:
            path = proc.environ().get("ELASTRUN_HEARTBEAT_FILE")
        except psutil.Error:
            return
        if path:
            self._hb_dirs.add(Path(path).parent)

    def events(self) -> list[dict[str, Any]]:
        return records.events(self.logs)

    def node_id(self, node: Node) -> str | None:
        if node.node_id is None and node.proc is not None:
            for e in self.events():
                if e["event"] == "agent_start" and e.get("pid") == node.proc.pid:
                    node.node_id = e["node"]
        return node.node_id

    def worker_pids(self, node: Node) -> list[int]:
        """PIDs of the node's workers of its latest round that are still running."""
        nid = self.node_id(node)
        starts = [e for e in self.events() if e["node"] == nid and e["event"] == "worker_start"]
        if not starts:
            return []
        latest = max(e["round"] for e in starts)
        pids = []
        for e in starts:
            if e["round"] == latest:
                try:
                    if psutil.Process(e["pid"]).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                        pids.append(e["pid"])
                except psutil.Error:
                    pass
        return pids

    def _wait(self, predicate, timeout: float, what: str) -> Any:
        """Poll ``predicate`` until truthy (returned), watching for a stall meanwhile (its evidence is
        taken the moment it is seen, the wait goes on); TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.track()
            value = predicate()
            if value:
                return value
            if all(n.proc.poll() is not None for n in self.nodes if n.proc is not None):
                raise RuntimeError(f"every agent has exited while waiting for {what}")
            self.watch_stall(what)
            time.sleep(0.05)
        raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")

    # ------------------------------------------------------------------ training progress
    def up_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.state == "up"]

    def expected_world(self) -> int:
        return len(self.up_nodes()) * self.spec.nproc

    def steady(self, since: float, count: int = 3) -> bool:
        """``count`` steps of one group of the expected size committed after ``since``."""
        self.steps.refresh()
        recent = self.steps.after(since)
        if not recent:
            return False
        gen = max(r["g"] for r in recent)
        steps = {r["s"] for r in recent if r["g"] == gen and r["w"] == self.expected_world()}
        return len(steps) >= count

    def first_step(self, after: float, min_gen: int, world: int | None) -> dict[str, Any] | None:
        self.steps.refresh()
        found = [r for r in self.steps.after(after) if r["g"] >= min_gen and (world is None or r["w"] == world)]
        return min(found, key=lambda r: r["t"]) if found else None

    # ------------------------------------------------------------------ the end
    def finish(self) -> list[int | None]:
        """Let the job finish (remove the hold file) and wait for every agent; their exit codes."""
        self.hold.unlink(missing_ok=True)
        live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        deadline = time.monotonic() + self.spec.end_timeout
        for n in live:
            try:
                assert n.proc is not None
                n.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.track()
        stuck = [n.index for n in live if n.proc is not None and n.proc.poll() is None]
        if stuck:  # their stacks, before the clean-up kills them
            self.snapshot(f"the agents of node(s) {stuck} still ran {self.spec.end_timeout:g} s after the release")
        return [n.proc.poll() for n in live if n.proc is not None]

    def etcd_keys(self, prefix: str) -> list[str]:
        if self.net is None:
            return self.etcd.list_keys(prefix)
        return _netns_keys(self._hub(), self.etcd.endpoint(0), prefix)


def _netns_keys(wrap: list[str], endpoint: str, prefix: str) -> list[str]:
    """Keys under ``prefix`` through etcd's JSON gateway, asked from inside the hub namespace."""
    import base64
    import json

    end = bytearray(prefix.encode())
    end[-1] += 1
    body = json.dumps({"key": base64.b64encode(prefix.encode()).decode(),
                       "range_end": base64.b64encode(bytes(end)).decode(), "keys_only": True})
    out = subprocess.run([*wrap, "curl", "-s", "-m", "3", "-X", "POST", f"http://{endpoint}/v3/kv/range",
                          "-d", body], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"etcd did not answer from the hub namespace: {out.stderr.strip()}")
    return [base64.b64decode(kv["key"]).decode() for kv in json.loads(out.stdout).get("kvs", [])]


def _kill_if_same(pid: int, created: float) -> None:
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) < 0.01:
            proc.kill()
    except psutil.Error:
        pass
