"""A job's incarnation on etcd: a job whose every agent stalled past its lease keeps it, a crashed
one is replaced one lease TTL after its last agent's key vanished.

The old agents run in processes of their own (tests/rendezvous/etcd_node.py) so that they can be
stopped (SIGSTOP) or killed (SIGKILL) by PID; the newcomer is a handler in this process, so that
its warnings and timings are read directly.  Real etcd, real leases expiring.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
from elastrun.rendezvous.etcd import create_handler
from tests import warm
from tests.harness import REPO, base_env, wait_until
from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.etcd,
    pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)"),
]

TTL = 2.0  # lease_ttl of every node here: what the newcomer waits, and how long a silent agent lives
_ROUND = re.compile(r"round (\d+) incarnation (\w+)")


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator:
    """``start(endpoints, run_id, node_id, nnodes)``: a node process (etcd_node.py) of a job of
    ``nnodes`` (min, max) nodes; killed by PID at the end."""
    started: list[subprocess.Popen] = []

    def start(endpoints: str, run_id: str, node_id: str, nnodes: tuple[int, int]) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{node_id}.log"
        with open(log, "wb") as out:
            proc = warm.popen([sys.executable, "-m", "tests.rendezvous.etcd_node", endpoints, run_id,
                               node_id, str(TTL), *map(str, nnodes)], cwd=REPO, env=base_env(), stdout=out,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        started.append(proc)
        return proc, log

    yield start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # also ends a stopped process
        proc.wait(10)


def _rounds(log: Path) -> list[tuple[int, str]]:
    """The (round, incarnation) lines a node printed so far."""
    return [(int(m[1]), m[2]) for m in _ROUND.finditer(log.read_text(errors="replace"))]


def _agent_keys(cluster: EtcdCluster, run_id: str) -> list[str]:
    return [k for k in cluster.list_keys() if k.startswith(f"/elastrun/{run_id}/agents/")]


class Newcomer:
    """A handler of this process that joins the job's next round in a thread and records its
    rendezvous warnings, each with the monotonic time it came."""

    def __init__(self, endpoints: str, run_id: str, max_nodes: int) -> None:
        conf = {"lease_ttl": str(TTL), "join_timeout": "30"}  # a failed test does not leave it waiting long
        self.handler = create_handler(RendezvousParameters("etcd", endpoints, run_id, 1, max_nodes, config=conf))
        self.warnings: list[tuple[float, str, dict]] = []
        self.waiting = threading.Event()
        self.handler.on_warning = self._warned
        self.result = None
        self.error: BaseException | None = None
        self.started = 0.0
        self._thread = threading.Thread(target=self._join, daemon=True)

    def _warned(self, message: str, fields: dict) -> None:
        self.warnings.append((time.monotonic(), message, fields))
        if fields.get("kind") == "incarnation_wait":
            self.waiting.set()

    def _join(self) -> None:
        self.started = time.monotonic()
        try:
            self.result = self.handler.next_round(NodeInfo("newcomer", "127.0.0.1", 1))
        except BaseException as exc:  # reported by the test
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the newcomer did not finish its round; warnings: {self.warnings}"
        assert self.error is None, f"the newcomer failed: {self.error!r}"

    def kinds(self) -> list[str]:
        return [fields.get("kind", "") for _, _, fields in self.warnings]


def test_stalled_job_keeps_its_incarnation(nodes):
    """Every agent of a live job stops past its lease (SIGSTOP: an overloaded machine); a newcomer
    finds the job's incarnation without a live agent, waits, and joins it once the agent is back."""
    with EtcdCluster(1) as cluster:
        proc, log = nodes(cluster.endpoints, "stall", "old", (1, 2))
        [(_, incarnation)] = wait_until(lambda: _rounds(log), 30, what="the old node's first round")
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: not _agent_keys(cluster, "stall"), TTL + 10, what="the stopped node's lease to expire")
        newcomer = Newcomer(cluster.endpoints, "stall", max_nodes=2)
        try:
            newcomer.start()
            # The newcomer read the job with no live agent (the line comes after that read) and
            # watches for one from that read's revision on: the old node may come back at any time.
            assert newcomer.waiting.wait(15), f"no waiting line; warnings: {newcomer.warnings}"
            os.kill(proc.pid, signal.SIGCONT)
            newcomer.join(30)
            assert newcomer.handler._epoch == incarnation, newcomer.warnings
            assert "incarnation_replaced" not in newcomer.kinds()
            assert newcomer.result.round >= 1, "the job's rounds were lost"
            # The old node found its lease gone and registered again in its own incarnation.
            wait_until(lambda: len(_rounds(log)) >= 2, 30, what="the old node's next round")
            assert {inc for _, inc in _rounds(log)} == {incarnation}
        finally:
            newcomer.handler.close()


def test_crashed_job_is_replaced_after_one_lease_ttl(nodes):
    """The agent of a job is killed; a newcomer with the same job id waits one lease TTL for an
    agent, then starts a new incarnation and removes the crashed one's keys."""
    with EtcdCluster(1) as cluster:
        proc, _ = nodes(cluster.endpoints, "crash", "old", (1, 1))
        # Killed once its round 0 closed (maybe while it imports torch for the workers' store).
        [result] = wait_until(lambda: [k for k in cluster.list_keys() if k.endswith("/r0/result")], 30,
                              what="the old node's first round")
        incarnation = result.split("/")[4]  # /elastrun/crash/e/<incarnation>/r0/result
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not _agent_keys(cluster, "crash"), TTL + 10, what="the killed node's lease to expire")
        assert any(k.startswith(f"/elastrun/crash/e/{incarnation}/") for k in cluster.list_keys()), \
            "the crashed job should have left its incarnation's keys"
        newcomer = Newcomer(cluster.endpoints, "crash", max_nodes=1)
        try:
            newcomer.start()
            newcomer.join(30)
            assert newcomer.kinds() == ["incarnation_wait", "incarnation_replaced"], newcomer.warnings
            (waited_at, _, _), (replaced_at, message, _) = newcomer.warnings
            # One wait of one lease TTL, right after the first read (the round that follows may
            # import torch for the workers' store: not timed).
            assert waited_at - newcomer.started < 1.0 and TTL <= replaced_at - waited_at <= TTL + 1.0, \
                [(round(t - newcomer.started, 3), kind) for t, _, kind in newcomer.warnings]
            assert newcomer.handler._epoch != incarnation and incarnation in message
            assert (newcomer.result.round, newcomer.result.generation) == (0, 0)
            assert not any(incarnation in k for k in cluster.list_keys()), "the crashed incarnation's keys remain"
        finally:
            newcomer.handler.close()
        assert cluster.list_keys() == []
