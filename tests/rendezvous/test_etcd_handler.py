"""Handler-level tests of the etcd backend on a real etcd: incarnations and configuration errors
(a crashed or stalled job's incarnation: tests/rendezvous/test_etcd_incarnation.py)."""

from __future__ import annotations

import collections
import threading
import time

import pytest

from elastrun.rendezvous.api import FailureRecord, NodeInfo, RendezvousConfigError, RendezvousParameters
from elastrun.rendezvous.etcd import create_handler, parse_config
from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available
from tests.rendezvous.joins import Joins

pytestmark = pytest.mark.e2e

needs_etcd = pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)")


def _params(endpoints: str, run_id: str = "stale", **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd", endpoints, run_id, 1, 1, config=dict(conf))


@pytest.mark.unit
def test_config_errors_name_the_key():
    with pytest.raises(RendezvousConfigError, match="unknown --rdzv-conf key 'bogus'"):
        parse_config(_params("h:1", bogus="1"))
    with pytest.raises(RendezvousConfigError, match="client_cert and client_key"):
        parse_config(_params("h:1", client_cert=__file__))
    with pytest.raises(RendezvousConfigError, match="no such file"):
        parse_config(_params("h:1", ca_cert="/nonexistent/ca.pem"))
    with pytest.raises(RendezvousConfigError, match="lease_ttl"):
        parse_config(_params("h:1", lease_ttl="1", keepalive_interval="1"))
    assert parse_config(_params("h:1", ca_cert=__file__))["protocol"] == "https"
    # Three renewals per lease TTL unless told otherwise (etcd's own client does the same).
    assert parse_config(_params("h:1"))["keepalive_interval"] == 1.0
    assert parse_config(_params("h:1", lease_ttl="9"))["keepalive_interval"] == 3.0
    assert parse_config(_params("h:1", keepalive_interval="0.5"))["keepalive_interval"] == 0.5
    with pytest.raises(RendezvousConfigError, match="without a scheme"):
        create_handler(_params("http://h:2379"))


@pytest.mark.unit
def test_proxies_are_read_from_the_environment_once(monkeypatch):
    """The client takes the proxy settings when it is made (NO_PROXY honoured), not at every request."""
    from elastrun.rendezvous.etcd.client import EtcdClient, EtcdSettings, Shared

    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    proxied = EtcdClient(EtcdSettings([("etcd.invalid", 2379)]), Shared())._clients[0].session
    assert (proxied.trust_env, proxied.proxies.get("http")) == (False, "http://proxy.invalid:3128")
    monkeypatch.setenv("NO_PROXY", "etcd.invalid")
    direct = EtcdClient(EtcdSettings([("etcd.invalid", 2379)]), Shared())._clients[0].session
    assert (direct.trust_env, direct.proxies.get("http")) == (False, None)


@needs_etcd
def test_each_agent_watches_only_what_it_acts_on():
    """Joins wake only the closer; a loss wakes the lost node's ring predecessor, which tells the rest."""
    nodes = 4
    with EtcdCluster(1) as cluster:
        handlers = [create_handler(RendezvousParameters("etcd", cluster.endpoints, "watch", nodes, nodes))
                    for _ in range(nodes)]
        results: dict[int, object] = {}
        try:
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, handlers[i].next_round(NodeInfo(f"n{i}", "127.0.0.1", 1)))) for i in range(nodes)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert len(results) == nodes
            # Before the ring watches start (each may replay its successor's join from the agent's last read).
            non_closers = [h for h in handlers if not any("/join/" in e.key for e in h._watch.since(0) or [])]
            assert len(non_closers) >= nodes - 1, "only the closer may see the joins of a round"
            q = handlers[0]._q
            ring = [m.node_id for m in sorted(results[0].members, key=lambda m: m.group_rank)]
            for i, h in enumerate(handlers):
                h.poll()  # sets up the ring watch
                successor = ring[(ring.index(f"n{i}") + 1) % nodes]
                assert h._watch.ranges() == {
                    "job": (q + "abort", q + "finished\0"),
                    "round": (q + "r0/left/", q + "r0/store\0"),
                    "ring": (q + f"r0/join/{successor}", q + f"r0/join/{successor}\0"),
                }
            # A node dies (its lease is revoked): its predecessor notices, every other member is told.
            victim = 2
            handlers[victim]._keeper.stop()
            handlers[victim]._watch.stop()
            handlers[victim]._kv.revoke(handlers[victim]._lease)
            told: set[int] = set()
            deadline = time.monotonic() + 20
            while len(told) < nodes - 1 and time.monotonic() < deadline:
                for i, h in enumerate(handlers):
                    if i != victim and i not in told and h.poll().lost_nodes == [f"n{victim}"]:
                        told.add(i)
                time.sleep(0.05)
            assert told == set(range(nodes)) - {victim}
            assert any(k.endswith(f"r0/lost/n{victim}") for k in cluster.list_keys())
        finally:
            for h in handlers:
                h.close()


