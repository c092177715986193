"""Multi-host test of the etcd backend: every node in its own network namespace with its own
address, etcd in a hub namespace, all joined by veth pairs to a bridge.  One node's link is cut
(its processes keep running): the others go on at world size 2; when the link comes back, the
node rejoins at world size 3.

Only namespaces, bridges and veths this test creates are touched (10.213.<pid>.x/24 inside them);
the host's interfaces and routes are left alone.  Everything is removed in the fixture.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available
from tests.rendezvous.etcd_job import kill_group, read_steps, start_agent, wait_for, world_steps

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.netns,
    pytest.mark.etcd,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)"),
    pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)"),
]

NODES = 3


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Net:
    """A hub namespace with a bridge, and one namespace per node linked to it by a veth pair."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.subnet = f"10.213.{os.getpid() % 250}"
        self.hub = f"elr-hub-{tag}"
        self.nodes = [f"elr-n{i}-{tag}" for i in range(NODES)]
        self.hub_veths = [f"elrh{i}-{tag}"[:15] for i in range(NODES)]
        self.created: list[str] = []

    def up(self) -> None:
        _ip("netns", "add", self.hub)
        self.created.append(self.hub)
        hub = ["-n", self.hub]
        _ip(*hub, "link", "set", "lo", "up")
        _ip(*hub, "link", "add", "br0", "type", "bridge")
        _ip(*hub, "addr", "add", f"{self.subnet}.1/24", "dev", "br0")
        _ip(*hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.nodes):
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", self.hub_veths[i],
                "netns", self.hub)
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip(*hub, "link", "set", self.hub_veths[i], "master", "br0")
            _ip(*hub, "link", "set", self.hub_veths[i], "up")

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def cut(self, i: int, up: bool = False) -> None:
        _ip("-n", self.hub, "link", "set", self.hub_veths[i], "up" if up else "down")

    def down(self) -> None:
        for ns in reversed(self.created):  # deleting a namespace removes its veths and bridge
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=10)


@pytest.fixture
def net():
    network = Net()
    try:
        network.up()
        yield network
    finally:
        network.down()


def test_partitioned_node_is_dropped_then_rejoins(tmp_path, net):
    steps = tmp_path / "steps"
    steps.mkdir()
    agents = []
    hub = ["ip", "netns", "exec", net.hub]
    cluster = EtcdCluster(1, host=f"{net.subnet}.1", wrap=hub)
    try:
        cluster.start()
        for i in range(NODES):
            agents.append(start_agent(cluster.endpoints, "netns", steps, tmp_path / f"a{i}.log", nnodes="2:3",
                                      wrap=["ip", "netns", "exec", net.nodes[i]],
                                      extra_env={"GLOO_SOCKET_IFNAME": "eth0"}))  # gloo: not the hostname's 127.x
        wait_for(lambda: len(world_steps(read_steps(steps), 3)) >= 15, 40, "training at world 3")
        net.cut(2)
        cut_at = time.time()
        rows = wait_for(lambda: world_steps(read_steps(steps), 2, after=cut_at), 30, "training at world 2")
        first_two = min(r["t"] for r in rows)
        assert all(p.poll() is None for p in agents), "an agent exited (the cut node must stay alive)"
        wait_for(lambda: len(world_steps(read_steps(steps), 2, after=cut_at)) >= 10, 30, "steady world 2")
        net.cut(2, up=True)
        restored_at = time.time()
        wait_for(lambda: len(world_steps(read_steps(steps), 3, after=restored_at)) >= 10, 60,
                 "the node rejoining at world 3")
        logs = "".join((tmp_path / f"a{i}.log").read_text(errors="replace") for i in range(NODES))
        assert "node(s) lost" in logs
        print(f"partition to first world-2 step: {first_two - cut_at:.2f} s")
    finally:
        for proc in agents:
            kill_group(proc)
        cluster.stop()
