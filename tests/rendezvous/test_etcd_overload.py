"""An etcd that answers slower than ``request_timeout``, and renews leases slower than
``lease_ttl`` − ``keepalive_interval`` (overloaded): the round still forms, with one lease per agent.

A real etcd member sits behind a TCP proxy that holds every byte from the agents for ``DELAY``
seconds before passing it on (``KEEPALIVE_DELAY`` on the keep-alive stream): to the agents, a
member whose every answer takes longer than their ``request_timeout``, and which processes each
renewal ``KEEPALIVE_DELAY`` after it was sent (as etcd does when renewals wait for its applied
index; opening the stream does not wait for it).

- Before the adaptive time-outs (docs/etcd.md, "When etcd is overloaded") every request was given
  up at ``request_timeout`` and sent again, which etcd still had to carry out: the round never
  formed.  Now each agent waits longer once its requests time out (up to 4 × ``request_timeout``),
  and a lease grant sent again is the same lease.
- Before the keep-alive cadence (docs/etcd.md, "Keep-alive cadence") the next renewal was sent
  ``keepalive_interval`` after the previous *answer*: renewals reached etcd ``KEEPALIVE_DELAY`` +
  ``keepalive_interval`` = 2.17 s apart, past the 2 s TTL, and leases expired (checked: 12 and
  16 grants for 4 agents).  Now the next one goes ``keepalive_interval`` after the previous was *sent*
  (sooner when answers are slow, never sooner than ``lease_ttl`` / 6), so they reach etcd
  ``KEEPALIVE_DELAY`` apart.

Deterministic: the delays are fixed, and the round lasts several TTLs.
"""

from __future__ import annotations

import collections
import socket
import threading
import time

import pytest

from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
from elastrun.rendezvous.etcd import create_handler
from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.etcd,
    pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)"),
]

NODES = 4
DELAY = 0.6
KEEPALIVE_DELAY = 1.5
CONF = {"request_timeout": "0.4", "lease_ttl": "2", "join_timeout": "60"}


class DelayProxy:
    """Forwards 127.0.0.1:<port> to ``upstream``, delivering what clients send ``delay`` s late, and
    the renewals on a keep-alive stream (``/v3/lease/keepalive``, after its opening request)
    ``keepalive_delay`` s late."""

    def __init__(self, upstream: tuple[str, int], delay: float, keepalive_delay: float | None = None) -> None:
        self.upstream, self.delay = upstream, delay
        self.keepalive_delay = delay if keepalive_delay is None else keepalive_delay
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
                upstream = socket.create_connection(self.upstream)
            except OSError:
                return
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, self.delay), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, 0.0), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        held: collections.deque[tuple[float, bytes]] = collections.deque()
        first = True
        ready = threading.Condition()

        def deliver() -> None:
            while True:
                with ready:
                    while not held:
                        ready.wait()
                    due, chunk = held[0]
                if not chunk:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                with ready:
                    held.popleft()
                try:
                    dst.sendall(chunk)
                except OSError:
                    break
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        threading.Thread(target=deliver, daemon=True).start()
        while True:
            try:
                chunk = src.recv(65536)
            except OSError:
                chunk = b""
            with ready:
                held.append((time.monotonic() + delay, chunk))
                ready.notify()
            if first and delay and chunk.startswith(b"GET /v3/lease/keepalive"):
                delay = self.keepalive_delay  # the renewals, after the stream's opening request
            first = False
            if not chunk:
                return

    def close(self) -> None:
        self.closed.set()
        self.server.close()
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass


def test_a_round_forms_with_one_lease_per_agent_when_etcd_answers_slower_than_the_request_timeout(monkeypatch):
    from elastrun.rendezvous.etcd.client import EtcdClient

    grants: list[int] = []
    grant = EtcdClient.grant

    def counted(self, ttl: int, lease_id: int = 0) -> int:
        lease = grant(self, ttl, lease_id)
        grants.append(ttl)
        return lease

    monkeypatch.setattr(EtcdClient, "grant", counted)
    with EtcdCluster(1) as cluster:
        host, port = cluster.endpoint(0).rsplit(":", 1)
        proxy = DelayProxy((host, int(port)), DELAY, KEEPALIVE_DELAY)
        handlers = [create_handler(RendezvousParameters("etcd", f"127.0.0.1:{proxy.port}", "slow", NODES, NODES,
                                                        config=dict(CONF))) for _ in range(NODES)]
        results: dict[int, object] = {}
        errors: list[str] = []

        def join(i: int) -> None:
            try:
                results[i] = handlers[i].next_round(NodeInfo(f"n{i}", "127.0.0.1", 1))
            except Exception as exc:
                errors.append(f"{i}: {exc}")

        try:
            threads = [threading.Thread(target=join, args=(i,)) for i in range(NODES)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            assert not errors and len(results) == NODES, errors
            assert sorted(r.group_rank for r in results.values()) == list(range(NODES))
            agent_leases = [ttl for ttl in grants if ttl < 60]
            assert len(agent_leases) == NODES, grants  # one lease each: no lease lost, no grant repeated
            assert len(grants) - len(agent_leases) == 1, grants  # and the job lease
            # The time-outs grew past the delay, within their bound (4 x request_timeout).
            timeouts = {round(h._shared.read_timeout(float(CONF["request_timeout"])), 2) for h in handlers}
            assert all(DELAY < t <= 4 * float(CONF["request_timeout"]) for t in timeouts), timeouts
            # The renewals came faster than the settings' interval once answers were slow, within the bound.
            ttl = float(CONF["lease_ttl"])
            cadences = {h._keeper.cadence() for h in handlers}
            assert all(ttl / 6 - 1e-9 <= c < ttl / 3 for c in cadences), cadences
            assert not any(h._keeper.lost for h in handlers)
        finally:
            closing = [threading.Thread(target=h.close) for h in handlers]  # each close waits for etcd: together
            for t in closing:
                t.start()
            for t in closing:
                t.join(60)
            proxy.close()