@needs_etcd
def test_a_closer_sees_the_joins_that_came_while_it_woke_the_running_members(monkeypatch):
    """Node C opens round 1 (its earliest join: the closer) with too few joined to close.  Before its next
    request (waking round 0's members, ``r0/next/member``) returns, A and B join.  Their joins are not in
    the read that made C the closer; its watch of the joins must still see them.  It started at the
    client's latest revision, past both joins, and C waited for its safety-net re-check with every node
    joined (2 s; here made 60 s, so that only the watch can close the round in time)."""
    from elastrun.rendezvous.etcd import joining

    monkeypatch.setattr(joining, "_RECHECK", 60.0)
    with EtcdCluster(1) as cluster:
        handlers = [create_handler(RendezvousParameters("etcd", cluster.endpoints, "closer-watch", 2, 3,
                                                        config={"join_timeout": "30"})) for _ in range(3)]
        infos = [NodeInfo(f"n{i}", "127.0.0.1", 1) for i in range(3)]
        joins = Joins(handlers, infos)
        join, results, errors = joins.start, joins.results, joins.errors

        try:
            for thread in [join(i, 0) for i in range(3)]:
                thread.join(30)
            assert len(results) == 3 and not errors, (results, errors)
            a, b, c = handlers
            real_raise = c._raise_flag
            others: list[threading.Thread] = []

            def the_others_join_first(key: str, deadline: float) -> None:
                others.extend([join(0, 1), join(1, 1)])
                waited = time.monotonic() + 20
                while len([k for k in cluster.list_keys() if "/r1/join/" in k]) < 3 and time.monotonic() < waited:
                    time.sleep(0.01)
                real_raise(key, deadline)

            c._raise_flag = the_others_join_first
            began = time.monotonic()
            join(2, 1).join(40)
            for thread in others:  # started by C's wrapped request: known once C returned
                thread.join(40)
            assert not errors, errors
            assert {results[(1, i)].round for i in range(3)} == {1}, results
            assert time.monotonic() - began < 30, "round 1 closed only at the joiners' re-check"
        finally:
            for h in handlers:
                h.close()


def _count_requests(monkeypatch) -> collections.Counter:
    """Count the requests this process's etcd clients send, by path and outcome (observes, changes nothing)."""
    from elastrun.rendezvous.etcd.client import EtcdClient, LeaseNotFound

    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    request = EtcdClient.request

    def counted(self, path: str, body: dict, timeout: float | None = None) -> dict:
        with lock:
            counts[path] += 1
            if path == "/lease/grant" and int(body.get("TTL", 0)) >= 60:
                counts["job lease grant"] += 1  # job_ttl; an agent's lease has lease_ttl
        try:
            return request(self, path, body, timeout)
        except LeaseNotFound:
            with lock:
                counts[path + " lease not found"] += 1
            raise

    monkeypatch.setattr(EtcdClient, "request", counted)
    return counts


