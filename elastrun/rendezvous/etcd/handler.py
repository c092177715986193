"""The etcd rendezvous protocol: join keys bound to leases, a closer that decides in one transaction,
watches that wake everyone, and a job incarnation that keeps a stale job from capturing a new one.

Keys (``P`` = ``/elastrun/<run_id>/``, ``Q`` = ``P/e/<incarnation>/``)::

    P/epoch                 {"id", "lease"}: the live incarnation and its job lease
    P/agents/<node>         one per live agent (agent lease)
    Q/current               the open round number
    Q/r<R>/join/<node>      NodeInfo of a node that joined round R (agent lease); arrival order =
                            create revision; for members it stays while they live: its deletion
                            (lease expiry, leave) is how the others learn of a lost node
    Q/r<R>/result           the closed round: members and ranks, generation, restarts, abort
    Q/r<R>/store            ADDR:PORT of the workers' TCPStore, hosted by group rank 0
    Q/r<R>/fail/<node>      FailureRecord of a node whose workers failed in round R
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
fresh incarnation in a transaction, so a crashed job with the same id never captures a new one.

The rules (when a round may close, who gets which rank, what is charged) are
:mod:`elastrun.rendezvous.rounds`, shared with the c10d backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from elastrun import log
from elastrun.rendezvous.api import (
    FailureRecord,
    JobFailedError,
    JobFinishedError,
    Member,
    NodeInfo,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
    RoundChange,
    RoundResult,
)
from elastrun.rendezvous.auth import JobAuth, JobToken, JobTokenRejected, NoAuth, load_token
from elastrun.rendezvous.endpoint import host_worker_store, route_address
from elastrun.rendezvous.etcd.backoff import Backoff
from elastrun.rendezvous.etcd.client import (
    KV,
    EtcdClient,
    EtcdSettings,
    EtcdUnavailable,
    LeaseKeeper,
    LeaseNotFound,
    Shared,
    WatchSet,
    cmp_absent,
    cmp_lease,
    cmp_mod,
    cmp_range_empty,
    op_delete,
    op_delete_prefix,
    op_put,
    op_range,
    prefix_end,
)
from elastrun.rendezvous.link import Link, Wakeup, listen_for_watchers, ring_successor
from elastrun.rendezvous.rounds import (
    CloseInputs,
    assign_ranks,
    close_size,
    judge_round_end,
    member_view,
    result_document,
    timeout_error,
)

#: A waiting node re-reads the state at least this often even without a watch event (safety net).
_RECHECK = 2.0


def _just(key: str) -> str:
    """The end of a range that holds ``key`` alone."""
    return key + "\0"


class _Reregister(Exception):
    """This agent's lease expired (or the incarnation changed): register again and rejoin."""


@dataclasses.dataclass
class _Look:
    """One read of a round's state (one request): its result, its earliest join (as a one-element
    list), how many joined, and whether this node's join key is there."""

    result: KV | None
    first: list[KV]
    joined: int
    mine: bool


def _first(read: tuple[list[KV], int]) -> KV | None:
    return read[0][0] if read[0] else None


