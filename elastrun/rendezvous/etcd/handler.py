"""The etcd rendezvous protocol: join keys bound to leases, a closer that decides in one transaction,
watches that wake everyone, and a job incarnation that keeps a stale job from capturing a new one.

Keys (``P`` = ``/elastrun/<run_id>/``, ``Q`` = ``P/e/<incarnation>/``)::

    P/epoch                 {"id", "lease"}: the live incarnation and its job lease
    P/agents/<node>         one per live agent (agent lease)
    P/claim                 node id of the agent starting a new incarnation (its agent lease), while it does
    Q/current               the open round number
    Q/r<R>/join/<node>      NodeInfo of a node that joined round R (agent lease); arrival order =
                            create revision; for members it stays while they live: its deletion
                            (lease expiry, leave) is how the others learn of a lost node
    Q/r<R>/result           the closed round: members and ranks, generation, restarts, abort
    Q/r<R>/store            ADDR:PORT of the workers' TCPStore, hosted by group rank 0
    Q/r<R>/fail/<node>      FailureRecord of a node whose workers failed in round R
    Q/r<R>/hang             FailureRecord of the round's first hang claim (``claim_hang``), put only
                            while no ``lost/``, ``left/`` or ``fail/`` key of R exists
    Q/r<R>/done/<node>      the node's workers finished (exit barrier)
    Q/r<R>/left/<node>      the node left for good (reason)
    Q/r<R>/lost/<node>      the node is gone, written by its ring predecessor: ``dead:<watcher>`` (its
                            join key vanished: lease expired) or ``link:<watcher>`` (its process was
                            found gone by the liveness link; written in one transaction with the
                            deletion of its join key, then the watcher revokes its lease)
    Q/r<R>/next/member|new  a member of R (or a newcomer) joined the round after R: wakes R's members
    Q/abort, Q/finished     the job ended

With a job token (docs/rendezvous-protocol.md, "The job token") ``P/epoch`` also holds the job's
auth marker, every value is sealed with the incarnation's session key, and a value that does not
open is ignored (reported once).  The existence of a key cannot be authenticated: deleting a
member's join key, or renewing or revoking its lease, takes etcd credentials to prevent (TLS, users).

Keys without an agent lease carry the job lease, which every agent renews: when all agents are
gone the job's keys expire on their own (``job_ttl``); a clean exit removes them at once (the
last agent out deletes ``P``).  A new agent that finds no live agent under ``P/agents/`` starts a
fresh incarnation in a transaction, so a crashed job with the same id never captures a new one:
the first to put ``P/claim`` grants the job lease and starts it, the others wait for ``P/epoch``
on a watch (:mod:`.registration`).  Where ``P/epoch`` exists, it first waits one lease TTL for an
agent to register: the job's agents may only have stalled past their leases, and they come back
into their own incarnation.

The rules (when a round may close, who gets which rank, what is charged) are
:mod:`elastrun.rendezvous.rounds`, shared with the c10d backend.  The protocol's parts live in
their own modules (:mod:`.base` lists them); this one puts them together.
"""

from __future__ import annotations

import json
import time
from typing import Any

from elastrun.rendezvous.api import NodeInfo, RendezvousTimeoutError, RoundResult
from elastrun.rendezvous.etcd.backoff import Backoff
from elastrun.rendezvous.etcd.base import Reregister
from elastrun.rendezvous.etcd.client import LeaseNotFound, prefix_end
from elastrun.rendezvous.etcd.closing import Closing
from elastrun.rendezvous.etcd.ending import Ending
from elastrun.rendezvous.etcd.joining import Joining
from elastrun.rendezvous.etcd.liveness import Liveness
from elastrun.rendezvous.etcd.registration import Registration
from elastrun.rendezvous.link import listen_for_watchers
from elastrun.rendezvous.rounds import decode_result


class EtcdRendezvousHandler(Registration, Joining, Closing, Liveness, Ending):
    """Rendezvous rounds on etcd; see the module docstring for the keys."""

    def next_round(self, node: NodeInfo) -> RoundResult:
        started = time.monotonic()
        deadline = started + self.join_timeout
        self._node = node
        if self._link is None and not self._link_tried:
            self._link_tried = True
            self._link = listen_for_watchers(node, lambda: self._auth, self._on_link_dead, self.warn)
        node.link_port = self._link.port if self._link is not None else 0
        if self._result is not None:
            node.prev_group_rank = self._result.group_rank
        backoff = Backoff(0.25, 4.0)
        while True:
            try:
                self._register(deadline)
                result = self._join_rounds(node, deadline)
                break
            except (Reregister, LeaseNotFound) as exc:
                self._forget_lost_leases(isinstance(exc, LeaseNotFound), deadline)
            # Registering again costs a lease grant and two transactions: when etcd was too slow to
            # renew the leases, every agent lost its lease at once; spread their returns out.
            pause = backoff.delay()
            if time.monotonic() + pause >= deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous of job {self.run_id!r} did not complete within {self.join_timeout:g} s "
                    f"(join_timeout): this agent's membership in etcd at {self.endpoints_text} kept vanishing "
                    "(its lease expired: etcd too slow to renew it?); give etcd more CPU or raise --rdzv-conf "
                    "lease_ttl"
                )
            time.sleep(pause)
        result.duration = time.monotonic() - started
        return result

    def describe(self) -> dict:
        deadline = time.monotonic() + float(self.conf["request_timeout"]) * 2
        epoch = self._retry(lambda: self._kv.get(self._p + "epoch"), deadline, "describe the job")
        doc: dict[str, Any] = {
            "run_id": self.run_id, "backend": self.backend_name, "endpoint": self.endpoints_text,
            "incarnation": None, "open_round": None, "round": None, "members": [], "waiting": 0,
            "agents": self._kv.count(self._p + "agents/"), "max_restarts": self.params.max_restarts,
            "restarts_used": 0, "finished": False, "aborted": None,
        }
        if epoch is None:
            return doc
        q = f"{self._p}e/{json.loads(epoch.value)['id']}/"
        doc["incarnation"] = q.rstrip("/").rsplit("/", 1)[1]
        current = self._open(self._kv.get(q + "current"))
        open_round = int(current) if current else 0
        doc["open_round"] = open_round
        doc["waiting"] = self._kv.count(f"{q}r{open_round}/join/")
        doc["finished"] = self._open(self._kv.get(q + "finished")) is not None
        doc["aborted"] = self._open(self._kv.get(q + "abort"))
        if open_round > 0:
            found = self._open(self._kv.get(f"{q}r{open_round - 1}/result"))
            if found is not None:
                result = decode_result(found)
                doc.update(round=open_round - 1, generation=result["generation"],
                           restarts_used=result["restarts_used"])
                alive = {kv.key.rsplit("/", 1)[1] for kv in self._kv.range(
                    f"{q}r{open_round - 1}/join/", prefix_end(f"{q}r{open_round - 1}/join/"), keys_only=True)[0]}
                for m in result["members"]:
                    doc["members"].append({**m, "state": "alive" if m["node_id"] in alive else "gone"})
        return doc