@needs_etcd
def test_first_agents_start_one_incarnation_with_one_job_lease(monkeypatch):
    """Agents that start a job together: one claims the start, the others wait for its incarnation;
    no agent grants a job lease only to lose a race and revoke it."""
    nodes = 6
    with EtcdCluster(1) as cluster:
        conf = {"lease_ttl": "10"}  # the race is what is measured here, not liveness on a loaded machine
        handlers = [create_handler(RendezvousParameters("etcd", cluster.endpoints, "race", nodes, nodes, config=conf))
                    for _ in range(nodes)]
        counts = _count_requests(monkeypatch)
        results: dict[int, object] = {}
        go = threading.Barrier(nodes)

        def join(i: int) -> None:
            go.wait(10)
            results[i] = handlers[i].next_round(NodeInfo(f"n{i}", "127.0.0.1", 1))

        try:
            threads = [threading.Thread(target=join, args=(i,)) for i in range(nodes)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert len(results) == nodes
            assert len({h._epoch for h in handlers}) == 1
            assert counts["job lease grant"] == 1, counts
            assert counts["/kv/lease/revoke"] == 0, counts
        finally:
            for h in handlers:
                h.close()
        assert cluster.list_keys() == []


@needs_etcd
def test_lost_lease_is_replaced_once_not_retried_in_a_loop(monkeypatch):
    """A registration that finds its lease gone asks etcd which lease it was and grants one new one,
    instead of retrying with the dead lease until the keep-alive thread notices."""
    with EtcdCluster(1) as cluster:
        handler = create_handler(_params(cluster.endpoints, "relost", lease_ttl="10"))  # not renewed below
        try:
            first = handler.next_round(NodeInfo("a", "127.0.0.1", 1))
            counts = _count_requests(monkeypatch)
            handler._keeper.stop()  # nothing renews or checks the lease from here on
            handler._kv.revoke(handler._lease)  # as if it had expired
            second = handler.next_round(NodeInfo("a", "127.0.0.1", 1))
            assert (first.round, second.round) == (0, 1)
            assert counts["/lease/grant"] == 1, counts
            assert counts["/kv/txn lease not found"] == 1, counts
        finally:
            handler.close()


def _round_together(handlers: dict[str, object], timeout: float = 60) -> dict[str, object]:
    """``next_round`` on every handler at once (one thread each); their results by node id."""
    results: dict[str, object] = {}

    def join(node: str) -> None:
        results[node] = handlers[node].next_round(NodeInfo(node, "127.0.0.1", 1))

    threads = [threading.Thread(target=join, args=(n,)) for n in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert set(results) == set(handlers)
    return results


@needs_etcd
def test_member_whose_lease_expired_as_its_round_closed_takes_its_place_back():
    """A lease that expires between the close of a round and the member taking its place (etcd too
    slow to renew it) costs that member a new lease, not the whole group a new round; once a peer
    has declared it lost, it goes to the next round and the peer with it."""
    with EtcdCluster(1) as cluster:
        conf = {"join_timeout": "30"}  # without the fix, a waits for b in round 1 until this
        a, b = (create_handler(RendezvousParameters("etcd", cluster.endpoints, "late", 2, 2, config=conf))
                for _ in range(2))
        try:
            assert {r.round for r in _round_together({"a": a, "b": b}).values()} == {0}
            # As if a's lease had expired while it was still taking its place in round 0:
            a._joining, a._round, a._result, a._members = 0, None, None, set()
            a._kv.revoke(a._lease)
            again = a.next_round(NodeInfo("a", "127.0.0.1", 1))
            assert (again.round, again.group_world_size) == (0, 2)
            keys = cluster.list_keys()
            assert any(k.endswith("/r0/join/a") for k in keys)
            assert not any("/r0/next/" in k or "/r0/lost/" in k for k in keys), keys
            # Again, but b notices first (its ring watch finds a's join key gone) and declares a lost.
            a._joining, a._round, a._result, a._members = 0, None, None, set()
            a._kv.revoke(a._lease)
            deadline = time.monotonic() + 20
            while b.poll().lost_nodes != ["a"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert any(k.endswith("/r0/lost/a") for k in cluster.list_keys())
            assert {r.round for r in _round_together({"a": a, "b": b}).values()} == {1}
        finally:
            a.close()
            b.close()


@needs_etcd
def test_the_first_hang_claim_of_a_round_wins():
    """As on c10d (tests/rendezvous/test_store_backends.py), in one transaction: the first claim is
    the hang; a later claim is told what came first, a lost node before any claim."""
    def hang(node: str, rank: int) -> FailureRecord:
        return FailureRecord(node_id=node, hostname=f"host-{node}", rank=rank, local_rank=0, exitcode=None,
                             signal=None, timestamp=time.time(), message="hang detected: no heartbeat for 2.0 s")

    with EtcdCluster(1) as cluster:
        a, b = (create_handler(RendezvousParameters("etcd", cluster.endpoints, "claims", 2, 2)) for _ in range(2))
        try:
            assert {r.round for r in _round_together({"a": a, "b": b}).values()} == {0}
            assert b.claim_hang(hang("b", 1)) is None
            assert a.claim_hang(hang("a", 0)) == "the hang of rank 1 on host-b"
            assert b.claim_hang(hang("b", 1)) is None
        finally:
            a.close()
            b.close()