class EtcdRendezvousHandler(RendezvousHandler):
    """Rendezvous rounds on etcd; see the module docstring for the keys."""

    backend_name = "etcd"

    def __init__(self, params: RendezvousParameters, endpoints: list[tuple[str, int]], conf: dict[str, Any]) -> None:
        self.params = params
        self.conf = conf
        self.run_id = params.run_id
        self.min_nodes, self.max_nodes = params.min_nodes, params.max_nodes
        self.join_timeout = float(conf["join_timeout"])
        self.settings = EtcdSettings(
            endpoints=endpoints, protocol=conf["protocol"], ca_cert=conf["ca_cert"],
            client_cert=conf["client_cert"], client_key=conf["client_key"], username=conf["username"],
            password=conf["password"], request_timeout=float(conf["request_timeout"]),
        )
        self.endpoints_text = self.settings.describe()
        self.local_addr = params.local_addr or route_address(*endpoints[0])
        self._shared = Shared()
        self._kv = EtcdClient(self.settings, self._shared)
        self._p = f"/elastrun/{self.run_id}/"
        self._q = ""
        self._epoch: str | None = None
        self._epoch_rev = 0
        self._lease = 0
        self._job_lease = 0
        self._keeper: LeaseKeeper | None = None
        self._watch: WatchSet | None = None
        self._ring_target: str | None = None
        self._node: NodeInfo | None = None
        self._round: int | None = None
        self._result: RoundResult | None = None
        self._members: set[str] = set()
        #: Liveness link (:mod:`elastrun.rendezvous.link`): this round's members by group rank, the
        #: ones the link found gone, and why each lost member went (its ``lost/`` or ``left/`` marker).
        self._link: Link | None = None
        self._link_tried = False
        self._link_kv: EtcdClient | None = None
        self._ring_members: list[Member] = []
        self._link_gone: set[str] = set()
        self._ring_lock = threading.Lock()
        self._causes: dict[str, str] = {}
        self._wakeup = Wakeup()
        self._poll_seq = 0
        self._ring: list[str] = []
        self._ring_pending: str | None = None
        self._reported: set[str] = set()
        self._worker_store = None
        #: The job's state (abort, finished, current) read in the registration's transaction, for
        #: the join that follows it (saves a request); None: read it afresh.
        self._job_state: list[tuple[list[KV], int]] | None = None
        self._warned_wait = False
        self._closed = False
        self._token = JobToken(load_token(conf["token_file"], self._warn), self.run_id)
        self._auth: JobAuth | NoAuth = NoAuth(self.run_id)
        self._probe()

    # ------------------------------------------------------------------ plumbing
    def _warn(self, message: str) -> None:
        log.get("rendezvous").warning(message)

    def _probe(self) -> None:
        """Reach etcd once at start so that wrong credentials or certificates fail at once.

        An unreachable cluster is not an error yet: :meth:`next_round` keeps trying until the
        join timeout.
        """
        try:
            epoch_read, agents = self._kv.read_many([op_range(self._p + "epoch"), self._agents_op()])
            epoch = _first(epoch_read)
            if epoch is not None and agents[1] > 0:
                # A running job: a node whose token does not match fails now, before anything starts.
                self._token.accept(json.loads(epoch.value).get("auth", "none"), self.endpoints_text)
        except EtcdUnavailable:
            pass

    def _seal(self, key: str, value: str) -> str:
        return self._auth.seal(key, value)

    def _open(self, kv: KV | None) -> str | None:
        """The authentic value of ``kv`` (None: absent, or forged and reported once)."""
        return None if kv is None else self._auth.open(kv.key, kv.value)

    def _authentic(self, kvs: list[KV]) -> list[KV]:
        """The entries of ``kvs`` whose values are authentic, values opened (all of them without a token)."""
        if not self._auth.enabled:
            return kvs
        opened = ((kv, self._auth.open(kv.key, kv.value)) for kv in kvs)
        return [dataclasses.replace(kv, value=value.encode()) for kv, value in opened if value is not None]

    def _report_forged(self, key: str, why: str) -> None:
        self.warn(f"ignored a value in etcd that is not authentic: {key} ({why})",
                  kind="forged_value", key=key, why=why)

    def _retry(self, op, deadline: float, what: str):
        """Run ``op()`` until etcd answers or ``deadline``; then a connection error naming the endpoints.

        Waits between tries back off with jitter (:mod:`.backoff`): a job's agents that all saw
        an overloaded etcd time out must not all come back at once.
        """
        backoff = Backoff(0.1, 2.0)
        while True:
            try:
                result = op()
                if self._warned_wait:
                    self._warn(f"etcd answers again ({what})")
                    self._warned_wait = False
                return result
            except EtcdUnavailable as exc:
                delay = backoff.delay()
                if time.monotonic() + delay >= deadline:
                    raise RendezvousConnectionError(
                        f"could not reach etcd at {self.endpoints_text} to {what} within the time allowed "
                        f"(join_timeout={self.join_timeout:g} s): {exc}. Is etcd running there and is "
                        "--rdzv-endpoint right?"
                    ) from None
                if not self._warned_wait:
                    self._warn(f"etcd unreachable at {self.endpoints_text} ({exc}); retrying with back-off")
                    self._warned_wait = True
                time.sleep(delay)
            except (RendezvousConfigError, LeaseNotFound, _Reregister, JobFailedError, JobFinishedError):
                raise
            except RendezvousError as exc:
                raise RendezvousConnectionError(f"etcd at {self.endpoints_text}: {exc}") from exc

    def _r(self, round_: int, *parts: str) -> str:
        return f"{self._q}r{round_}/" + "/".join(parts)

    def _agents_op(self) -> dict[str, Any]:
        """Count of the live agents of the job (a read for a transaction)."""
        return op_range(self._p + "agents/", prefix_end(self._p + "agents/"), count_only=True)

    @staticmethod
    def _job_state_ops(q: str) -> list[dict[str, Any]]:
        """Reads of an incarnation's ``abort``, ``finished`` and ``current`` (for a transaction)."""
        return [op_range(q + "abort"), op_range(q + "finished"), op_range(q + "current")]

    # ------------------------------------------------------------------ registration and incarnation
    def _register(self, deadline: float) -> None:
        """Hold a lease, find (or start) the job's incarnation, and put this agent's key in it."""
        assert self._node is not None
        if self._keeper is None:
            self._keeper = LeaseKeeper(
                EtcdClient(self._keepalive_settings(), self._shared), float(self.conf["keepalive_interval"]),
                float(self.conf["job_ttl"]) / 10, self._warn,
            )
            self._keeper.start()
        if self._keeper.lost or self._keeper.job_lost:
            self._lease = 0
        if not self._lease:
            self._lease = self._retry(lambda: self._kv.grant(int(self.conf["lease_ttl_int"])), deadline,
                                      "grant a lease")
            self._keeper.set_leases(self._lease, self._job_lease)
        backoff = Backoff(0.05, 1.0)
        while True:
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(f"could not register with etcd at {self.endpoints_text} in time")
            if self._retry(lambda: self._try_register(deadline), deadline, "register this agent"):
                break
            time.sleep(min(backoff.delay(), max(0.0, deadline - time.monotonic())))
        self._keeper.set_leases(self._lease, self._job_lease)

    def _keepalive_settings(self) -> EtcdSettings:
        """The keep-alive thread's settings: a renewal that has not answered within half the lease's
        TTL is abandoned and tried again (on the next member, if any) while the lease still lives."""
        half_ttl = float(self.conf["lease_ttl"]) / 2
        return dataclasses.replace(self.settings, request_timeout=min(self.settings.request_timeout,
                                                                      max(1.0, half_ttl)))

    def _try_register(self, deadline: float) -> bool:
        """One try at registering; False when something changed under it (the caller backs off)."""
        assert self._node is not None
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
        agent_key, claim_key = self._p + "agents/" + self._node.node_id, self._p + "claim"
        epoch_read, (_, live), claim_read = self._kv.read_many(
            [op_range(self._p + "epoch"), self._agents_op(), op_range(claim_key)])
        epoch, claim = _first(epoch_read), _first(claim_read)
        self._job_state = None
        if epoch is not None:
            doc = json.loads(epoch.value)
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
        job_lease = self._kv.grant(int(self.conf["job_ttl"]))
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
        created = _first(reads[-1]) if reads[-1] else None
        self._adopt(new_id, job_lease, created.mod_revision if created else 0)
        self._job_state = [([], 0)] * 3  # a fresh incarnation has no state yet
        return True

    def _await_start(self, deadline: float) -> None:
        """Another agent claimed the start of the incarnation: wait on a watch of ``P/epoch`` until it
        is written, for at most one lease TTL (the claimer may have died: its claim then expires)."""
        if self._watch is None:
            self._watch = WatchSet(lambda: EtcdClient(self.settings, self._shared))
        key = self._p + "epoch"
        cursor = self._watch.seq
        self._watch.watch("start", key, _just(key), self._kv.revision + 1)
        until = min(deadline, time.monotonic() + float(self.conf["lease_ttl"]))
        while self._watch.seq == cursor and time.monotonic() < until:
            self._watch.wait(cursor, until - time.monotonic())
        self._watch.unwatch("start")

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
                self._watch.stop()
                self._watch = None
        self._epoch, self._job_lease, self._epoch_rev = epoch_id, job_lease, epoch_rev
        self._q = f"{self._p}e/{epoch_id}/"
        if self._watch is None:
            self._watch = WatchSet(lambda: EtcdClient(self.settings, self._shared))
        if "job" not in self._watch.ranges():
            # The job's own keys: abort, abort_code, current, finished.
            self._watch.watch("job", self._q + "abort", _just(self._q + "finished"), self._kv.revision + 1)
            assert self._keeper is not None
            self._keeper.on_failover = self._watch.reconnect

    def _check_lease(self) -> None:
        if self._keeper is not None and (self._keeper.lost or self._keeper.job_lost):
            raise _Reregister()

    # ------------------------------------------------------------------ the round
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
            except (_Reregister, LeaseNotFound) as exc:
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

    def _join_rounds(self, node: NodeInfo, deadline: float) -> RoundResult:
        assert self._watch is not None
        state, self._job_state = self._job_state, None
        if state is None:
            state = self._retry(lambda: self._kv.read_many(self._job_state_ops(self._q)), deadline,
                                "read the job state")
        abort, finished, current_kv = (_first(read) for read in state)
        self._check_job_ended(abort, finished)
        old_round = self._round
        current = self._open(current_kv)
        # Missing or forged: the round after this node's last one (or 0); closed rounds are walked past.
        round_ = int(current) if current else (0 if old_round is None else old_round + 1)
        while True:
            self._watch_round(round_)
            cursor = self._watch.seq
            join_key = self._r(round_, "join", node.node_id)
            join = op_put(join_key, self._seal(join_key, node.to_json()), self._lease)
            # Join and read the round's state in one request.
            seen = self._retry(lambda r=round_, op=join: self._look(r, op), deadline, "join a round")
            if round_ > 0:
                # Wake the members of the round before, once per kind of joiner (not once per joiner).
                kind = "member" if old_round == round_ - 1 and node.node_id in self._members else "new"
                self._raise_flag(self._r(round_ - 1, "next", kind), deadline)
            doc = self._await_close(round_, cursor, deadline, seen)
            if any(m["node_id"] == node.node_id for m in doc["members"]):
                result = self._round_result(round_, doc, cursor, deadline)
                if result is not None:
                    break
            else:
                self._retry(lambda r=round_: self._kv.delete(self._r(r, "join", node.node_id)), deadline, "move on")
            round_ += 1
        if old_round is not None and old_round != round_:
            try:
                self._kv.delete(self._r(old_round, "join", node.node_id))
            except RendezvousError:
                pass
        return result

    def _watch_round(self, round_: int) -> None:
        """Watch what a node of ``round_`` acts on: its close (``result``, ``store``) and the markers
        that ask its members to act (``left/``, ``lost/``, ``next/``), not the joins themselves."""
        assert self._watch is not None
        self._watch.watch("round", self._r(round_, "left/"), _just(self._r(round_, "store")), self._kv.revision + 1)

    def _raise_flag(self, key: str, deadline: float) -> None:
        """Put ``key`` unless an authentic value is already there (one event for all joiners of a kind)."""
        value = self._seal(key, "1")
        if self._retry(lambda: self._kv.txn([cmp_absent(key)], [op_put(key, value, self._job_lease)]), deadline,
                       "wake the running members"):
            return
        if self._auth.enabled and self._open(self._retry(lambda: self._kv.get(key), deadline, "read")) is None:
            self._retry(lambda: self._kv.put(key, value, self._job_lease), deadline, "wake the running members")

    def _check_job_ended(self, abort_kv: KV | None, finished_kv: KV | None) -> None:
        abort = self._open(abort_kv)
        if abort is not None:
            raise JobFailedError("the job was ended by another node", abort, self._abort_code())
        if self._open(finished_kv):
            raise JobFinishedError(f"job {self.run_id!r} has already finished")

    def _abort_code(self) -> int:
        try:
            found = self._open(self._kv.get(self._q + "abort_code"))
        except RendezvousError:
            return 1
        return int(found) if found else 1

    def _timeout_error(self, round_: int, joined: int) -> RendezvousTimeoutError:
        return timeout_error(self.run_id, self.join_timeout, round_, self.min_nodes, self.max_nodes, joined)

    def _await_close(self, round_: int, cursor: int, deadline: float, seen: _Look) -> dict:
        """Wait for round ``round_``'s result; the earliest live joiner closes it when the rules allow.

        ``seen`` is the state read with this node's join.  The result normally arrives as a watch
        event, whose value is used as it is; the state is read again (one request) when the closer
        sees a join, when a join key vanishes, and every ``_RECHECK`` s in case the closer died.
        """
        assert self._watch is not None and self._node is not None
        me = self._node.node_id
        result_key, join_prefix = self._r(round_, "result"), self._r(round_, "join/")
        prev_prefix = self._r(round_ - 1, "") if round_ > 0 else None
        min_reached: float | None = None
        joined = 0
        look = False  # re-read the state now
        closer = False
        next_recheck = 0.0
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout_error(round_, joined)
            self._check_lease()
            if look or now >= next_recheck:
                next_recheck = now + _RECHECK
                if seen is None:
                    seen = self._retry(lambda: self._look(round_), deadline, "read the round")
                found = self._open(seen.result)
                if found is not None:
                    return self._closed_round(round_, found)
                first, joined, mine = seen.first, seen.joined, seen.mine
                seen = None
                if not mine:
                    raise _Reregister()  # our join key vanished (lease expired)
                closer = bool(first) and first[0].key == join_prefix + me
                self._watch_as_closer(round_, closer)
                if closer:
                    if joined >= self.min_nodes and min_reached is None:
                        min_reached = now
                    if self._may_close(round_, joined, min_reached) and self._try_close(round_, min_reached, deadline):
                        continue
                look = False
            wait = next_recheck - time.monotonic()
            if closer and min_reached is not None:
                wait = min(wait, max(0.01, min_reached + float(self.conf["last_call_timeout"]) - time.monotonic()))
                look = wait <= 0.01 or look
            self._watch.wait(cursor, max(0.0, min(wait, deadline - time.monotonic())))
            events = self._watch.since(cursor)
            cursor = self._watch.seq
            if events is None:
                look = True
                continue
            for ev in events:
                if ev.key == result_key and ev.kind == "PUT":
                    found = self._auth.open(ev.key, ev.value)  # a forged one is ignored (reported once)
                    if found is not None:
                        return self._closed_round(round_, found)
                elif ev.key == self._q + "abort":
                    look = True
                elif ev.key.startswith(join_prefix):
                    look = look or closer or ev.kind == "DELETE"
                elif closer and prev_prefix and ev.key.startswith(prev_prefix):
                    look = True
            if closer and min_reached is not None and \
                    time.monotonic() >= min_reached + float(self.conf["last_call_timeout"]):
                look = True

    def _closed_round(self, round_: int, found: str) -> dict:
        """The result document of ``round_`` (authentic text ``found``); a job ended by it fails here."""
        self._watch_as_closer(round_, False)
        doc = json.loads(found)
        if doc.get("abort"):
            raise JobFailedError("the job was ended", doc["abort"], int(doc.get("abort_code", 1)))
        return doc

    def _may_close(self, round_: int, joined: int, min_reached: float | None) -> bool:
        """False where the rules cannot close the round yet whoever joined (spares the closer a read
        of every join at each arrival); :meth:`_try_close` decides the rest."""
        if joined < self.min_nodes:
            return False
        if joined >= self.max_nodes or round_ > 0:
            return True
        return min_reached is not None and time.monotonic() - min_reached >= float(self.conf["last_call_timeout"])

    def _watch_as_closer(self, round_: int, closer: bool) -> None:
        """The closer alone watches the round's joins and the previous round's keys (to count who is
        accounted for); the other joiners re-check every ``_RECHECK`` s in case the closer dies."""
        assert self._watch is not None
        if closer:
            join_prefix = self._r(round_, "join/")
            self._watch.watch("joins", join_prefix, prefix_end(join_prefix), self._kv.revision + 1)
            if round_ > 0:
                prev = self._r(round_ - 1, "")
                self._watch.watch("prev", prev, prefix_end(prev), self._kv.revision + 1)
        else:
            self._watch.unwatch("joins")
            self._watch.unwatch("prev")

    def _look(self, round_: int, write: dict[str, Any] | None = None) -> _Look:
        """Read round ``round_``'s result, earliest join, join count and this node's join key in
        one request (after ``write``, in the same transaction, when given).

        With a token the earliest *authentic* join: a forged one must not make every real joiner
        wait for a closer that does not exist (one more read, only when the earliest is forged).
        """
        assert self._node is not None
        join_prefix = self._r(round_, "join/")
        ops = [op_range(self._r(round_, "result")),
               op_range(join_prefix, prefix_end(join_prefix), keys_only=not self._auth.enabled, by_create=True,
                        limit=1),
               op_range(join_prefix + self._node.node_id, keys_only=True)]
        _, reads = self._kv.txn_reads([], [write, *ops] if write is not None else ops)
        result, (first, joined), (mine, _) = reads[-3:]
        if first and self._auth.enabled and self._open(first[0]) is None:
            every, _ = self._kv.range(join_prefix, prefix_end(join_prefix), by_create=True)
            first = self._authentic(every)[:1]
        return _Look(_first(result), first, joined, bool(mine))

    def _try_close(self, round_: int, min_reached: float | None, deadline: float) -> bool:
        """As the closer: apply the rules to the joiners and publish the result if the round may close."""
        join_prefix = self._r(round_, "join/")
        joiners, _ = self._retry(lambda: self._kv.range(join_prefix, prefix_end(join_prefix), by_create=True),
                                 deadline, "read joins")
        joiners = self._authentic(joiners)
        prev_doc = None
        prev_members: list[str] = []
        accounted = 0
        gone = 0
        lost: list[str] = []
        if round_ > 0:
            found = self._open(self._retry(lambda: self._kv.get(self._r(round_ - 1, "result")), deadline,
                                           "read the round"))
            if found is not None:
                prev_doc = json.loads(found)
                prev_members = [m["node_id"] for m in prev_doc["members"]]
        if prev_doc is not None:
            old = self._r(round_ - 1, "")
            kvs, _ = self._retry(lambda: self._kv.range(old, prefix_end(old), keys_only=not self._auth.enabled),
                                 deadline, "read")
            kvs = self._authentic(kvs)
            still = {kv.key[len(old) + 5:] for kv in kvs if kv.key.startswith(old + "join/")}
            done = {kv.key[len(old) + 5:] for kv in kvs if kv.key.startswith(old + "done/")}
            marked, _ = self._retry(lambda: self._kv.range(old + "l", prefix_end(old + "l")), deadline, "read")
            marks = self._causes_of(self._authentic(marked), old)
            ids = {kv.key[len(join_prefix):] for kv in joiners}
            for m in prev_members:
                if m not in still:
                    gone += 1
                    if m not in done:
                        lost.append(m)
                if m in ids or m not in still or m in done:
                    accounted += 1
        now = time.monotonic()
        size = close_size(CloseInputs(
            joined=len(joiners), min_nodes=self.min_nodes, max_nodes=self.max_nodes,
            prev_members=len(prev_members) if prev_doc is not None else None, prev_accounted=accounted,
            since_min=None if min_reached is None else now - min_reached,
            last_call=float(self.conf["last_call_timeout"]),
        ))
        if size is None:
            return False
        members = assign_ranks([NodeInfo.from_json(kv.value) for kv in joiners[:size]])
        causes = {n: marks.get(n, "silence") for n in lost} if prev_doc is not None else {}
        generation, used, abort, abort_code, streak = 0, 0, None, 1, 0
        if prev_doc is not None:
            generation = int(prev_doc["generation"]) + 1
            used = int(prev_doc.get("restarts_used", 0))
            fail_prefix = self._r(round_ - 1, "fail/")
            kvs, _ = self._retry(lambda: self._kv.range(fail_prefix, prefix_end(fail_prefix)), deadline, "read")
            failures = [FailureRecord.from_json(kv.value) for kv in self._authentic(kvs)]
            verdict = judge_round_end(self.run_id, failures, gone, used, int(prev_doc.get("no_progress_streak", 0)),
                                      self.params.max_restarts, self.params.crash_loop_limit)
            used, streak = verdict.restarts_used, verdict.no_progress_streak
            abort, abort_code = verdict.abort, verdict.abort_code
        doc = json.dumps(result_document(members, generation, used, self.params.max_restarts, abort, abort_code,
                                         lost, no_progress_streak=streak,
                                         lost_causes=causes))
        def put(key: str, value: str) -> dict[str, Any]:
            return op_put(key, self._seal(key, value), self._job_lease)

        result_key = self._r(round_, "result")
        ops = [put(result_key, doc), put(self._q + "current", str(round_ + 1))]
        if round_ >= 2:
            ops.append(op_delete_prefix(self._r(round_ - 2, "")))
        if abort is not None:
            ops.append(put(self._q + "abort_code", str(abort_code)))
            ops.append(put(self._q + "abort", abort))
        guard = cmp_absent(result_key)
        if self._auth.enabled:
            # A forged result in the way is replaced (if it is still the same forged value).
            squatter = self._retry(lambda: self._kv.get(result_key), deadline, "read the round")
            if squatter is not None and self._open(squatter) is None:
                guard = cmp_mod(result_key, squatter.mod_revision)
        return self._retry(lambda: self._kv.txn([guard], ops), deadline, "close")

    def _round_result(self, round_: int, doc: dict, cursor: int, deadline: float) -> RoundResult | None:
        """This node is a member: host or find the workers' store; None if group rank 0 was lost first."""
        assert self._node is not None and self._watch is not None
        members = [Member(**m) for m in doc["members"]]
        me = next(m for m in members if m.node_id == self._node.node_id)
        store_key = self._r(round_, "store")
        host = next(m for m in members if m.group_rank == 0)
        self._worker_store = None
        found: str | None = None
        if me.group_rank == 0:
            self._worker_store = host_worker_store(me.addr)
            found = f"{me.addr}:{self._worker_store.port}"
            address = self._seal(store_key, found)
            self._retry(lambda: self._kv.put(store_key, address, self._job_lease), deadline, "publish the store")
        # The address normally arrives as a watch event; read it (with the host's join key, one
        # request) only when a wait for the event passes without it.
        host_key = self._r(round_, "join", host.node_id)
        seen, first_wait = cursor, True
        while found is None:
            self._check_lease()
            events = self._watch.since(seen)
            seen = self._watch.seq
            for ev in events or []:
                if ev.key == store_key and ev.kind == "PUT":
                    found = self._auth.open(ev.key, ev.value) or found
            if found is not None:
                break
            if not first_wait or events is None:
                store, alive = self._retry(lambda: self._kv.read_many([op_range(store_key),
                                                                       op_range(host_key, keys_only=True)]),
                                           deadline, "read the store address")
                found = self._open(_first(store))
                if found is not None:
                    break
                if not alive[0]:
                    return None  # the store host died before publishing: go to the next round
            if time.monotonic() >= deadline:
                raise self._timeout_error(round_, len(members))
            first_wait = False
            self._watch.wait(seen, min(1.0, max(0.0, deadline - time.monotonic())))
        store_addr, _, store_port = found.rpartition(":")
        result = member_view(round_, doc, members, me, store_addr, int(store_port))
        self._round, self._result = round_, result
        self._members = {m.node_id for m in members}
        self._poll_seq = cursor
        self._ring = [m.node_id for m in sorted(members, key=lambda m: m.group_rank)]
        self._reported = set()
        self._ring_pending = self._node.node_id
        self._ring_target = None
        self._causes = {}
        with self._ring_lock:
            self._ring_members = sorted(members, key=lambda m: m.group_rank)
            self._link_gone = set()
        self._relink()
        return result

    # ------------------------------------------------------------------ the ring
    def _watch_successor(self) -> list[str]:
        """Watch the join key of the first live member after ``_ring_pending`` in group-rank order.

        Each member watches only its successor, so a death is one event for one agent; that agent
        writes ``r<R>/lost/<node>``, which every member watches.  Successors found gone on the way
        are declared too, so two dead neighbours are both found.  Returns the nodes declared.
        """
        assert self._watch is not None and self._node is not None and self._round is not None
        me, order, round_ = self._node.node_id, self._ring, self._round
        after = self._ring_pending
        if after is None or len(order) < 2:
            return []
        declared: list[str] = []
        start = order.index(after) if after in order else order.index(me)
        try:
            for step in range(1, len(order)):
                target = order[(start + step) % len(order)]
                if target == me:
                    break
                key = self._r(round_, "join", target)
                self._watch.watch("ring", key, _just(key), self._kv.revision + 1)
                if self._kv.range(key, keys_only=True)[0]:
                    self._ring_target, self._ring_pending = key, None
                    return declared
                if self._declare_lost(target):
                    declared.append(target)
        except (EtcdUnavailable, LeaseNotFound):
            return declared  # ``_ring_pending`` stays: the next poll carries on from there
        self._watch.unwatch("ring")
        self._ring_target, self._ring_pending = None, None
        return declared

    def _declare_lost(self, node_id: str) -> bool:
        """``node_id``'s join key is gone: write ``lost/`` unless it finished or moved to the next round.

        Put only if absent: the liveness link may have written it first (``link:``), and its cause stays.
        """
        assert self._round is not None and self._node is not None
        round_ = self._round
        if self._open(self._kv.get(self._r(round_, "done", node_id))) is not None:
            return False
        if self._kv.range(self._r(round_ + 1, "join", node_id), keys_only=True)[0]:
            return False
        key = self._r(round_, "lost", node_id)
        self._kv.txn([cmp_absent(key)], [op_put(key, self._seal(key, f"dead:{self._node.node_id}"), self._job_lease)])
        return True

    # ------------------------------------------------------------------ liveness link
    def _relink(self) -> None:
        """Hold the liveness link to the first ring successor not known gone."""
        if self._link is None or self._node is None:
            return
        with self._ring_lock:
            target = ring_successor(self._ring_members, self._node.node_id, self._link_gone)
        if target is None:
            self._link.watch(None)
        else:
            self._link.watch(target.node_id, target.addr, target.link_port)

    def _on_link_dead(self, node_id: str) -> None:
        """Called by the link's thread: the ring successor's process is gone.  Declare it now, once.

        One transaction writes ``r<R>/lost/<node>`` = ``link:<me>`` and deletes the node's join key,
        guarded by the join key's revision and the marker's absence, so only one writer wins (and
        nothing is done if its lease already expired or it left); the winner then revokes the dead
        agent's lease so its other keys go too.  Every member watches ``lost/``.
        """
        round_, me = self._round, self._node.node_id if self._node else ""
        if round_ is not None and not self._closed:
            if self._link_kv is None:
                self._link_kv = EtcdClient(self.settings, self._shared)
            kv = self._link_kv
            join_key, dead_key = self._r(round_, "join", node_id), self._r(round_, "lost", node_id)
            try:
                found = kv.get(join_key)
                if found is not None and kv.txn(
                    [cmp_mod(join_key, found.mod_revision), cmp_absent(dead_key)],
                    [op_put(dead_key, self._seal(dead_key, f"link:{me}"), self._job_lease), op_delete(join_key)],
                ):
                    self._causes[node_id] = "link"
                    self._wakeup.set()  # this agent's own poll has news now
                    if found.lease:
                        kv.revoke(found.lease)
            except RendezvousError as exc:  # etcd unreachable: the lease expires on its own
                self._warn(f"could not declare {node_id} dead in etcd ({exc}); its lease will expire")
        with self._ring_lock:
            self._link_gone.add(node_id)
        self._relink()  # the next successor may be gone too

    def _causes_of(self, kvs: list[KV], base: str) -> dict[str, str]:
        """Why each node marked under ``base`` (= ``r<R>/``) by ``lost/`` or ``left/`` (authentic KVs) went."""
        causes: dict[str, str] = {}
        for kv in kvs:
            kind, _, node = kv.key[len(base):].partition("/")
            if kind == "left" and node:
                causes[node] = "left"
            elif kind == "lost" and node:
                causes[node] = "link" if (self._open(kv) or "").startswith("link:") else "silence"
        return causes


    # ------------------------------------------------------------------ while running
    def wakeup_fileno(self) -> int | None:
        return self._wakeup.fileno()

    def poll(self) -> RoundChange:
        self._wakeup.clear()
        change = RoundChange()
        if self._round is None or self._result is None or self._watch is None or self._closed:
            return change
        keeper = self._keeper
        if keeper is not None:
            if keeper.lost or keeper.job_lost:
                change.new_round_requested = True  # our membership expired (e.g. after a partition)
                return change
            if keeper.outage_since is not None and \
                    time.monotonic() - keeper.outage_since > float(self.conf["outage_timeout"]):
                raise RendezvousConnectionError(
                    f"etcd at {self.endpoints_text} has been unreachable for more than "
                    f"{float(self.conf['outage_timeout']):g} s (outage_timeout): {keeper.last_error}"
                )
        events = self._watch.since(self._poll_seq)
        self._poll_seq = self._watch.seq
        round_, me = self._round, self._node.node_id if self._node else ""
        if events is None:
            return self._mark_growth(self._resync())
        lost: list[str] = []
        if self._ring_pending is not None:
            lost += self._watch_successor()
        marks = (self._r(round_, "lost/"), self._r(round_, "left/"))
        next_member, next_new = self._r(round_, "next", "member"), self._r(round_, "next", "new")
        for ev in events:
            if ev.kind == "PUT" and self._auth.enabled and self._auth.open(ev.key, ev.value) is None:
                continue  # a forged value: never acted on (reported once)
            if ev.key == self._q + "abort" and ev.kind == "PUT":
                change.aborted = self._auth.open(ev.key, ev.value)
                change.abort_exit_code = self._abort_code()
            elif ev.key == self._ring_target and ev.kind == "DELETE":
                self._ring_pending = ev.key.rsplit("/", 1)[1]
                lost += self._watch_successor_after_loss()
            elif ev.kind == "PUT" and ev.key.startswith(marks):
                node = ev.key.rsplit("/", 1)[1]
                value = self._auth.open(ev.key, ev.value) or ""
                self._causes[node] = ("left" if ev.key.startswith(marks[1])
                                      else "link" if value.startswith("link:") else "silence")
                if node == me and ev.key.startswith(marks[0]):
                    change.new_round_requested = True  # our join key vanished: our membership is gone
                lost.append(node)
            elif ev.kind == "PUT" and ev.key == next_member:
                change.new_round_requested = True
            elif ev.kind == "PUT" and ev.key == next_new:
                joined = self._next_joins()
                change.new_round_requested |= bool(joined & self._members)
                waiting = joined - self._members
                if waiting and self._result.group_world_size < self.max_nodes:
                    change.nodes_waiting = len(waiting)
        change.lost_nodes = [n for n in dict.fromkeys(lost) if n in self._members and n != me
                             and n not in self._reported]
        self._reported.update(change.lost_nodes)
        change.lost_causes = {n: self._causes.get(n, "silence") for n in change.lost_nodes}
        return self._mark_growth(change)

    def _mark_growth(self, change: RoundChange) -> RoundChange:
        """Before the agent stops its workers for a joiner, mark the round ``grown``: a peer's worker
        that fails from that stop is recorded after the mark and is not charged (report_failure)."""
        if change.nodes_waiting and self._round is not None:
            key = self._r(self._round, "grown")
            try:
                self._kv.put(key, self._seal(key, self._node.node_id if self._node else "?"), self._job_lease)
            except (EtcdUnavailable, LeaseNotFound):
                pass  # best effort: without the mark such a failure is charged, as it was before
        return change

    def _watch_successor_after_loss(self) -> list[str]:
        """The watched successor's join key was deleted: declare it (unless it finished or moved on)
        and watch the next one."""
        lost_node = self._ring_pending
        assert lost_node is not None
        try:
            declared = [lost_node] if self._declare_lost(lost_node) else []
        except (EtcdUnavailable, LeaseNotFound):
            declared = [lost_node]  # the others learn it from the lease expiry in their own resync
        return declared + self._watch_successor()

    def _next_joins(self) -> set[str]:
        """Node ids (authentic) that joined the round after this node's round."""
        assert self._round is not None
        prefix = self._r(self._round + 1, "join/")
        try:
            kvs, _ = self._kv.range(prefix, prefix_end(prefix), keys_only=not self._auth.enabled)
        except (EtcdUnavailable, LeaseNotFound):
            return set()
        return {kv.key[len(prefix):] for kv in self._authentic(kvs)}

    def _resync(self) -> RoundChange:
        """Re-read the round's state after the watch missed events (compaction or a full buffer)."""
        change = RoundChange()
        assert self._round is not None and self._watch is not None
        try:
            abort = self._open(self._kv.get(self._q + "abort"))
            if abort is not None:
                change.aborted = abort
                change.abort_exit_code = self._abort_code()
                return change
            now_prefix, done_prefix = self._r(self._round, "join/"), self._r(self._round, "done/")
            alive = {kv.key[len(now_prefix):] for kv in self._kv.range(now_prefix, prefix_end(now_prefix),
                                                                          keys_only=True)[0]}
            dones, _ = self._kv.range(done_prefix, prefix_end(done_prefix), keys_only=not self._auth.enabled)
            done = {kv.key[len(done_prefix):] for kv in self._authentic(dones)}
            next_prefix = self._r(self._round + 1, "join/")
            nexts, _ = self._kv.range(next_prefix, prefix_end(next_prefix), keys_only=not self._auth.enabled)
            joined = {kv.key[len(next_prefix):] for kv in self._authentic(nexts)}
            base = self._r(self._round, "")
            marked, _ = self._kv.range(base + "l", prefix_end(base + "l"))  # left/ and lost/
            self._causes.update(self._causes_of(self._authentic(marked), base))
        except (EtcdUnavailable, LeaseNotFound):
            return change
        self._watch.gap = False
        change.lost_nodes = sorted(self._members - alive - done - joined)
        change.lost_causes = {n: self._causes.get(n, "silence") for n in change.lost_nodes}
        change.new_round_requested = bool(joined & self._members)
        waiting = joined - self._members
        if waiting and self._result is not None and self._result.group_world_size < self.max_nodes:
            change.nodes_waiting = len(waiting)
        return change

    def _write_soon(self, op, what: str, timeout: float = 5.0) -> None:
        self._retry(op, time.monotonic() + timeout, what)

    def report_failure(self, failure: FailureRecord) -> None:
        if self._round is None:
            return
        grown = self._r(self._round, "grown")
        try:
            failure.after_growth = self._open(self._kv.get(grown)) is not None
        except (EtcdUnavailable, LeaseNotFound):
            pass
        key = self._r(self._round, "fail", failure.node_id)
        value = self._seal(key, failure.to_json())
        self._write_soon(lambda: self._kv.put(key, value, self._job_lease), "record the failure")

    def leave(self, reason: str) -> None:
        if self._round is None or self._node is None:
            return
        node_id, round_ = self._node.node_id, self._round
        left_key = self._r(round_, "left", node_id)
        self._write_soon(lambda: self._kv.txn([], [
            op_put(left_key, self._seal(left_key, reason), self._job_lease),
            op_delete(self._r(round_, "join", node_id)),
        ]), "leave the job")

    def finish(self, timeout: float) -> bool:
        if self._round is None or self._result is None or self._node is None or self._watch is None:
            return True
        round_, me = self._round, self._node.node_id
        deadline = time.monotonic() + timeout
        done_key, finished_key = self._r(round_, "done", me), self._q + "finished"
        self._retry(lambda: self._kv.put(done_key, self._seal(done_key, "1"), self._job_lease), deadline, "finish")
        base = self._r(round_, "")
        while True:
            cursor = self._watch.seq
            if self._open(self._retry(lambda: self._kv.get(finished_key), deadline, "finish")) is not None:
                return True  # the member that saw every other one done wrote it (one event for all)
            kvs, _ = self._retry(lambda: self._kv.range(base, prefix_end(base), keys_only=not self._auth.enabled),
                                 deadline, "finish")
            done = {kv.key[len(base) + 5:] for kv in self._authentic([kv for kv in kvs
                                                                      if kv.key.startswith(base + "done/")])}
            alive = {kv.key[len(base) + 5:] for kv in kvs if kv.key.startswith(base + "join/")}
            if all(m in done or m not in alive for m in self._members):
                self._retry(lambda: self._kv.put(finished_key, self._seal(finished_key, "1"), self._job_lease),
                            deadline, "finish")
                return True
            if self._open(self._kv.get(self._r(round_ + 1, "result"))) is not None or \
                    self._open(self._kv.get(self._q + "abort")) is not None:
                return False
            if time.monotonic() >= deadline:
                return False
            self._watch.wait(cursor, min(1.0, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        """Stop the threads, drop this agent's lease (its keys go with it); the last agent out removes the job."""
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.close()  # "bye" to this node's watcher: leaving is not dying
        if self._keeper is not None:
            self._keeper.stop()
        if self._watch is not None:
            self._watch.stop()
        self._worker_store = None
        self._wakeup.close()
        if not self._lease:
            return
        try:
            self._kv.revoke(self._lease)
            self._lease = 0
            if self._epoch is not None:
                ok = self._kv.txn([cmp_range_empty(self._p + "agents/"), cmp_mod(self._p + "epoch", self._epoch_rev)],
                                  [op_delete_prefix(self._p)])
                if ok and self._job_lease:
                    self._kv.revoke(self._job_lease)
        except RendezvousError as exc:
            self._warn(f"could not clean up the job's keys in etcd ({exc}); they expire within job_ttl")

    # ------------------------------------------------------------------ introspection
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
                result = json.loads(found)
                doc.update(round=open_round - 1, generation=result["generation"],
                           restarts_used=result["restarts_used"])
                alive = {kv.key.rsplit("/", 1)[1] for kv in self._kv.range(
                    f"{q}r{open_round - 1}/join/", prefix_end(f"{q}r{open_round - 1}/join/"), keys_only=True)[0]}
                for m in result["members"]:
                    doc["members"].append({**m, "state": "alive" if m["node_id"] in alive else "gone"})
        return doc
