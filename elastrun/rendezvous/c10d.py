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
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

from elastrun.rendezvous import conf
from elastrun.rendezvous.api import (
    FailureRecord,
    FunctionBackend,
    JobFailedError,
    JobFinishedError,
    Member,
    NodeInfo,
    RendezvousConfigError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
    RoundChange,
    RoundResult,
)
from elastrun.rendezvous.auth import JobToken, load_token
from elastrun.rendezvous.endpoint import host_worker_store, route_address, split_endpoint
from elastrun.rendezvous.keepalive import Heartbeat, RingWatch
from elastrun.rendezvous.link import Link, Wakeup, listen_for_watchers
from elastrun.rendezvous.rounds import (
    CloseInputs,
    assign_ranks,
    close_size,
    decode_result,
    encode_result,
    judge_round_end,
    result_document,
    timeout_error,
)
from elastrun.rendezvous.seats import (
    FULL_LIST_MAX,
    FullRoster,
    Roster,
    SeatedRoster,
    all_members,
    is_seated,
    member_result,
    read_seat,
    split_result,
)
from elastrun.rendezvous.store_client import StoreClient, all_present, store_errors
from elastrun.rendezvous.store_status import read_job_status
from elastrun.rendezvous.waiting import DEFAULT_INTERVAL as DEFAULT_WAIT_REPORT
from elastrun.rendezvous.waiting import NAMED, waiting_line

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

_CLOSER_POLL = 0.02
_FOLLOWER_POLL = 1.0
#: How long a round stays ready to close before a joiner other than the first closes it (the first
#: joiner may have died).  Without it every joiner would re-check the whole round each second while
#: the first one closes it: with a token that is n reads and HMACs per joiner, O(n²) per round.
_FALLBACK_GRACE = 2.0


def _follower_poll(idx: int) -> float:
    """How often the joiner with arrival index ``idx`` > 1 re-checks its open round (job ended, fallback close).

    Every second for the first few; further back, a quarter of its fallback grace (at most 4 s), so
    thousands of waiting joiners do not each cost the store several operations per second.
    """
    return max(_FOLLOWER_POLL, _FALLBACK_GRACE * min(idx - 1, 8) / 4)


#: With a token, the followers that may close a round whose first joiner still heartbeats but has
#: not closed it (its main thread stuck): the earliest ones only, so that the joins are checked by a
#: few, not by thousands at once.  They wait their grace plus this many heartbeat timeouts.
_RESCUERS = 8
_STUCK_CLOSER_TIMEOUTS = 4.0
#: How long a closer waits for a joiner's info after the round closed before leaving it out.
_SLOT_WAIT = 5.0
#: Rounds whose keys stay in the store behind the one being closed; the closer deletes older ones.
KEEP_ROUNDS = 8
#: The keys of a round besides its join slots, its per-node markers, seats and parts
#: (docs/rendezvous-protocol.md).
_ROUND_KEYS = ("joined", "rejoined", "closed", "result", "store", "signal", "gone", "gone_list", "fail_list",
               "grown", "done", "done_list")
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


class StoreRendezvousHandler(StoreClient):
    """Rendezvous rounds on a ``TCPStore``; see the module docstring and docs/rendezvous-protocol.md."""

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
        #: The current round's members as this node knows them (:mod:`elastrun.rendezvous.seats`): the
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
        self._watch = RingWatch(self.conf["heartbeat_timeout"])
        self._link: Link | None = None
        self._link_tried = False
        #: Ring successors whose process the liveness link found gone (declared by the heartbeat thread).
        self._link_lost: set[str] = set()
        self._wakeup = Wakeup()
        self._error: Exception | None = None
        self._lock = threading.Lock()
        self._registered = False
        self._closed = False


    def _waiting_line(self, round_: int, prev: _PrevRound | None, deadline: float) -> str:
        """The line of this node waiting for ``round_`` to close: the joins so far and the first joiners' hosts."""
        joined = self._count(self._r(round_, "joined"))
        hosts = []
        for idx in range(1, min(joined, NAMED) + 1):
            info = self._read(self._r(round_, "node", idx))
            if info is not None:
                hosts.append(NodeInfo.from_json(info).hostname or NodeInfo.from_json(info).node_id)
        why = "" if prev is None else f"the group of round {round_ - 1} to re-form (its members rejoin or are lost)"
        return waiting_line(round_, joined, self.min_nodes, self.max_nodes, hosts, deadline, why)

    # ------------------------------------------------------------------ heartbeats
    def _start_heartbeat(self) -> None:
        if self._heartbeat is None:  # its thread's first beat is at once, beside the join's own operations
            self._heartbeat = Heartbeat(self.conf["heartbeat_interval"], self._beat, self._on_heartbeat_error)
            self._heartbeat.start()

    def _on_heartbeat_error(self, exc: Exception) -> None:
        self._error = exc

    def _beat(self) -> None:
        assert self._node is not None
        self._hb_counter += 1
        store = self._hb_store
        self._put(self._k("hb", self._node.node_id), f"{self._hb_counter}:{time.time():.3f}", store)
        self._error = None
        with self._lock:
            round_, roster, link_lost = self._round, self._roster, set(self._link_lost)
        fetch = self._seat_reader(round_, store)
        if link_lost:
            stale = {n for n in link_lost if roster is None or not roster.is_member(n, fetch)}
            with self._lock:
                self._link_lost -= stale
        member = self._ring_target(round_, roster, store)
        target = member.node_id if member is not None else None
        if self._link is not None:
            self._link.watch(target, member.addr if member else "", member.link_port if member else 0)
        if target is None:
            return
        self._watch.retarget(target)
        if target in self._link_lost:
            marker = f"link:{self._node.node_id}"  # its process is gone: no need to wait for the silence
        elif self._watch.observe(self._read(self._k("hb", target), store)):
            marker = f"dead:{self._node.node_id}"
        else:
            return
        if self._declare_gone(round_, target, marker, store):
            self._wakeup.set()  # this agent's own poll has news now
        with self._lock:
            self._link_lost.discard(target)
        self._watch.retarget(None)
        if self._heartbeat is not None:
            self._heartbeat.wake()  # watch the next successor now: it may be gone too

    def _ring_target(self, round_: int | None, roster: Roster | None, store) -> Member | None:
        """The first successor of this node in the ring of ``round_`` not already known dead."""
        assert self._node is not None
        if round_ is None or roster is None:
            return None
        return roster.ring_walk(self._node.node_id, lambda n: self._read(self._r(round_, "dead", n), store) is not None,
                                self._seat_reader(round_, store))

    def _seat_reader(self, round_: int | None, store=None):
        """Reads a member's seat of ``round_`` (a seated round: :mod:`elastrun.rendezvous.seats`) over ``store``."""
        return lambda node_id: None if round_ is None else self._read(self._r(round_, "seat", node_id), store)

    def _start_link(self, node: NodeInfo) -> None:
        """Listen for this node's watcher before its info (which carries the port) is published."""
        if self._link is None and not self._link_tried:
            self._link_tried = True
            self._link = listen_for_watchers(node, lambda: self._auth, self._on_link_dead, self.warn)
        node.link_port = self._link.port if self._link is not None else 0

    def _on_link_dead(self, node_id: str) -> None:
        """Called by the link's thread: the watched successor's process is gone; declare it now."""
        with self._lock:
            self._link_lost.add(node_id)
        if self._heartbeat is not None:
            self._heartbeat.wake()

    def _lost_causes(self, round_: int, nodes: list[str]) -> dict[str, str]:
        """How each of ``nodes`` was declared gone from ``round_``, from its authentic ``dead/`` marker."""
        keys = [self._r(round_, "dead", n) for n in nodes]
        if not keys:
            return {}
        if self._store.check(keys):
            marks = [self._auth.open(k, raw) for k, raw in zip(keys, self._store.multi_get(keys), strict=True)]
        else:
            marks = [self._read(k) for k in keys]
        causes = {"link": "link", "left": "left", "dead": "silence"}
        return {n: causes.get(m.partition(":")[0], "silence") for n, m in zip(nodes, marks, strict=True) if m}

    def _declare_gone(self, round_: int, node_id: str, marker: str, store=None) -> bool:
        """Mark ``node_id`` as gone from ``round_`` (once) and wake the round's members."""
        store = store or self._store
        key = self._r(round_, "dead", node_id)
        won, current = self._claim(key, marker, store)
        if not won:
            if current is not None:
                return False
            # Whatever holds the key is not authentic (a forged marker): replace it.
            self._put(key, marker, store)
        self._append(self._r(round_, "gone_list"), node_id, store)
        store.add(self._r(round_, "gone"), 1)
        store.add(self._r(round_, "signal"), 1)
        return True

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
        self._start_heartbeat()
        self._check_job_ended()
        member_of = self._round
        if self._result is not None:
            node.prev_group_rank = self._result.group_rank
        round_ = self._open_round(member_of)
        while True:
            if time.monotonic() >= deadline:
                raise self._timeout_error(round_)
            idx = self._store.add(self._r(round_, "joined"), 1)
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

    def _prev_members(self, round_: int) -> _PrevRound | None:
        """The members of round ``round_ - 1`` (None: no completed previous round)."""
        if self._result is not None and self._result.round == round_ - 1 and isinstance(self._roster, FullRoster):
            return _PrevRound(self._roster.size, [m.node_id for m in self._roster.known()])  # this node's own copy
        if self._result is not None and self._result.round == round_ - 1:
            return _PrevRound(self._result.group_world_size, None, lambda: self._member_ids(round_ - 1))
        raw = None if round_ == 0 else self._read(self._r(round_ - 1, "result"))
        if raw is None:
            return None
        doc = decode_result(raw)
        if doc.get("abort"):
            return None
        if is_seated(doc):
            return _PrevRound(int(doc["size"]), None, lambda: self._member_ids(round_ - 1, doc))
        return _PrevRound(len(doc["members"]), [m["node_id"] for m in doc["members"]])

    def _member_ids(self, round_: int, doc: dict | None = None) -> list[str]:
        """Every member of closed round ``round_`` (reads a seated round's parts: O(n), for the few
        that need the whole list); empty when its result cannot be read."""
        if doc is None:
            raw = self._read(self._r(round_, "result"))
            doc = decode_result(raw) if raw is not None else None
        if doc is None:
            return []
        members = all_members(doc, lambda count: [self._read(k) for k in self._part_keys(round_, count)]
                              if count else [])
        return [m["node_id"] for m in members or []]

    def _part_keys(self, round_: int, count: int) -> list[str]:
        return [self._r(round_, "part", k) for k in range(count)]

    def _await_close(self, round_: int, idx: int, deadline: float) -> int:
        """Wait until round ``round_`` closes; the first joiner (and, as a fallback, the others) closes it.

        Returns the highest arrival index admitted to the round.
        """
        closed_key = self._r(round_, "closed")
        result_key = self._r(round_, "result")
        prev = self._prev_members(round_)
        slots = _Slots()
        closer = RingWatch(self.conf["heartbeat_timeout"])  # the first joiner's heartbeats (see below)
        min_reached: float | None = None
        closable_since: float | None = None
        poll = _CLOSER_POLL if idx == 1 else _follower_poll(idx)
        next_check = time.monotonic() if idx == 1 else time.monotonic() + poll
        # Whether ``closed`` is worth reading now: always for the first joiner; for the others once
        # their wait saw it and ``result`` (a wait that timed out costs no read, and keys already
        # there end the first wait at once: at thousands of joiners each store operation counts).
        # Waiting for both keys, not ``closed`` alone, wakes each follower once per round.
        look = idx == 1
        held = False  # ``closed`` exists but is not authentic (forged): poll instead of waiting
        report = self._wait_report()
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout_error(round_)
            report.tick(lambda: self._waiting_line(round_, prev, deadline))
            if look:
                raw = self._peek(closed_key)
                closed = None if raw is None else self._auth.open(closed_key, raw)
                if closed is not None:
                    # Read with ``_peek``, never ``multi_get``: that blocks for ``read_timeout`` on a key
                    # that is absent, and a ``wait`` for both keys was seen to return while ``result``
                    # was still absent (once in ~10 runs of a round whose closer died; cause unknown).
                    self._fetched = (result_key, None if idx == 1 or held else self._peek(result_key))
                    self._closer = closed.partition(":")[2]
                    return int(closed.split(":")[0])
                held = raw is not None
            if self._error is not None:
                raise self.store_lost_error(self._error)
            if now >= next_check:
                self._check_job_ended()
                joined = self._count(self._r(round_, "joined"))
                if joined >= self.min_nodes and min_reached is None:
                    min_reached = now
                accounted = 0
                if prev is not None:
                    accounted = (
                        self._count(self._r(round_, "rejoined"))
                        + self._count(self._r(round_ - 1, "gone"))
                        + self._count(self._r(round_ - 1, "done"))
                    )
                inputs = CloseInputs(
                    joined=joined,
                    min_nodes=self.min_nodes,
                    max_nodes=self.max_nodes,
                    prev_members=None if prev is None else prev.count,
                    prev_accounted=accounted,
                    since_min=None if min_reached is None else now - min_reached,
                    last_call=float(self.conf["last_call_timeout"]),
                )
                size = close_size(inputs)
                if idx != 1 and size is not None:
                    # A fallback: leave the close to the first joiner unless it has not done it in time.
                    # Later joiners wait longer, so that a slow first joiner is not joined by all at once.
                    closable_since = now if closable_since is None else closable_since
                    grace = _FALLBACK_GRACE * min(idx - 1, 8)
                    if now - closable_since < grace:
                        size = None
                    elif self._auth.enabled and self._closer_alive(round_, closer):
                        # With a token each fallback reads and checks every join (O(n) each): while
                        # the first joiner still heartbeats it is closing, only slowly (thousands of
                        # joins), and thousands of followers stepping in at once would bury it.  A
                        # first joiner that heartbeats but never closes is left to the earliest few.
                        stuck = grace + _STUCK_CLOSER_TIMEOUTS * float(self.conf["heartbeat_timeout"])
                        if idx > 1 + _RESCUERS or now - closable_since < stuck:
                            size = None
                admitted = None
                if size is not None and self._auth.enabled:
                    # The counters are hints anyone can bump: decide on authentic values only.
                    size, admitted = self._verified_close(round_, inputs, prev, slots)
                if size is not None:
                    last = size if admitted is None else admitted[-1][0]
                    won, value = self._claim(closed_key, f"{last}:{self._node.node_id}")
                    if won:
                        self._closer = self._node.node_id
                        self._put(self._k("current"), str(round_ + 1))
                        self._publish_result(round_, last, prev is not None, admitted)
                        return last
                    if value is not None:
                        self._closer = value.partition(":")[2]
                        return int(value.split(":")[0])
                next_check = now + poll
            if idx == 1 or held:
                time.sleep(_CLOSER_POLL)
                look = True
            else:
                look = self._wait([closed_key, result_key], max(0.0, min(next_check, deadline) - time.monotonic()))

    def _closer_alive(self, round_: int, watch: RingWatch) -> bool:
        """Whether the first joiner of ``round_`` (its closer) is authentic and still heartbeats.

        ``watch`` follows its ``hb`` key from one call to the next: silent for ``heartbeat_timeout``,
        or a slot 1 that is empty or forged, is not alive.  Two reads per call.
        """
        if watch.target is None:
            info = self._read(self._r(round_, "node", 1))
            if info is None:
                return False
            watch.retarget(NodeInfo.from_json(info).node_id)
        return not watch.observe(self._read(self._k("hb", watch.target)))

    def _verified_close(
        self, round_: int, hints: CloseInputs, prev: _PrevRound | None, slots: _Slots
    ) -> tuple[int | None, list[tuple[int, NodeInfo]] | None]:
        """With a job token: the close decision taken again on authentic joins, departures and finishes.

        Returns (size, the admitted (arrival index, info) pairs), or (None, None) to keep waiting.
        """
        infos = slots.read(self, round_, hints.joined)
        accounted = 0
        if prev is not None:
            prev_ids = set(prev.node_ids())
            present = {info.node_id for _, info in infos}
            gone = set(self._lines(self._r(round_ - 1, "gone_list")))
            done = set(self._lines(self._r(round_ - 1, "done_list")))
            accounted = len((present | gone | done) & prev_ids)
        size = close_size(dataclasses.replace(hints, joined=len(infos), prev_accounted=accounted))
        if not size:
            return None, None
        return size, infos[:size]

    def _failures(self, round_: int) -> list[FailureRecord]:
        node_ids = list(dict.fromkeys(self._lines(self._r(round_, "fail_list"))))
        if not node_ids:
            return []
        keys = [self._r(round_, "fail", n) for n in node_ids]
        values = [self._auth.open(k, v) for k, v in zip(keys, self._store.multi_get(keys), strict=True)]
        return [FailureRecord.from_json(v) for v in values if v is not None]

    def _publish_result(
        self, round_: int, size: int, has_prev: bool, admitted: list[tuple[int, NodeInfo]] | None = None
    ) -> None:
        if admitted is not None:
            nodes = [info for _, info in admitted]
        else:
            keys = [self._r(round_, "node", i) for i in range(1, size + 1)]
            # A joiner writes its info right after taking its slot; allow a moment for the last ones.
            if all_present(self._store, keys, _SLOT_WAIT):
                raw = list(zip(keys, self._store.multi_get(keys), strict=True))
            else:  # a joiner died between taking a slot and filling it: leave it out of the round
                raw = [(k, self._get(k)) for k in keys if self._exists(k)]
            nodes = [NodeInfo.from_json(v) for v in (self._auth.open(k, r) for k, r in raw) if v is not None]
        members = assign_ranks(nodes)
        used = self._count(self._k("restarts_used"))
        abort = None
        lost: list[str] = []
        abort_code = 1
        if has_prev:
            failures = self._failures(round_ - 1)
            lost = list(dict.fromkeys(self._lines(self._r(round_ - 1, "gone_list"))))
            streak_key = self._k("no_progress_streak")
            streak = int(self._read(streak_key) or 0)
            verdict = judge_round_end(self.run_id, failures, len(lost), used, streak, self.params.max_restarts,
                                      self.params.crash_loop_limit)
            if verdict.restarts_used > used:
                used = int(self._store.add(self._k("restarts_used"), verdict.restarts_used - used))
            self._put(streak_key, str(verdict.no_progress_streak))
            abort, abort_code = verdict.abort, verdict.abort_code
        causes = self._lost_causes(round_ - 1, lost)
        generation = int(self._store.add(self._k("generation"), 1)) - 1
        restarts_used = min(used, self.params.max_restarts) if abort is None else used
        extra: dict[str, Any] = {"lost_causes": causes}
        if abort is None and members and members[0].node_id == self._node.node_id:
            # This closer is group rank 0 (in round 0 the first joiner always is): it starts the
            # workers' store now and the result carries its address, so no member waits for
            # ``store`` on its own (at thousands of nodes, one wake-up and two operations each).
            try:
                self._worker_store = host_worker_store(members[0].addr)
            except Exception:  # publish without it: taking this node's place tries again, and fails there
                self._worker_store = None
            if self._worker_store is not None:
                extra["store"] = f"{members[0].addr}:{self._worker_store.port}"
                self._put(self._r(round_, "store"), extra["store"])
        doc = result_document(members, generation, restarts_used, self.params.max_restarts, abort, abort_code, lost,
                              **extra)
        if len(members) > FULL_LIST_MAX:
            # Each member reads its own seat, not the whole list (O(n) bytes per round, not O(n²)); the
            # seats and parts go first, so a member that sees the result finds its seat.
            doc, seats, parts = split_result(doc)
            keys = [self._r(round_, "seat", n) for n in seats] + self._part_keys(round_, len(parts))
            values = [*seats.values(), *parts]
            self._store.multi_set(keys, [self._auth.seal(k, v) for k, v in zip(keys, values, strict=True)])
        self._put(self._r(round_, "result"), encode_result(doc))
        if abort is not None:
            self._put(self._k("abort_code"), str(abort_code))
            self._put(self._k("abort"), abort)
        else:
            gone = [n for n in lost if causes.get(n) in ("link", "silence")]
            threading.Thread(target=self._prune, args=(round_ - KEEP_ROUNDS, gone), name="elastrun-prune",
                             daemon=True).start()

    def _prune(self, old: int, gone: list[str]) -> None:
        """Delete the keys of round ``old`` and the heartbeat keys of the nodes in ``gone`` (lost
        without leaving: their agent could not delete its own), so that the store holds a bounded
        number of keys however many rounds a job goes through.  Run by the closer on a thread of its
        own with a connection of its own, off the round's path; a failure only leaves keys behind."""
        try:
            store = self._second_connection()
            for node_id in gone:
                store.delete_key(self._k("hb", node_id))
            if old < 0:
                return
            raw = self._read(self._r(old, "result"), store)
            doc = decode_result(raw) if raw is not None else {}
            parts = int(doc.get("parts", 0)) if is_seated(doc) else 0
            members = all_members(doc, lambda count: [self._read(k, store) for k in self._part_keys(old, count)]) \
                if doc else []
            ids = [m["node_id"] for m in members or []]
            joined = self._count(self._r(old, "joined"), store)
            keys = [self._r(old, "node", i) for i in range(1, joined + 1)]
            keys += [self._r(old, kind, n) for n in ids for kind in ("dead", "fail", "seat")]
            keys += self._part_keys(old, parts)
            keys += [self._r(old, k) for k in _ROUND_KEYS]
            for key in keys:
                store.delete_key(key)
        except Exception:  # the store is going away (the job ends): nothing to keep bounded any more
            pass

    def _await_value(self, key: str, deadline: float, give_up: float | None = None) -> str | None:
        """Block until an authentic value is under ``key``; None once ``give_up`` (monotonic) passes."""
        while True:
            if self._wait(key, min(1.0, max(0.0, deadline - time.monotonic()))):
                value = self._read(key)
                if value is not None:
                    return value
                time.sleep(_CLOSER_POLL)  # a forged value holds the key: wait for the real one
            now = time.monotonic()
            if give_up is not None and now >= give_up:
                return None
            if now >= deadline:
                raise TimeoutError

    def _await_published(self, key: str, deadline: float) -> str | None:
        """The closed round's result under ``key``; None once its closer stopped heartbeating without
        writing it (it died between its close and its result: the round never formed, and waiting
        for it would last until ``join_timeout``).  A closer that still heartbeats is waited for."""
        closer = self._closer if self._closer != self._node.node_id else ""
        watch = RingWatch(float(self.conf["heartbeat_timeout"]))
        watch.retarget(closer or None)
        while True:
            value = self._await_value(key, deadline, time.monotonic() + 1.0)
            if value is not None:
                return value
            if closer and watch.observe(self._read(self._k("hb", closer))):
                return None

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
            return None  # its closer died before publishing it: the round never formed
        doc = decode_result(value)
        if doc.get("abort"):
            raise JobFailedError("the job was ended", doc["abort"], int(doc.get("abort_code", 1)))
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
            infos = [info for _, info in _Slots().read(self, round_ + 1, joined, wait=False)]
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
    def report_failure(self, failure: FailureRecord) -> None:
        if self._round is None:
            return
        failure.after_growth = self._read(self._r(self._round, "grown")) is not None
        self._put(self._r(self._round, "fail", failure.node_id), failure.to_json())
        self._append(self._r(self._round, "fail_list"), failure.node_id)

    @store_errors
    def leave(self, reason: str) -> None:
        if self._round is None or self._node is None:
            return
        self._declare_gone(self._round, self._node.node_id, f"left:{reason}")

    @store_errors
    def finish(self, timeout: float) -> bool:
        if self._round is None or self._result is None or self._node is None:
            return True
        round_ = self._round
        # Mark this node out of the round as finished, not lost: its watcher then skips it (to watch
        # the next successor) once its heartbeats stop, and nobody restarts for it.  Not a loss, so
        # neither gone_list nor signal.
        self._claim(self._r(round_, "dead", self._node.node_id), f"done:{self._node.node_id}")
        self._store.add(self._r(round_, "done"), 1)
        if self._auth.enabled:
            self._append(self._r(round_, "done_list"), self._node.node_id)
        deadline = time.monotonic() + timeout
        members = self._result.group_world_size
        while True:
            done = self._count(self._r(round_, "done")) + self._count(self._r(round_, "gone"))
            if done >= members and self._auth.enabled:
                # Only members of the round write its authentic ``done_list`` and ``gone_list`` lines
                # (about themselves or a ring successor): count the distinct nodes they name.
                out = set(self._lines(self._r(round_, "done_list"))) | set(self._lines(self._r(round_, "gone_list")))
                done = len(out)
            if done >= members:
                self._put(self._k("finished"), "1")
                return True
            if self._read(self._r(round_ + 1, "closed")) is not None or self._read(self._k("abort")) is not None:
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.close()  # "bye" to this node's watcher: leaving is not dying
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat.join(timeout=2.0)
        self._worker_store = None
        self._wakeup.close()
        try:
            if self._node is not None:
                self._store.delete_key(self._k("hb", self._node.node_id))
            if self._registered:
                self._store.add(self._k("agents"), -1)
            if self._server is not None:
                self._linger_for_others()
        except Exception:
            pass
        self._server = None
        self._store = None
        self._hb_store = None

    def _linger_for_others(self) -> None:
        """The job's state lives in this process: stay until the other live agents are done with it.

        An agent that exits deletes its heartbeat key; one that was killed leaves a key that stops
        changing.  Wait (at most ``host_linger`` s) until every other member's key is gone or silent.
        """
        deadline = time.monotonic() + float(self.conf["host_linger"])
        ring = self._roster.known() if isinstance(self._roster, FullRoster) else []
        ids = [m.node_id for m in ring] if ring or self._round is None else self._member_ids(self._round)
        others = [n for n in ids if self._node is None or n != self._node.node_id]
        watches = {n: RingWatch(self.conf["heartbeat_timeout"]) for n in others}
        while time.monotonic() < deadline and self._count(self._k("agents")) > 0:
            pending = False
            for node_id, watch in watches.items():
                beat = self._read(self._k("hb", node_id))
                if beat is not None and not watch.observe(beat):
                    pending = True
            if not pending:
                return
            time.sleep(0.1)


class _PrevRound:
    """The members of the round before the one being joined: their count, and their ids, read
    only when a close with a job token needs them (``load``: a seated round's parts)."""

    def __init__(self, count: int, ids: list[str] | None, load=None) -> None:
        self.count = count
        self._ids = ids
        self._load = load

    def node_ids(self) -> list[str]:
        if self._ids is None:
            self._ids = self._load() if self._load is not None else []
        return self._ids


class _Slots:
    """The authentic joins of one round, read as its ``joined`` counter grows (token only)."""

    def __init__(self) -> None:
        self._infos: dict[int, NodeInfo | None] = {}

    def read(
        self, handler: StoreRendezvousHandler, round_: int, joined: int, wait: bool = True
    ) -> list[tuple[int, NodeInfo]]:
        """(arrival index, info) of slots 1..``joined`` whose info is authentic, in arrival order.

        A slot taken but not yet filled is a joiner between its two writes.  With ``wait`` the
        slots not read yet are awaited together with one ``wait`` of up to ``_SLOT_WAIT`` s and
        then read with one ``multi_get``; a slot still empty after that is left out, as a forged
        or dead join is (then, once, each slot is read on its own).  Without ``wait`` an empty
        slot is only skipped.
        """
        unread = [idx for idx in range(1, joined + 1) if idx not in self._infos]
        keys = [handler._r(round_, "node", idx) for idx in unread]
        if keys and all_present(handler._store, keys, _SLOT_WAIT if wait else 0.0):
            for idx, key, raw in zip(unread, keys, handler._store.multi_get(keys), strict=True):
                self._accept(handler, idx, key, raw)
            unread, keys = [], []
        for idx, key in zip(unread, keys, strict=True):  # each slot on its own: only when some stayed empty
            raw = handler._peek(key)
            if raw is not None:
                self._accept(handler, idx, key, raw)
            elif wait:
                self._infos[idx] = None
        return [(idx, info) for idx, info in sorted(self._infos.items()) if info is not None and idx <= joined]

    def _accept(self, handler: StoreRendezvousHandler, idx: int, key: str, raw: bytes) -> None:
        value = handler._auth.open(key, raw)
        self._infos[idx] = NodeInfo.from_json(value) if value is not None else None


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


#: ``--rdzv-backend=c10d``: checks, handler and status reader (:mod:`elastrun.rendezvous.store_status`).
BACKEND = FunctionBackend(validate_params, create_handler, read_job_status)
