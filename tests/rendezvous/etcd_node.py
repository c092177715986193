"""One etcd rendezvous node in a process of its own, without workers, for tests that stop or kill
an agent by PID (SIGSTOP, SIGKILL) while a test's own handlers carry on.

``python -m tests.rendezvous.etcd_node ENDPOINTS RUN_ID NODE_ID LEASE_TTL MIN MAX`` joins rounds
of a job of MIN to MAX nodes and acts on ``poll`` as the agent does (a new round when asked, a lost membership
or a newcomer).  After each round it prints ``round <R> incarnation <id>`` (flushed); it exits on
SIGTERM, closing its handler, and after 120 s in any case.
"""

from __future__ import annotations

import signal
import sys
import time

from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
from elastrun.rendezvous.etcd import create_handler

LIFETIME = 120.0


def main(endpoints: str, run_id: str, node_id: str, lease_ttl: str, min_nodes: str, max_nodes: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    handler = create_handler(RendezvousParameters("etcd", endpoints, run_id, int(min_nodes), int(max_nodes),
                                                  config={"lease_ttl": lease_ttl}))
    node = NodeInfo(node_id, "127.0.0.1", 1)
    until = time.monotonic() + LIFETIME
    try:
        while time.monotonic() < until:
            result = handler.next_round(node)
            print(f"round {result.round} incarnation {handler._epoch}", flush=True)
            while time.monotonic() < until:
                change = handler.poll()
                if change.new_round_requested or change.nodes_waiting or change.lost_nodes:
                    break
                time.sleep(0.05)
    finally:
        handler.close()


if __name__ == "__main__":
    main(*sys.argv[1:7])
