"""The close of a round in the store backends: slots, the close decision, the result and its pruning.

A joiner takes its arrival slot (``r<R>/joined``, ``r<R>/node/<idx>``) and waits in
:meth:`Closing._await_close` for the round to close.  The first joiner closes it, as soon as
:func:`elastrun.rendezvous.rounds.close_size` allows (the others step in only when it does not:
it died, or it is stuck; see the grace constants below).  The closer claims ``closed``, moves
``current`` on, judges the previous round's end (:func:`~elastrun.rendezvous.rounds.judge_round_end`:
what it charged, whether the job goes on), starts the workers' store when it is group rank 0, and
publishes ``result`` (with seats and parts in a round of more than :data:`FULL_LIST_MAX` members,
:mod:`elastrun.rendezvous.c10d.seats`); then it deletes the keys of the round :data:`KEEP_ROUNDS` back,
on a thread of its own.  With a job token the counters are hints only: the close is decided again
on authentic joins (:class:`JoinSlots`).

:class:`Closing` is a part of :class:`~elastrun.rendezvous.c10d.StoreRendezvousHandler`: the handler
owns the state it reads (``params``, ``conf``, ``min_nodes``, ``max_nodes``, ``_node``, ``_result``,
``_roster``, ``_error``, ``_fetched``, ``_closer``, ``_worker_store``) and the join's helpers it calls
(``_check_job_ended``, ``_timeout_error``, and ``_lost_causes`` and ``_start_heartbeat`` of
:class:`~elastrun.rendezvous.c10d.liveness.Liveness`).  The keys are listed in
docs/rendezvous-protocol.md.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from elastrun.rendezvous.api import FailureRecord, NodeInfo
from elastrun.rendezvous.c10d.client import StoreClient, all_present
from elastrun.rendezvous.c10d.seats import FULL_LIST_MAX, FullRoster, all_members, is_seated, split_result
from elastrun.rendezvous.endpoint import host_worker_store
from elastrun.rendezvous.keepalive import RingWatch
from elastrun.rendezvous.outcome import RoundEnd, decide
from elastrun.rendezvous.rounds import (
    CloseInputs,
    assign_ranks,
    close_size,
    decode_result,
    encode_result,
    is_void,
)
from elastrun.rendezvous.waiting import NAMED, waiting_line

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
               "grown", "done", "done_list", "hang")


class Closing(StoreClient):
    """The wait for a round's close, the close itself, and the keys of old rounds (see the module docstring)."""

    def _waiting_line(self, round_: int, prev: PrevRound | None, deadline: float) -> str:
        """The line of this node waiting for ``round_`` to close: the joins so far and the first joiners' hosts."""
        joined = self._count(self._r(round_, "joined"))
        hosts = []
        for idx in range(1, min(joined, NAMED) + 1):
            info = self._read(self._r(round_, "node", idx))
            if info is not None:
                hosts.append(NodeInfo.from_json(info).hostname or NodeInfo.from_json(info).node_id)
        why = "" if prev is None else f"the group of round {round_ - 1} to re-form (its members rejoin or are lost)"
        return waiting_line(round_, joined, self.min_nodes, self.max_nodes, hosts, deadline, why)


    def _prev_members(self, round_: int) -> PrevRound | None:
        """The members of round ``round_ - 1`` (None: no completed previous round)."""
        if self._result is not None and self._result.round == round_ - 1 and isinstance(self._roster, FullRoster):
            return PrevRound(self._roster.size, [m.node_id for m in self._roster.known()])  # this node's own copy
        if self._result is not None and self._result.round == round_ - 1:
            return PrevRound(self._result.group_world_size, None, lambda: self._member_ids(round_ - 1))
        raw = None if round_ == 0 else self._read(self._r(round_ - 1, "result"))
        if raw is None:
            return None
        doc = decode_result(raw)
        if doc.get("abort") or is_void(doc):
            return None
        if is_seated(doc):
            return PrevRound(int(doc["size"]), None, lambda: self._member_ids(round_ - 1, doc))
        return PrevRound(len(doc["members"]), [m["node_id"] for m in doc["members"]])

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
        wait = _CloseWait(round_, idx, self._prev_members(round_), RingWatch(self.conf["heartbeat_timeout"]))
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
            report.tick(lambda: self._waiting_line(round_, wait.prev, deadline))
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
                last = self._close_if_due(wait, now)
                if last is not None:
                    return last
                next_check = now + poll
            if idx == 1 or held:
                time.sleep(_CLOSER_POLL)
                look = True
            else:
                look = self._wait([closed_key, result_key], max(0.0, min(next_check, deadline) - time.monotonic()))

    def _close_if_due(self, wait: _CloseWait, now: float) -> int | None:
        """One check of the round's close by this joiner: close it when the rules (and, for a follower,
        the fallback's grace) allow.  The highest admitted arrival index once it is closed (by this
        joiner or by another that claimed ``closed`` first); None to keep waiting."""
        round_ = wait.round
        inputs = self._close_inputs(wait, now)
        size = close_size(inputs)
        if wait.idx != 1 and size is not None and not self._fallback_due(wait, now):
            size = None
        admitted = None
        if size is not None and self._auth.enabled:
            # The counters are hints anyone can bump: decide on authentic values only.
            size, admitted = self._verified_close(round_, inputs, wait.prev, wait.slots)
        if size is None:
            return None
        self._start_heartbeat()  # a closer's followers watch its heartbeats until its result
        last = size if admitted is None else admitted[-1][0]
        won, value = self._claim(self._r(round_, "closed"), f"{last}:{self._node.node_id}")
        if won:
            self._closer = self._node.node_id
            self._put(self._k("current"), str(round_ + 1))
            self._publish_result(round_, last, wait.prev is not None, admitted)
            return last
        if value is not None:
            self._closer = value.partition(":")[2]
            return int(value.split(":")[0])
        return None

    def _close_inputs(self, wait: _CloseWait, now: float) -> CloseInputs:
        """The counters of the round's close decision (:func:`elastrun.rendezvous.rounds.close_size`)."""
        round_, prev = wait.round, wait.prev
        # The previous members accounted for are read before ``joined``: a rejoiner takes its
        # ``joined`` slot before it counts itself ``rejoined``, so every rejoiner counted here is
        # in the count read next.  Read the other way round, a member rejoining between the two
        # reads was counted as accounted for but not admitted: the round closed without that
        # live member, and the next change came at once (a round of the others, then one more).
        accounted = 0
        if prev is not None:
            accounted = (
                self._count(self._r(round_, "rejoined"))
                + self._count(self._r(round_ - 1, "gone"))
                + self._count(self._r(round_ - 1, "done"))
            )
        joined = self._count(self._r(round_, "joined"))
        if joined >= self.min_nodes and wait.min_reached is None:
            wait.min_reached = now
        return CloseInputs(
            joined=joined,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            prev_members=None if prev is None else prev.count,
            prev_accounted=accounted,
            since_min=None if wait.min_reached is None else now - wait.min_reached,
            last_call=float(self.conf["last_call_timeout"]),
        )

    def _fallback_due(self, wait: _CloseWait, now: float) -> bool:
        """For a joiner other than the first, of a round the rules allow to close: whether it closes it.

        It leaves the close to the first joiner unless that one has not done it in time; later
        joiners wait longer, so that a slow first joiner is not joined by all at once.
        """
        wait.closable_since = now if wait.closable_since is None else wait.closable_since
        grace = _FALLBACK_GRACE * min(wait.idx - 1, 8)
        if now - wait.closable_since < grace:
            return False
        if self._auth.enabled and self._closer_alive(wait.round, wait.closer):
            # With a token each fallback reads and checks every join (O(n) each): while
            # the first joiner still heartbeats it is closing, only slowly (thousands of
            # joins), and thousands of followers stepping in at once would bury it.  A
            # first joiner that heartbeats but never closes is left to the earliest few.
            stuck = grace + _STUCK_CLOSER_TIMEOUTS * float(self.conf["heartbeat_timeout"])
            if wait.idx > 1 + _RESCUERS or now - wait.closable_since < stuck:
                return False
        return True

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
        self, round_: int, hints: CloseInputs, prev: PrevRound | None, slots: JoinSlots
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
        """As the closer of ``round_``: read its facts, apply :func:`elastrun.rendezvous.outcome.decide`,
        and write the result (with its seats and parts in a large round) and the job's budget."""
        nodes = [info for _, info in admitted] if admitted is not None else self._joined_infos(round_, size)
        used = self._count(self._k("restarts_used"))
        streak_key = self._k("no_progress_streak")
        ended, streak = None, 0
        if has_prev:
            lost = list(dict.fromkeys(self._lines(self._r(round_ - 1, "gone_list"))))
            ended = RoundEnd(self._failures(round_ - 1), lost, self._lost_causes(round_ - 1, lost), len(lost))
            streak = int(self._read(streak_key) or 0)
        generation = int(self._store.add(self._k("generation"), 1)) - 1
        outcome = decide(self.run_id, assign_ranks(nodes), generation, used, streak, ended, self.params.max_restarts,
                         self.params.crash_loop_limit)
        if has_prev:
            if outcome.restarts_used > used:
                self._store.add(self._k("restarts_used"), outcome.restarts_used - used)
            self._put(streak_key, str(outcome.no_progress_streak))
        doc = outcome.document
        if outcome.abort is None:
            self._start_store_for(round_, outcome.members, doc)
        if not self._write_result(round_, doc):
            return
        if outcome.abort is not None:
            self._put(self._k("abort_code"), str(outcome.abort_code))
            self._put(self._k("abort"), outcome.abort)
        else:
            gone = [n for n in doc["lost"] if doc["lost_causes"].get(n) in ("link", "silence")]
            threading.Thread(target=self._prune, args=(round_ - KEEP_ROUNDS, gone), name="elastrun-prune",
                             daemon=True).start()

    def _joined_infos(self, round_: int, size: int) -> list[NodeInfo]:
        """The infos of joiners 1..``size`` of ``round_`` (without a token: every slot is taken as it is)."""
        keys = [self._r(round_, "node", i) for i in range(1, size + 1)]
        # A joiner writes its info right after taking its slot; allow a moment for the last ones.
        if all_present(self._store, keys, _SLOT_WAIT):
            raw = list(zip(keys, self._store.multi_get(keys), strict=True))
        else:  # a joiner died between taking a slot and filling it: leave it out of the round
            raw = [(k, self._get(k)) for k in keys if self._exists(k)]
        return [NodeInfo.from_json(v) for v in (self._auth.open(k, r) for k, r in raw) if v is not None]

    def _start_store_for(self, round_: int, members: list, doc: dict[str, Any]) -> None:
        """When this closer is group rank 0 (in round 0 the first joiner always is): start the workers'
        store now and put its address in ``doc``, so no member waits for ``store`` on its own (at
        thousands of nodes, one wake-up and two operations each)."""
        if not members or members[0].node_id != self._node.node_id:
            return
        try:
            self._worker_store = host_worker_store(members[0].addr)
        except Exception:  # publish without it: taking this node's place tries again, and fails there
            self._worker_store = None
        if self._worker_store is not None:
            doc["store"] = f"{members[0].addr}:{self._worker_store.port}"
            self._put(self._r(round_, "store"), doc["store"])

    def _write_result(self, round_: int, doc: dict[str, Any]) -> bool:
        """Write ``doc`` as ``round_``'s result (seats and parts first in a round of more than
        :data:`FULL_LIST_MAX` members); False when a follower wrote the round void first."""
        if len(doc["members"]) > FULL_LIST_MAX:
            # Each member reads its own seat, not the whole list (O(n) bytes per round, not O(n²)); the
            # seats and parts go first, so a member that sees the result finds its seat.
            doc, seats, parts = split_result(doc)
            keys = [self._r(round_, "seat", n) for n in seats] + self._part_keys(round_, len(parts))
            values = [*seats.values(), *parts]
            self._store.multi_set(keys, [self._auth.seal(k, v) for k, v in zip(keys, values, strict=True)])
        result_key, text = self._r(round_, "result"), encode_result(doc)
        published, current = self._claim(result_key, text)
        if not published and current is None:  # a value that is not authentic holds the key: replace it
            self._put(result_key, text)
            published = True
        # Not published: a follower judged this closer silent (its heartbeats stood still: a loaded
        # host) and wrote the round void first (handler.py, ``_await_published``): every joiner, this
        # one included, reads the void and joins the next round.
        return published

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



@dataclasses.dataclass
class _CloseWait:
    """One joiner's wait for a round's close (:meth:`Closing._await_close`): what it knows, and the
    times its fallback counts from."""

    round: int
    idx: int
    prev: PrevRound | None
    #: The first joiner's heartbeats (a follower's fallback with a token asks whether it still closes).
    closer: RingWatch
    slots: JoinSlots = dataclasses.field(default_factory=lambda: JoinSlots())
    min_reached: float | None = None
    closable_since: float | None = None


class PrevRound:
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


class JoinSlots:
    """The authentic joins of one round, read as its ``joined`` counter grows (token only)."""

    def __init__(self) -> None:
        self._infos: dict[int, NodeInfo | None] = {}

    def read(
        self, handler: StoreClient, round_: int, joined: int, wait: bool = True
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

    def _accept(self, handler: StoreClient, idx: int, key: str, raw: bytes) -> None:
        value = handler._auth.open(key, raw)
        self._infos[idx] = NodeInfo.from_json(value) if value is not None else None
