"""A c10d round's closer never leaves out a live member that rejoins while it decides.

Real handlers on a real TCPStore, 3 nodes (``--nnodes=2:3``).  After round 0, node C opens round 1
(its closer) and B rejoins; the moment C has read the first of the two counters its decision rests
on (``joined`` and ``rejoined``), A rejoins: it takes its ``joined`` slot, then counts itself
``rejoined``.  Round 1 must admit all three.  When the closer read ``joined`` before ``rejoined`` it
saw 2 joined and 3 of 3 previous members accounted for, closed with 2, and A, alive, was left to
wait for a round of its own (seen under load in the goodput test: a round of two, then one more).
"""

from __future__ import annotations

import threading
import time

import pytest

from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
from elastrun.rendezvous.c10d import create_handler
from tests.harness import free_port
from tests.rendezvous.joins import Joins

pytestmark = pytest.mark.contract


def test_a_member_rejoining_between_the_closer_s_reads_is_admitted(monkeypatch):
    monkeypatch.delenv("ELASTRUN_JOB_TOKEN", raising=False)
    port = free_port()
    conf = {"host_linger": "0", "join_timeout": "15"}
    handlers = [create_handler(RendezvousParameters("c10d", f"127.0.0.1:{port}", "close-race", 2, 3,
                                                    config={**conf, "is_host": str(i == 0).lower()}))
                for i in range(3)]
    a, b, c = handlers
    infos = [NodeInfo(f"n{i}", "127.0.0.1", 1, hostname=f"h{i}") for i in range(3)]
    joins = Joins(handlers, infos)
    join, results, errors = joins.start, joins.results, joins.errors

    threads: list[threading.Thread] = []
    try:
        threads = [join(i, 0) for i in range(3)]
        for t in threads:
            t.join(30)
        assert {r.round for r in results.values()} == {0} and len(results) == 3, (results, errors)

        store = a._store
        counters = (c._r(1, "joined"), c._r(1, "rejoined"))
        injected = threading.Event()
        real_count = c._count

        def count_then_let_a_rejoin(key: str, store_=None) -> int:
            value = real_count(key, store_)
            if key in counters and not injected.is_set() and int(store.add(counters[0], 0)) == 2:
                injected.set()  # B is in: A rejoins between this read and the next
                threads.append(join(0, 1))
                deadline = time.monotonic() + 10
                while int(store.add(counters[1], 0)) < 3 and time.monotonic() < deadline:
                    time.sleep(0.005)
            return value

        c._count = count_then_let_a_rejoin
        threads = [join(2, 1)]
        deadline = time.monotonic() + 10
        while int(store.add(counters[0], 0)) < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        threads.append(join(1, 1))
        deadline = time.monotonic() + 10
        while len(threads) < 3 and time.monotonic() < deadline:  # A's join is started by the closer's read
            time.sleep(0.005)
        for t in list(threads):
            t.join(30)
        assert injected.is_set(), "the closer never read its counters with B in"
        assert not errors, errors
        rounds = {i: results[(1, i)].round for i in range(3) if (1, i) in results}
        assert rounds == {0: 1, 1: 1, 2: 1}, f"round 1 left out a live member: {rounds}"
        assert {results[(1, i)].group_world_size for i in range(3)} == {3}
    finally:
        for h in reversed(handlers):
            h.close()
        for t in threads:
            t.join(20)
