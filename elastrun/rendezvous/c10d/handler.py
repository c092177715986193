"""The ``c10d`` backend: rounds on torch's own ``TCPStore``, hosted by the agent on the endpoint's host.

The agent whose host is the ``--rdzv-endpoint`` host binds the store (or, with ``--standalone``,
a free port); every other agent is a client.  The job's state lives in that one agent's memory,
so losing that node ends the job: this backend has a single point of failure, which the error
says when it happens.  ``--rdzv-backend=etcd`` keeps the state in a replicated etcd cluster
instead and survives the loss of any node.

The keys written and the order of operations are documented in docs/rendezvous-protocol.md.
All keys live under ``/elastrun/<run_id>/``.  Every operation is O(1) per node except the
closer's one ``multi_get``/result write per round, so a round costs O(n) store operations in
total (no compare-and-set storm on a shared blob).

The handler is made of four parts: this module (the backend's settings and factory, and a
member's side of a round: the join, the result, the poll while the workers run),
:mod:`elastrun.rendezvous.c10d.closing` (the wait for a round's close, the close and its result,
the pruning of old rounds), :mod:`elastrun.rendezvous.c10d.liveness` (heartbeats, the ring watch,
the liveness link) and :mod:`elastrun.rendezvous.c10d.ending` (failures, hang claims, leaving, the
exit barrier, the close), all over :mod:`elastrun.rendezvous.c10d.client`.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from elastrun.rendezvous import conf
from elastrun.rendezvous.api import (
    FunctionBackend,
    JobFailedError,
    JobFinishedError,
    Member,
    NodeInfo,
    RendezvousConfigError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
    RoundCause,
    RoundChange,
    RoundResult,
)
from elastrun.rendezvous.auth import JobToken, load_token
from elastrun.rendezvous.c10d.client import store_errors
from elastrun.rendezvous.c10d.closing import Closing, JoinSlots
from elastrun.rendezvous.c10d.ending import Ending
from elastrun.rendezvous.c10d.liveness import Liveness
from elastrun.rendezvous.c10d.seats import FullRoster, Roster, SeatedRoster, is_seated, member_result, read_seat
from elastrun.rendezvous.c10d.status import read_job_status
from elastrun.rendezvous.endpoint import host_worker_store, route_address, split_endpoint
from elastrun.rendezvous.keepalive import Heartbeat, RingWatch
from elastrun.rendezvous.link import Link
from elastrun.rendezvous.rounds import decode_result, is_void, join_interrupts, timeout_error, void_result
from elastrun.rendezvous.waiting import DEFAULT_INTERVAL as DEFAULT_WAIT_REPORT
from elastrun.rendezvous.wakeup import Wakeup

#: ``--rdzv-conf`` keys of the store backends, with defaults.
CONFIG_KEYS: dict[str, conf.Key] = {
    "join_timeout": conf.Key("seconds", 600.0),
    "last_call_timeout": conf.Key("seconds", 1.0),
    "heartbeat_interval": conf.Key("seconds", 0.5),
    "heartbeat_timeout": conf.Key("seconds", 2.5),
    "read_timeout": conf.Key("seconds", 60.0),
    "host_linger": conf.Key("seconds", 30.0),
    "is_host": conf.Key("bool"),
    "token_file": conf.Key("text"),
    "wait_report_interval": conf.Key("seconds", DEFAULT_WAIT_REPORT),
}
#: torchrun's names accepted as aliases.
CONFIG_ALIASES = {"keep_alive_interval": "heartbeat_interval", "timeout": "join_timeout"}

#: How often an awaited key is read again while a value that is not authentic (forged) holds it.
_VALUE_POLL = 0.02
#: How long members wait for group rank 0 to publish the workers' store before giving up on it.
_STORE_WAIT = 15.0


def parse_config(params: RendezvousParameters) -> dict[str, Any]:
    """Typed ``--rdzv-conf`` values; unknown keys are an error that lists the known ones."""
    values = conf.read(params.config, CONFIG_KEYS, params.backend, CONFIG_ALIASES)
    if values["heartbeat_timeout"] <= values["heartbeat_interval"]:
        raise RendezvousConfigError(
            "--rdzv-conf heartbeat_timeout must be larger than heartbeat_interval "
            f"(got {values['heartbeat_timeout']} <= {values['heartbeat_interval']})"
        )
    if values["heartbeat_interval"] <= 0:
        raise RendezvousConfigError("--rdzv-conf heartbeat_interval must be positive")
    return values




class StoreRendezvousHandler(Closing, Liveness, Ending):
    """Rendezvous rounds on a ``TCPStore``; see the module docstring and docs/rendezvous-protocol.md.

    This class is a member's side: the join, the result and the poll while workers run.  The close of
    a round is :class:`~elastrun.rendezvous.c10d.closing.Closing`, heartbeats and the ring watch are
    :class:`~elastrun.rendezvous.c10d.liveness.Liveness`, failures, leaving, the exit barrier and the
    handler's close are :class:`~elastrun.rendezvous.c10d.ending.Ending`.
    """

    backend_name = "c10d"

    def __init__(self, params: RendezvousParameters, host: str, port: int, is_host: bool | None) -> None:
        self.params = params
        self.conf = parse_config(params)
        self.run_id = params.run_id
        self.min_nodes = params.min_nodes
        self.max_nodes = params.max_nodes
        self.join_timeout = float(self.conf["join_timeout"])
        self.store_host, self.store_port = host, port
        self.local_addr = params.local_addr or route_address(host, port)
        token = JobToken(load_token(self.conf["token_file"], self.warn), self.run_id)
        self._server = None
        self._store = self._connect(host, port, is_host)
        self._auth = self._authenticate(token)
        self._auth.on_forged = self._report_forged
        self._prefix = self._auth.prefix
        self._hb_store = self._second_connection()
        self._node: NodeInfo | None = None
        self._round: int | None = None
        self._result: RoundResult | None = None
        #: The current round's members as this node knows them (:mod:`elastrun.rendezvous.c10d.seats`): the
        #: whole list in a round of up to 64, else its own seat and the seats its ring walk read.
        self._roster: Roster | None = None
        self._seen_signal = 0
        self._worker_store = None
        #: ``(key, raw value)`` of the result a follower read together with ``closed``.
        self._fetched: tuple[str, bytes | None] = ("", None)
        #: The node that closed the round this node last saw closed (from the ``closed`` value).
        self._closer = ""
        self._heartbeat: Heartbeat | None = None
        self._hb_counter = 0
        #: The ring watch; a successor never seen beating gets one more ``heartbeat_timeout`` (a node
        #: starts beating when it sees its first round closed: see ``next_round``).
        self._watch = RingWatch(self.conf["heartbeat_timeout"], first_beat_grace=self.conf["heartbeat_timeout"])
        self._link: Link | None = None
        self._link_tried = False
        #: Ring successors whose process the liveness link found gone (declared by the heartbeat thread).
        self._link_lost: set[str] = set()
        self._wakeup = Wakeup()
        self._error: Exception | None = None
        self._lock = threading.Lock()
        self._registered = False
        self._closed = False

    # ------------------------------------------------------------------ the round
    @store_errors
    def next_round(self, node: NodeInfo) -> RoundResult:
        started = time.monotonic()
        deadline = started + self.join_timeout
        self._node = node
        self._start_link(node)
        if not self._registered:
            self._store.add(self._k("agents"), 1)
            self._registered = True
        # A node heartbeats once it is in a round's hands (docs/rendezvous-protocol.md, "Heartbeats"):
        # it takes the first slot, closes a round, or sees the round it joined closed.  A fresh
        # joiner waiting for its first round is watched by nobody, and its beats would cost the
        # store n writes per heartbeat interval for as long as the round takes to form: O(n²).
        self._check_job_ended()
        member_of = self._round
        if self._result is not None:
            node.prev_group_rank = self._result.group_rank
        round_ = self._open_round(member_of)
        while True:
            if time.monotonic() >= deadline:
                raise self._timeout_error(round_)
            idx = self._store.add(self._r(round_, "joined"), 1)
            if idx == 1:  # the round's closer, whose heartbeats its followers watch
                self._start_heartbeat()
            rejoining = (
                member_of is not None
                and round_ == member_of + 1
                and self._read(self._r(member_of, "dead", node.node_id)) is None
            )
            if rejoining:
                self._store.add(self._r(round_, "rejoined"), 1)
            self._put(self._r(round_, "node", idx), node.to_json())
            if round_ > 0:
                self._store.add(self._r(round_ - 1, "signal"), 1)
            size = self._await_close(round_, idx, deadline)
            if idx <= size:
                self._start_heartbeat()  # a member now: its ring predecessor watches it from the result on
                result = self._await_result(round_, node, deadline)
                if result is not None:
                    result.duration = time.monotonic() - started
                    return result
                # The round formed without a usable store (its rank-0 node died): it counts as
                # this node's last round, so the next one waits for every member of it.
                member_of = round_
            round_ = max(round_ + 1, self._open_round(member_of))

    def _open_round(self, member_of: int | None) -> int:
        """The open round (``current``).  When that value is missing or not authentic, the round after
        this node's last one (or 0): the join loop walks on past rounds that are already closed."""
        value = self._read(self._k("current"))
        if value is not None:
            return int(value)
        return 0 if member_of is None else member_of + 1

    def _check_job_ended(self) -> None:
        summary = self._read(self._k("abort"))
        if summary is not None:
            raise JobFailedError("the job was ended by another node", summary, self._abort_code())
        if self._read(self._k("finished")) is not None:
            raise JobFinishedError(f"job {self.run_id!r} has already finished")

    def _abort_code(self) -> int:
        code = self._read(self._k("abort_code"))
        return int(code) if code else 1

    def _timeout_error(self, round_: int) -> RendezvousTimeoutError:
        joined = self._count(self._r(round_, "joined"))
        return timeout_error(self.run_id, self.join_timeout, round_, self.min_nodes, self.max_nodes, joined)


    def _await_value(self, key: str, deadline: float, give_up: float | None = None) -> str | None:
        """Block until an authentic value is under ``key``; None once ``give_up`` (monotonic) passes."""
        while True:
            if self._wait(key, min(1.0, max(0.0, deadline - time.monotonic()))):
                value = self._read(key)
                if value is not None:
                    return value
                time.sleep(_VALUE_POLL)  # a forged value holds the key: wait for the real one
            now = time.monotonic()
            if give_up is not None and now >= give_up:
                return None
            if now >= deadline:
                raise TimeoutError

    def _await_published(self, key: str, deadline: float) -> str | None:
        """The closed round's result under ``key``.  A closer that still heartbeats is waited for.

        Once its closer stopped heartbeating without writing it (it died between its close and its
        result; waiting would last until ``join_timeout``), this member writes the round *void*
        with a compare-and-set, so that the closer, if it was only slow, cannot publish a result
        after all: every joiner then reads the same value, a void or a real result.  Before, a
        closer stalled past ``heartbeat_timeout`` (a loaded host) still published and ran the round
        while its followers had moved on to the next one, where they waited for it until
        ``join_timeout``.
        """
        closer = self._closer if self._closer != self._node.node_id else ""
        watch = RingWatch(float(self.conf["heartbeat_timeout"]))
        watch.retarget(closer or None)
        while True:
            value = self._await_value(key, deadline, time.monotonic() + 1.0)
            if value is not None:
                return value
            if closer and watch.observe(self._read(self._k("hb", closer))):
                won, value = self._claim(key, void_result(f"its closer {closer} went silent before its result"))
                if won or value is None:  # None: a forged value holds the key; the round is lost either way
                    return None
                return value

    def _await_result(self, round_: int, node: NodeInfo, deadline: float) -> RoundResult | None:
        """This node's view of closed round ``round_``; None when it turned out unusable for it."""
        result_key = self._r(round_, "result")
        fetched_key, fetched = self._fetched
        self._fetched = ("", None)
        value = self._auth.open(result_key, fetched) if fetched is not None and fetched_key == result_key else None
        try:
            value = value or self._await_published(result_key, deadline)
        except TimeoutError:
            raise self._timeout_error(round_) from None
        if value is None:
            return None  # a forged value holds the result: the round never formed for this node
        doc = decode_result(value)
        if is_void(doc):
            return None  # its closer went silent before publishing it: the round never formed
        if doc.get("abort"):
            raise JobFailedError("the job was ended", doc["abort"], int(doc.get("abort_code", 1)),
                                 RoundCause.from_dict(doc.get("cause")))
        roster: Roster
        if is_seated(doc):
            seat = self._read(self._r(round_, "seat", node.node_id))
            if seat is None:
                return None  # not a member
            me, after = read_seat(seat)
            roster = SeatedRoster(int(doc["size"]), me, after)
        else:
            roster = FullRoster(Member(**m) for m in doc["members"])
            me = next((m for m in roster.known() if m.node_id == node.node_id), None)
            if me is None:
                return None
        store_key = self._r(round_, "store")
        address = doc.get("store")  # the closer, as group rank 0, started the workers' store already
        if address is not None and me.group_rank != 0:
            self._worker_store = None  # this node's store of an earlier round, if it hosted one
        if address is None:
            self._worker_store = None
            if me.group_rank == 0:
                self._worker_store = host_worker_store(me.addr)
                self._put(store_key, f"{me.addr}:{self._worker_store.port}")
            try:
                address = self._await_value(store_key, deadline, time.monotonic() + _STORE_WAIT)
            except TimeoutError:
                raise self._timeout_error(round_) from None
        if address is None:
            self._declare_gone(round_, doc.get("rank0") or roster.known()[0].node_id, f"dead:{node.node_id}")
            return None
        store_addr, _, store_port = address.rpartition(":")
        result = member_result(round_, doc, me, roster, store_addr, int(store_port))
        self._adopt(round_, result, roster)
        if self._link is not None:  # link to the new ring successor now (the next beat checks the rest)
            after = roster.successor(node.node_id, self._seat_reader(round_))
            self._link.watch(after.node_id if after else None, after.addr if after else "",
                             after.link_port if after else 0)
        return result

    def _adopt(self, round_: int, result: RoundResult, roster: Roster) -> None:
        """Make ``result`` this node's round, with its members as this node knows them (``roster``):
        each heartbeat finds its successor and the successor's link address in O(1)."""
        assert self._node is not None
        with self._lock:
            self._round = round_
            self._result = result
            self._roster = roster
            # -1, not the signal count now: a node that joined the next round (or a member that
            # already rejoined it) before this node read the result signalled before it looked;
            # the first poll must look at the counters whatever the signal says.
            self._seen_signal = -1

    # ------------------------------------------------------------------ while running
    def wakeup_fileno(self) -> int | None:
        return self._wakeup.fileno()

    @store_errors
    def poll(self) -> RoundChange:
        self._wakeup.clear()
        if self._error is not None:
            raise self.store_lost_error(self._error)
        round_ = self._round
        if round_ is None or self._result is None:
            return RoundChange()
        signal = self._count(self._r(round_, "signal"))
        if signal == self._seen_signal:
            return RoundChange()
        self._seen_signal = signal
        change = RoundChange()
        aborted = self._read(self._k("abort"))
        if aborted is not None:
            change.aborted = aborted
            change.abort_exit_code = self._abort_code()
            return change
        roster, fetch = self._roster, self._seat_reader(round_)
        if self._count(self._r(round_, "gone")):
            lines = self._lines(self._r(round_, "gone_list"))
            change.lost_nodes = [n for n in dict.fromkeys(lines) if roster is not None and roster.is_member(n, fetch)]
            change.lost_causes = self._lost_causes(round_, change.lost_nodes)
        rejoined = self._count(self._r(round_ + 1, "rejoined"))
        joined = self._count(self._r(round_ + 1, "joined"))
        waiting = joined - rejoined
        below_max = self._result.group_world_size < self.max_nodes
        if self._auth.enabled and (rejoined > 0 or (waiting > 0 and below_max)):
            # The counters only say where to look: count the authentic joins of the next round.
            infos = [info for _, info in JoinSlots().read(self, round_ + 1, joined, wait=False)]
            rejoined = sum(1 for info in infos if roster is not None and roster.is_member(info.node_id, fetch))
            waiting = len(infos) - rejoined
        change.new_round_requested = rejoined > 0
        if waiting > 0 and below_max:
            change.nodes_waiting = waiting
            # The agent stops its workers for the joiner after this returns; a peer's worker that
            # fails from that stop is recorded after this mark and is not charged (report_failure).
            self._put(self._r(round_, "grown"), self._node.node_id if self._node else "?")
        return change

    @store_errors
    def join_interrupts(self) -> bool:
        if self._result is not None or self._read(self._k("abort")) is not None \
                or self._read(self._k("finished")) is not None:
            return False
        current = self._read(self._k("current"))
        open_round = int(current) if current is not None else 0
        if open_round <= 0:
            return False
        joined = self._count(self._r(open_round, "joined"))
        running = self._read(self._r(open_round - 1, "result")) if joined == 0 else None
        try:
            doc = decode_result(running) if running is not None else None
        except ValueError:
            return False
        return join_interrupts(open_round, joined, doc, self.max_nodes)


def validate_params(params: RendezvousParameters) -> None:
    """Reject a bad endpoint or ``--rdzv-conf`` before anything starts."""
    if not params.endpoint:
        raise RendezvousConfigError("the c10d backend needs --rdzv-endpoint HOST[:PORT] (or use --standalone)")
    if "," in params.endpoint:
        raise RendezvousConfigError("the c10d backend takes one endpoint HOST[:PORT]; lists are for etcd")
    split_endpoint(params.endpoint, 29400)
    parse_config(params)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Factory for ``--rdzv-backend=c10d``."""
    validate_params(params)
    host, port = split_endpoint(params.endpoint, 29400)
    is_host = parse_config(params)["is_host"]
    if port == 0:
        is_host = True
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return StoreRendezvousHandler(params, host, port, is_host)


#: ``--rdzv-backend=c10d``: checks, handler and status reader (:mod:`elastrun.rendezvous.c10d.status`).
BACKEND = FunctionBackend(validate_params, create_handler, read_job_status)
