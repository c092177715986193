"""A c10d round whose closer goes silent between its close and its result ends the same for every joiner.

Real handlers on a real TCPStore, 3 nodes (``--nnodes=3``).  Node C takes round 0's first slot (its
closer); once it claimed ``closed``, its heartbeats stop and its result comes later than
``heartbeat_timeout`` (a host so loaded that the agent's threads do not run: seen in CI, where
the suite's 2 cores ran three test workers).  Its followers give the round up as never formed.
Before the fix C published its result anyway and returned round 0, while A and B waited in round 1
for a third node until ``join_timeout``.  Now the first to write ``result`` decides for all: every
node returns the same round, with all three in it.
"""

from __future__ import annotations

import threading
import time

import pytest

from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
from elastrun.rendezvous.c10d import create_handler
from elastrun.rendezvous.rounds import decode_result, is_void
from tests.harness import free_port

pytestmark = pytest.mark.contract

HEARTBEAT_TIMEOUT = 0.6


def test_a_closer_silent_before_its_result_does_not_split_the_round(monkeypatch):
    monkeypatch.delenv("ELASTRUN_JOB_TOKEN", raising=False)
    port = free_port()
    conf = {"host_linger": "0", "join_timeout": "20", "heartbeat_interval": "0.1",
            "heartbeat_timeout": str(HEARTBEAT_TIMEOUT)}
    handlers = [create_handler(RendezvousParameters("c10d", f"127.0.0.1:{port}", "silent-closer", 3, 3,
                                                    config={**conf, "is_host": str(i == 0).lower()}))
                for i in range(3)]
    a, _, c = handlers
    infos = [NodeInfo(f"n{i}", "127.0.0.1", 1, hostname=f"h{i}") for i in range(3)]
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    # C's heartbeats stand still, and its result waits, from its close until the followers gave up on it.
    silent = threading.Event()
    real_beat, real_publish = c._beat, c._publish_result

    def beat() -> None:
        if not silent.is_set():
            real_beat()

    def publish(round_: int, *args, **kwargs) -> None:
        if round_ == 0:
            silent.set()
            deadline = time.monotonic() + 10
            while a._peek(a._r(0, "result")) is None and time.monotonic() < deadline:
                time.sleep(0.01)  # a follower writes the round void once C was silent for heartbeat_timeout
            silent.clear()
        real_publish(round_, *args, **kwargs)

    c._beat = beat
    c._publish_result = publish

    def join(i: int) -> threading.Thread:
        def body() -> None:
            try:
                results[i] = handlers[i].next_round(infos[i])
            except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
                errors.append(exc)

        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t

    threads: list[threading.Thread] = []
    try:
        threads.append(join(2))
        deadline = time.monotonic() + 10
        while int(a._store.add(a._r(0, "joined"), 0)) < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        threads += [join(0), join(1)]
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert is_void(decode_result(a._read(a._r(0, "result")))), "round 0 was not given up"
        rounds = {i: r.round for i, r in results.items()}
        assert rounds == {0: 1, 1: 1, 2: 1}, f"the nodes disagree on the round they are in: {rounds}"
        assert sorted(r.group_rank for r in results.values()) == [0, 1, 2]
        assert {r.group_world_size for r in results.values()} == {3}
    finally:
        silent.clear()
        for h in reversed(handlers):
            h.close()
        for t in threads:
            t.join(20)
