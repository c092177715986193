"""A node that waits in the rendezvous says so: who joined, who is awaited, and when it times out.

Real agents (``python -m elastrun``) of 2-node jobs started alone, with a short join timeout and a
1 s report interval (the default is 15 s), so each waits a few seconds and then fails: on c10d
(the store host; and an agent whose store host never comes), static, and etcd.  ``-q`` silences it.
"""

from __future__ import annotations

import re
import socket

import pytest

from tests.harness import free_port
from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available

pytestmark = pytest.mark.e2e

JOIN_TIMEOUT = 6
CONF = f"join_timeout={JOIN_TIMEOUT},wait_report_interval=1"
HOST = socket.gethostname()
ROUND = re.compile(r"rendezvous round 0: 1 of 2 nodes joined \((.+?)\); waiting for 1 more; time-out in (\d+) s")


def _common(tmp_path, name: str) -> list[str]:
    return ["--nnodes=2", "--nproc-per-node=1", f"--rdzv-id=wait-{name}", "--max-restarts=0"]


def _lines(output: str, pattern: re.Pattern[str]) -> list[re.Match[str]]:
    return [m for m in (pattern.search(line) for line in output.splitlines()) if m]


def _check_round_lines(output: str) -> None:
    found = _lines(output, ROUND)
    # One line a second from 1 s on, the join timeout being 6 s: 3 to 6 of them (a loaded machine may
    # start the wait late), each naming this host and a time-out that counts down.
    assert 3 <= len(found) <= JOIN_TIMEOUT, output
    assert {m[1] for m in found} == {HOST}, output
    left = [int(m[2]) for m in found]
    assert left == sorted(left, reverse=True) and left[0] <= JOIN_TIMEOUT - 1, output
    assert "did not complete within" in output, output  # then the time-out's own message


def test_a_node_waiting_alone_says_so_at_most_every_interval(tmp_path, agents):
    script = tmp_path / "job.py"
    script.write_text("print('never runs: the round never forms')\n")
    store_port, static_port, quiet_port, absent_port = (free_port() for _ in range(4))
    c10d = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store_port}", f"--rdzv-conf={CONF}"]
    host = agents.start([*_common(tmp_path, "c10d"), *c10d], [str(script)], name="c10d")
    static = agents.start([*_common(tmp_path, "static"), "--rdzv-backend=static", "--node-rank=0",
                           "--master-addr=127.0.0.1", f"--master-port={static_port}", f"--rdzv-conf={CONF}"],
                          [str(script)], name="static")
    quiet = agents.start(["-q", *_common(tmp_path, "quiet"), "--rdzv-backend=c10d",
                          f"--rdzv-endpoint=127.0.0.1:{quiet_port}", f"--rdzv-conf={CONF}"], [str(script)],
                         name="quiet")
    # Not the endpoint's host, and nothing listens there: it waits for the store host to come.
    orphan = agents.start([*_common(tmp_path, "orphan"), "--rdzv-backend=c10d",
                           f"--rdzv-endpoint=127.0.0.1:{absent_port}", f"--rdzv-conf={CONF},is_host=false"],
                          [str(script)], name="orphan")
    codes = [a.wait(60) for a in (host, static, quiet, orphan)]
    assert all(code != 0 for code in codes), agents.outputs()
    _check_round_lines(host.output())
    _check_round_lines(static.output())
    assert not _lines(quiet.output(), ROUND) and "waiting" not in quiet.output(), quiet.output()
    waits = _lines(orphan.output(), re.compile(
        rf"waiting for the rendezvous store at 127\.0\.0\.1:{absent_port}: the agent on 127\.0\.0\.1 hosts it"
        r".*; time-out in (\d+) s"))
    assert 3 <= len(waits) <= JOIN_TIMEOUT, orphan.output()


@pytest.mark.etcd
@pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)")
def test_a_node_waiting_alone_on_etcd_says_so(tmp_path, agents):
    script = tmp_path / "job.py"
    script.write_text("print('never runs: the round never forms')\n")
    with EtcdCluster(1) as cluster:
        agent = agents.start([*_common(tmp_path, "etcd"), "--rdzv-backend=etcd",
                              f"--rdzv-endpoint={cluster.endpoints}", f"--rdzv-conf={CONF}"], [str(script)],
                             name="etcd")
        assert agent.wait(60) != 0, agent.output()
        _check_round_lines(agent.output())
        assert cluster.list_keys() == [], cluster.list_keys()  # the failed job left nothing behind
