"""The chaos harness's faults: which may be drawn, how each is injected and measured (a mixin of
:class:`tests.chaos.harness.ChaosJob`, which owns the processes and the job's progress).

Faults (:data:`KINDS`): a worker SIGKILLed, a worker exiting 1, a worker hung (SIGSTOP), an agent
SIGKILLed (a lost node), an agent SIGTERMed (pre-emption), a node joining (after every node
removal the next fault brings a node back, so capacity returns), an etcd member SIGKILLed
(restarted once training went on without it), a node cut off the network (network namespaces,
root only; the link comes back once the others re-formed) and a slow node (its agent and workers
SIGSTOPped for ``slow_seconds``, below every timeout, so nothing may restart).

Faults are injected one at a time, each once the job trains steadily at its expected world size,
so each one's detection and recovery can be measured on its own:

* detection: injection → the first event that names it (``worker_failure``, ``hang_detected``, a
  survivor's ``restart``/``node_lost``, ``nodes_waiting``);
* restart: injection → the agents' ``recovered`` event (all workers started again);
* first step: injection → the first step record of the new worker group at the expected size
  (for the faults that must not restart anything: the end of the fault → the next step);
* steps lost: the newest step run before the new group, minus the step the new group restored.

With c10d the agent that hosts the store (node 0, started first) is never removed or cut off: the
c10d backend has a documented single point of failure there.  With etcd any node may go.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil

from tests.chaos import records

if TYPE_CHECKING:
    from tests.chaos.harness import JobSpec, Node
    from tests.chaos.records import StepLog

KINDS = ("worker_kill", "worker_exit", "worker_hang", "agent_kill", "agent_term", "node_join",
         "etcd_kill", "partition", "slow_node")
WORKER_KINDS = ("worker_kill", "worker_exit", "worker_hang")
NODE_KINDS = ("agent_kill", "agent_term", "node_join", "partition")
REMOVALS = ("agent_kill", "agent_term", "partition")
#: Faults after which nothing may restart: the job only stalls.
QUIET_KINDS = ("etcd_kill", "slow_node")




@dataclass
class Fault:
    """One injected fault and what was measured."""

    kind: str
    node: int
    t0: float
    detect: float | None = None
    restart: float | None = None
    first_step: float | None = None
    steps_lost: int | None = None
    logged: bool = False
    note: str = ""
    #: PIDs of the workers that outlived the fault (every worker of the group but the faulted one and
    #: those of a removed node), and those of them that were in the new group (kept their process).
    survivors: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    #: For each survivor that was started anew instead: ``"pid: cause"``.
    fallbacks: list[str] = field(default_factory=list)


class FaultInjection:
    """The fault half of :class:`~tests.chaos.harness.ChaosJob` (see the module docstring)."""

    spec: JobSpec
    nodes: list[Node]
    faults: list[Fault]
    steps: StepLog
    pending_join: bool
    net: Any
    etcd: Any
    # and ChaosJob's methods: up_nodes, expected_world, steady, first_step, worker_pids, node_id,
    # events, start_node, _wait

    # ------------------------------------------------------------------ the schedule
    def allowed(self) -> list[str]:
        if self.pending_join:
            return ["node_join"]
        up = self.up_nodes()
        kinds = []
        for kind in self.spec.kinds:
            if kind in REMOVALS and not (len(up) > self.spec.min_nodes and self.removable()):
                continue
            if kind == "node_join" and len(up) == self.spec.nodes:
                continue
            kinds.append(kind)
        return kinds

    def removable(self) -> list[Node]:
        """Nodes that may be removed: any up node with etcd; with c10d not node 0 (the store host)."""
        return [n for n in self.up_nodes() if n.index != 0 or self.spec.backend != "c10d"]

    def run_faults(self) -> None:
        """Inject ``spec.faults`` faults, one at a time, each after the job trains steadily."""
        since = time.time()
        for _ in range(self.spec.faults):
            self._wait(lambda s=since: self.steady(s), self.spec.fault_timeout, "steady training")
            time.sleep(self.rng.uniform(0.0, 0.4))
            kinds = self.allowed()
            if not kinds:
                raise RuntimeError(f"no fault kind of {self.spec.kinds} can be injected now")
            kind = self.rng.choice(kinds)
            fault = getattr(self, f"_inject_{kind}")()
            self.faults.append(fault)
            since = time.time()
        if self.pending_join:  # bring capacity back before the end
            self._wait(lambda s=since: self.steady(s), self.spec.fault_timeout, "steady training")
            self.faults.append(self._inject_node_join())
            since = time.time()
        self._wait(lambda s=since: self.steady(s), self.spec.fault_timeout, "steady training")

    # ------------------------------------------------------------------ faults that restart the group
    def _restarting(self, kind: str, node: Node, inject, world_after: int, target: int | None = None) -> Fault:
        """Inject, then wait for the first step of a new group of ``world_after`` ranks.

        ``target``: the PID of the faulted worker.  It and the workers of the node being removed (no
        longer ``up`` when this is called) are not survivors; every other worker is."""
        self.steps.refresh()
        gen0 = self.steps.max_generation()
        survivors = [pid for n in self.up_nodes() for pid in self.worker_pids(n) if pid != target]
        t0 = time.time()
        fault = Fault(kind, node.index, t0, survivors=sorted(survivors))
        inject()
        try:
            rec = self._wait(lambda: self.first_step(t0, gen0 + 1, world_after), self.spec.fault_timeout,
                             f"training to resume after {kind}")
        except TimeoutError as exc:
            fault.note = str(exc)
            return fault
        fault.first_step = rec["t"] - t0
        restored = [r for r in records.restores(self.out) if r["g"] == rec["g"]]
        before = [r["s"] for r in self.steps.records if r["g"] < rec["g"]]
        if restored and before:
            fault.steps_lost = max(0, max(before) - min(r["s"] for r in restored))
        self._read_events(fault, node)
        if self.spec.reform:
            self._read_kept(fault, {r["p"] for r in restored})
        return fault

    def _read_kept(self, fault: Fault, new_group: set[int]) -> None:
        """Which survivors are in the new group with their PID; why each of the others is not."""
        fault.kept = [pid for pid in fault.survivors if pid in new_group]
        evs = [e for e in self.events() if e["ts"] >= fault.t0]
        for pid in fault.survivors:
            if pid in new_group:
                continue
            told = [e for e in evs if e.get("pid") == pid and e["event"] in ("reform_fallback", "worker_exit")]
            if not told:
                cause = "no event names it"
            elif told[0]["event"] == "reform_fallback":
                cause = told[0]["cause"]
            else:
                e = told[0]
                how = e.get("signal") or f"exit code {e.get('exitcode')}"
                cause = f"exited on its own ({how})"
            fault.fallbacks.append(f"{pid}: {cause}")

    def _pick_worker(self) -> tuple[Node, int]:
        node = self.rng.choice(self.up_nodes())
        pids = self._wait(lambda: self.worker_pids(node), 10, f"the workers of node {node.index}")
        return node, self.rng.choice(sorted(pids))

    def _inject_worker_kill(self) -> Fault:
        node, pid = self._pick_worker()
        return self._restarting("worker_kill", node, lambda: os.kill(pid, signal.SIGKILL), self.expected_world(), pid)

    def _inject_worker_exit(self) -> Fault:
        node, pid = self._pick_worker()
        return self._restarting("worker_exit", node, lambda: os.kill(pid, signal.SIGUSR2), self.expected_world(), pid)

    def _inject_worker_hang(self) -> Fault:
        node, pid = self._pick_worker()
        return self._restarting("worker_hang", node, lambda: os.kill(pid, signal.SIGSTOP), self.expected_world(), pid)

    def _signal_agent(self, kind: str, sig: int) -> tuple[Fault, Node]:
        """Send ``sig`` to a removable node's agent; the node is down until a later join."""
        node = self.rng.choice(self.removable())
        self.node_id(node)
        node.state = "down"
        self.pending_join = True
        assert node.proc is not None
        pid = node.proc.pid
        return self._restarting(kind, node, lambda: os.kill(pid, sig), self.expected_world()), node

    def _inject_agent_kill(self) -> Fault:
        return self._signal_agent("agent_kill", signal.SIGKILL)[0]

    def _inject_agent_term(self) -> Fault:
        fault, node = self._signal_agent("agent_term", signal.SIGTERM)
        assert node.proc is not None
        try:
            code = node.proc.wait(30)
            fault.note += f" agent exit code {code}"
        except subprocess.TimeoutExpired:
            fault.note += " agent still running 30 s after SIGTERM"
        return fault

    def _inject_node_join(self) -> Fault:
        node = next(n for n in self.nodes if n.state == "down")
        if node.proc is not None and node.proc.poll() is None:  # a SIGTERMed agent still leaving
            node.proc.wait(30)
        self.pending_join = False
        world = self.expected_world() + self.spec.nproc
        return self._restarting("node_join", node, lambda: self.start_node(node), world)

    def _inject_partition(self) -> Fault:
        node = self.rng.choice(self.removable())
        self.node_id(node)
        node.state = "cut"
        fault = self._restarting("partition", node, lambda: self.net.cut(node.index), self.expected_world())
        healed = time.time()
        self.net.cut(node.index, up=True)
        node.state = "up"
        self.steps.refresh()
        gen0 = self.steps.max_generation()
        try:
            rec = self._wait(lambda: self.first_step(healed, gen0 + 1, self.expected_world()),
                             self.spec.fault_timeout, "the cut node to rejoin")
            fault.note += f" rejoined {rec['t'] - healed:.2f}s after the link came back"
        except TimeoutError as exc:
            fault.note += f" {exc}"
            fault.logged = False
        return fault

    # ------------------------------------------------------------------ faults that must not restart it
    def _quiet(self, kind: str, node: int, t0: float, resumed_after: float) -> Fault:
        fault = Fault(kind, node, t0)
        gen0 = self.steps.max_generation()
        try:
            rec = self._wait(lambda: self.first_step(resumed_after, -1, None), self.spec.fault_timeout,
                             f"training to go on after {kind}")
            fault.first_step = rec["t"] - resumed_after
            fault.steps_lost = 0 if rec["g"] == gen0 else None
        except TimeoutError as exc:
            fault.note = str(exc)
        time.sleep(0.5)
        self._read_events(fault, self.nodes[node])
        return fault

    def _inject_slow_node(self) -> Fault:
        node = self.rng.choice(self.up_nodes())
        assert node.proc is not None
        tree = [psutil.Process(node.proc.pid)]
        try:
            tree += tree[0].children(recursive=True)
        except psutil.Error:
            pass
        t0 = time.time()
        for p in tree:
            _signal(p, signal.SIGSTOP)
        time.sleep(self.spec.slow_seconds)
        for p in tree:
            _signal(p, signal.SIGCONT)
        return self._quiet("slow_node", node.index, t0, time.time())

    def _inject_etcd_kill(self) -> Fault:
        member = self.rng.randrange(3)
        t0 = time.time()
        self.etcd.kill(member)
        fault = self._quiet("etcd_kill", member, t0, t0)
        self._wait(lambda: self.steady(time.time() - 1.0, 3), self.spec.fault_timeout, "training without a member")
        self.etcd.restart(member)
        fault.note += f" member m{member} restarted"
        return fault

    # ------------------------------------------------------------------ reading the logs
    def _read_events(self, fault: Fault, node: Node) -> None:
        """Find the events that show the fault's detection and recovery; set ``logged``."""
        evs = [e for e in self.events() if e["ts"] >= fault.t0]
        nid = self.node_id(node) if node.proc is not None else node.node_id

        def first(pred) -> float | None:
            ts = [e["ts"] for e in evs if pred(e)]
            return min(ts) - fault.t0 if ts else None

        others = {"restart", "node_lost", "nodes_waiting"}
        if fault.kind == "worker_kill":
            fault.detect = first(lambda e: e["event"] == "worker_failure" and e["node"] == nid
                                 and e.get("signal") == "SIGKILL")
        elif fault.kind == "worker_exit":
            fault.detect = first(lambda e: e["event"] == "worker_failure" and e["node"] == nid
                                 and e.get("exitcode") == 1)
        elif fault.kind == "worker_hang":
            fault.detect = first(lambda e: e["event"] == "hang_detected")
            target = first(lambda e: e["event"] == "hang_detected" and e["node"] == nid)
            if target is None:
                fault.note += " (the hang was caught on a peer's node)"
        elif fault.kind in ("agent_kill", "partition"):
            fault.detect = first(lambda e: e["node"] != nid and (
                (e["event"] == "node_lost" and nid in e.get("lost", []))
                or (e["event"] == "restart" and nid in e.get("reason", ""))))
        elif fault.kind in ("agent_term", "node_join"):
            fault.detect = first(lambda e: e["node"] != nid and e["event"] in others)
        if fault.kind in QUIET_KINDS:
            alarms = [e for e in evs if e["event"] in ("worker_failure", "hang_detected", "restart")]
            fault.logged = not alarms and fault.first_step is not None
            if alarms:
                fault.note += f" false alarm: {alarms[0]['event']} on {alarms[0]['node']}"
            return
        fault.restart = first(lambda e: e["event"] == "recovered")
        fault.logged = fault.detect is not None and fault.restart is not None and fault.first_step is not None
        if fault.kind == "agent_term":
            left = [e for e in evs if e["node"] == nid and e["event"] == "signal" and e.get("signal") == "SIGTERM"]
            fault.logged = fault.logged and bool(left)
        if fault.kind == "node_join":
            joined = [e for e in evs if e["event"] == "round_closed" and nid in e.get("members", [])]
            fault.logged = fault.logged and bool(joined)


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass
