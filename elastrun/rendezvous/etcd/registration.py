"""Leases, this agent's registration, and the job's incarnation.

An agent holds a lease (renewed by :class:`~elastrun.rendezvous.etcd.lease_keeper.LeaseKeeper`), puts
``P/agents/<node>`` under it, and adopts the incarnation named by ``P/epoch``.  Where no agent is
live, one agent claims the start of a new incarnation (``P/claim``, under its own lease) and the
others wait for it on a watch; a stale incarnation's keys go with the start.  Where ``P/epoch``
names an incarnation that has no live agent, the start waits one lease TTL on a watch of
``P/agents/`` first: a job whose agents all stalled past their leases at once (an overloaded
machine or etcd) gets them back, with its rounds and restart budget, instead of a new incarnation.

After a lost lease the agent finds out which lease etcd no longer knows and registers again,
backing off with jitter.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable

from elastrun.rendezvous.api import JobFailedError, RendezvousError, RendezvousTimeoutError
from elastrun.rendezvous.auth import JobTokenRejected
from elastrun.rendezvous.etcd.backoff import Backoff
from elastrun.rendezvous.etcd.base import HandlerBase, Reregister, first_kv, one_key_end
from elastrun.rendezvous.etcd.client import (
    EtcdClient,
    cmp_absent,
    cmp_lease,
    cmp_mod,
    cmp_range_empty,
    new_lease_id,
    op_delete,
    op_delete_prefix,
    op_put,
    op_range,
    prefix_end,
)
from elastrun.rendezvous.etcd.lease_keeper import LeaseKeeper
from elastrun.rendezvous.etcd.streams import Event, WatchSet


class Registration(HandlerBase):
    """Leases, registration under ``P/agents/`` and the job's incarnation (``P/epoch``, ``P/claim``)."""

    def _register(self, deadline: float) -> None:
        """Hold a lease, find (or start) the job's incarnation, and put this agent's key in it."""
        assert self._node is not None
        if self._keeper is None:
            self._keeper = LeaseKeeper(
                EtcdClient(self.settings, self._shared), float(self.conf["keepalive_interval"]),
                float(self.conf["job_ttl"]) / 10, self._warn, ttl=float(self.conf["lease_ttl_int"]),
            )
            self._keeper.start()
        if self._keeper.lost or self._keeper.job_lost:
            self._lease = 0
        if not self._lease:
            # One id for every try: a grant that timed out on this side but went through is not a second lease.
            # Its TTL runs from no earlier than the first try: a grant slow to answer is renewed at once.
            lease_id, granted_at = new_lease_id(), time.monotonic()
            self._lease = self._retry(lambda: self._kv.grant(int(self.conf["lease_ttl_int"]), lease_id), deadline,
                                      "grant a lease")
            self._keeper.set_leases(self._lease, self._job_lease, granted_at)
        backoff = Backoff(0.05, 1.0)
        while True:
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(f"could not register with etcd at {self.endpoints_text} in time")
            if self._retry(lambda: self._try_register(deadline), deadline, "register this agent"):
                break
            time.sleep(min(backoff.delay(), max(0.0, deadline - time.monotonic())))
        self._keeper.set_leases(self._lease, self._job_lease)

    def _try_register(self, deadline: float) -> bool:
        """One try at registering; False when something changed under it (the caller backs off)."""
        assert self._node is not None
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
        agent_key, claim_key = self._p + "agents/" + self._node.node_id, self._p + "claim"
        epoch_read, (_, live), claim_read = self._kv.read_many(
            [op_range(self._p + "epoch"), self._agents_op(), op_range(claim_key)])
        epoch, claim = first_kv(epoch_read), first_kv(claim_read)
        self._job_state = None
        replaced: str | None = None  # the incarnation a new one replaces
        if epoch is not None:
            doc = json.loads(epoch.value)
            replaced = doc["id"]
            if live > 0 or doc["id"] == self._epoch:
                self._accept(doc)
                # Register and read the job's state (for the join that follows) in one request.
                ok, reads = self._kv.txn_reads([cmp_mod(self._p + "epoch", epoch.mod_revision)],
                                               [op_put(agent_key, me, self._lease),
                                                *self._job_state_ops(f"{self._p}e/{doc['id']}/")])
                if ok:
                    self._adopt(doc["id"], int(doc["lease"]), epoch.mod_revision)
                    self._job_state = [r if r is not None else ([], 0) for r in reads[1:]]
                return ok
            if claim is None and self._quiet_epoch != epoch.mod_revision:
                # Crashed, or every agent stalled past its lease at once (overload): only a quiet
                # lease TTL tells them apart.  A stalled agent that comes back adopts its
                # incarnation at once (it knows its id), and this agent then joins it too.
                if not self._await_agent(doc["id"], deadline):
                    return False
                self._quiet_epoch = epoch.mod_revision
        # No live agent: a new job, or a crashed one's keys are left.  One agent claims the start
        # (with its own lease, so the claim goes if it dies); the others wait for its incarnation
        # instead of each granting a job lease, losing the race and revoking it.
        guard = [cmp_mod(self._p + "epoch", epoch.mod_revision if epoch else 0), cmp_range_empty(self._p + "agents/")]
        if claim is not None and claim.lease != self._lease:
            self._await_start(deadline)
            return False
        if claim is None and not self._kv.txn([*guard, cmp_absent(claim_key)],
                                              [op_put(claim_key, self._node.node_id, self._lease)]):
            return False
        return self._start_incarnation(guard, claim_key, agent_key, me, replaced)

    def _start_incarnation(self, guard: list, claim_key: str, agent_key: str, me: str, replaced: str | None) -> bool:
        """With the start claimed: grant the job lease and create a new incarnation (``epoch``) in one
        transaction that holds only while ``guard`` does; False when it did not (the claim is let go)."""
        job_lease = self._kv.grant(int(self.conf["job_ttl"]), new_lease_id())
        new_id = uuid.uuid4().hex[:12]
        fresh = {"id": new_id, "lease": job_lease, "auth": self._token.new_marker()}
        ok, reads = self._kv.txn_reads(
            [*guard, cmp_lease(claim_key, self._lease)],
            [op_delete_prefix(self._p + "e/"), op_put(self._p + "epoch", json.dumps(fresh), job_lease),
             op_put(agent_key, me, self._lease), op_delete(claim_key), op_range(self._p + "epoch")],
            [op_range(claim_key)])
        if not ok:
            self._kv.revoke(job_lease)
            if reads and reads[0] and reads[0][0] and reads[0][0][0].lease == self._lease:
                self._kv.txn([cmp_lease(claim_key, self._lease)], [op_delete(claim_key)])  # let the others try
            return False
        self._accept(fresh)
        if replaced is not None:
            self.warn(f"job {self.run_id!r}: no agent of incarnation {replaced} came back within lease_ttl; "
                      f"started incarnation {new_id} in its place (its rounds and restart budget start afresh)",
                      kind="incarnation_replaced", incarnation=replaced, new_incarnation=new_id)
        created = first_kv(reads[-1]) if reads[-1] else None
        self._adopt(new_id, job_lease, created.mod_revision if created else 0)
        self._job_state = [([], 0)] * 3  # a fresh incarnation has no state yet
        return True

    def _await_start(self, deadline: float) -> None:
        """Another agent claimed the start of the incarnation: wait on a watch of ``P/epoch`` until it
        is written, for at most one lease TTL (the claimer may have died: its claim then expires)."""
        key = self._p + "epoch"
        until = min(deadline, time.monotonic() + float(self.conf["lease_ttl"]))
        self._watch_until("start", key, one_key_end(key), until, lambda events: True)

    def _await_agent(self, epoch_id: str, deadline: float) -> bool:
        """The job's incarnation ``epoch_id`` has no live agent: True when none registers within one
        lease TTL (the job crashed: start a new incarnation), False as soon as one does (or at
        ``deadline``): read again and adopt it.

        A watch on ``P/agents/`` from the revision just read sees every registration after that
        read, however late its stream connects; the start's transaction then checks that
        ``P/agents/`` is still empty, so an agent that comes back after the wait is not missed either.
        """
        ttl = float(self.conf["lease_ttl"])
        self.warn(f"job {self.run_id!r}: its incarnation {epoch_id} in etcd has no live agent (crashed, or every "
                  f"agent stalled past its lease); waiting up to {ttl:g} s (lease_ttl) for one to come back "
                  "before starting a new incarnation", kind="incarnation_wait", incarnation=epoch_id)
        agents = self._p + "agents/"
        until = min(deadline, time.monotonic() + ttl)
        came = self._watch_until("agents", agents, prefix_end(agents), until,
                                 lambda events: any(e.kind == "PUT" and e.key.startswith(agents) for e in events))
        return not came and until < deadline

    def _watch_until(self, name: str, key: str, end: str, until: float,
                     wanted: Callable[[list[Event]], bool]) -> bool:
        """Watch ``[key, end)`` from the revision just read until ``wanted`` holds for the events seen
        (True) or the monotonic time ``until`` passes (False); lost events count as wanted."""
        watch = self._watches()
        start = cursor = watch.seq
        watch.watch(name, key, end, self._kv.revision + 1)
        try:
            while time.monotonic() < until:
                watch.wait(cursor, until - time.monotonic())
                events = watch.since(start)
                if events is None or events and wanted(events):
                    return True
                cursor = watch.seq
            return False
        finally:
            watch.unwatch(name)

    def _watches(self) -> WatchSet:
        """This agent's :class:`WatchSet`, started on first use."""
        if self._watch is None:
            self._watch = WatchSet(lambda: EtcdClient(self.settings, self._shared))
        return self._watch

    def _accept(self, epoch_doc: dict) -> None:
        """Check this node's token against the incarnation's auth marker and take its sealer.

        Inside a round a mismatch ends this agent like a failed job (one line, exit 2); before
        one, :meth:`_probe` raised it as a configuration error.
        """
        try:
            self._auth = self._token.accept(epoch_doc.get("auth", "none"), self.endpoints_text)
        except JobTokenRejected as exc:
            raise JobFailedError(str(exc), str(exc), exit_code=2) from None
        self._auth.on_forged = self._report_forged

    def _adopt(self, epoch_id: str, job_lease: int, epoch_rev: int) -> None:
        if epoch_id != self._epoch:
            # A new incarnation: whatever this agent knew of an older one no longer applies.
            self._round, self._result, self._members = None, None, set()
            if self._watch is not None:
                self._watch.clear()  # its ranges; the stream itself stays open for the new ones
        self._epoch, self._job_lease, self._epoch_rev = epoch_id, job_lease, epoch_rev
        self._quiet_epoch = 0
        self._q = f"{self._p}e/{epoch_id}/"
        if "job" not in self._watches().ranges():
            # The job's own keys: abort, abort_code, current, finished.
            self._watch.watch("job", self._q + "abort", one_key_end(self._q + "finished"), self._kv.revision + 1)
            assert self._keeper is not None
            self._keeper.on_failover = self._watch.reconnect

    def _check_lease(self) -> None:
        if self._keeper is not None and (self._keeper.lost or self._keeper.job_lost):
            raise Reregister()


    def _forget_lost_leases(self, not_found: bool, deadline: float) -> None:
        """After this agent's membership vanished: drop the lease (agent or job) that etcd no longer
        knows, so the next registration grants a new one instead of failing on the old one again.

        ``not_found``: a write named a lease etcd does not know, and the keep-alive thread may not
        have seen it yet: one renewal tells whether it was the agent's (else the job's).
        """
        keeper = self._keeper
        agent_lost = keeper is None or keeper.lost
        job_lost = keeper is not None and keeper.job_lost
        if not_found and not agent_lost and not job_lost and self._lease:
            try:
                agent_lost = self._kv.keepalive(self._lease) <= 0
            except RendezvousError:
                agent_lost = True  # unknown: a new lease costs one grant; the old one expires on its own
            job_lost = not agent_lost
        if agent_lost or job_lost:
            self._lease = 0
        if job_lost:
            self._epoch = None
