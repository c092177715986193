"""Joining a round and waiting for its close.

A node puts ``r<R>/join/<node>`` (arrival order = create revision) and reads the round's state in
the same request; the earliest live joiner is the closer (:mod:`.closing`).  Everyone else waits
for ``r<R>/result`` on a watch, re-reading the round every ``_RECHECK`` s in case the closer died,
then finds (or, as group rank 0, hosts) the workers' store.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from elastrun.rendezvous.api import (
    JobFailedError,
    JobFinishedError,
    Member,
    NodeInfo,
    RendezvousError,
    RoundCause,
    RoundResult,
)
from elastrun.rendezvous.endpoint import host_worker_store
from elastrun.rendezvous.etcd.base import HandlerBase, Reregister, first_kv, one_key_end
from elastrun.rendezvous.etcd.client import KV, cmp_absent, op_put, op_range, prefix_end
from elastrun.rendezvous.rounds import decode_result, join_interrupts, member_view
from elastrun.rendezvous.waiting import NAMED, WaitReport, waiting_line

#: A waiting node re-reads the state at least this often even without a watch event (safety net).
_RECHECK = 2.0


@dataclasses.dataclass
class _Look:
    """One read of a round's state (one request): its result, its earliest join (as a one-element
    list), how many joined, whether this node's join key is there, and the store's revision then."""

    result: KV | None
    first: list[KV]
    joined: int
    mine: bool
    revision: int


class Joining(HandlerBase):
    """Joining rounds, waiting for their close and taking this node's place in the result."""

    def _join_rounds(self, node: NodeInfo, deadline: float) -> RoundResult:
        assert self._watch is not None
        state, self._job_state = self._job_state, None
        if state is None:
            state = self._retry(lambda: self._kv.read_many(self._job_state_ops(self._q)), deadline,
                                "read the job state")
        abort, finished, current_kv = (first_kv(read) for read in state)
        self._check_job_ended(abort, finished)
        old_round = self._round
        current = self._open(current_kv)
        # Missing or forged: the round after this node's last one (or 0); closed rounds are walked past.
        round_ = int(current) if current else (0 if old_round is None else old_round + 1)
        interrupted, result = self._joining, None
        if interrupted is not None and interrupted == round_ - 1:
            result = self._reattach(node, interrupted, deadline)
            round_ = interrupted if result is not None else round_
        while result is None:
            self._joining = round_
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
        self._joining = None
        if old_round is not None and old_round != round_:
            try:
                self._kv.delete(self._r(old_round, "join", node.node_id))
            except RendezvousError:
                pass
        return result


    def join_interrupts(self) -> bool:
        if self._result is not None:
            return False
        try:  # two requests, no retry: where etcd does not answer, the join says so with its own retries
            (epoch_read, (_, live)) = self._kv.read_many([op_range(self._p + "epoch"), self._agents_op()])
            epoch = first_kv(epoch_read)
            if epoch is None or live == 0:
                return False
            doc = json.loads(epoch.value)
            self._accept(doc)  # the incarnation's sealer (registration checks it again)
            q = f"{self._p}e/{doc['id']}/"
            abort, finished, current = (first_kv(read) for read in self._kv.read_many(self._job_state_ops(q)))
            open_round = int(self._open(current) or 0)
            if self._open(abort) is not None or self._open(finished) is not None or open_round <= 0:
                return False
            joins, running = self._kv.read_many([
                op_range(f"{q}r{open_round}/join/", prefix_end(f"{q}r{open_round}/join/"), count_only=True),
                op_range(f"{q}r{open_round - 1}/result")])
            found = self._open(first_kv(running))
            return join_interrupts(open_round, joins[1], decode_result(found) if found else None, self.max_nodes)
        except (RendezvousError, ValueError, KeyError):
            return False

    def _reattach(self, node: NodeInfo, round_: int, deadline: float) -> RoundResult | None:
        """Take this node's place in ``round_``, which closed while the node was joining it and its
        lease expired (the join key went with the lease): put the key back under the new lease,
        unless a member already declared the node lost.  Otherwise one late renewal would send the
        node to the next round and every member with it.  None: not a member; join the open round.
        """
        join_key, lost_key = self._r(round_, "join", node.node_id), self._r(round_, "lost", node.node_id)
        self._watch_round(round_)
        cursor = self._watch.seq
        put = op_put(join_key, self._seal(join_key, node.to_json()), self._lease)
        ok, reads = self._retry(lambda: self._kv.txn_reads([cmp_absent(lost_key)],
                                                           [put, op_range(self._r(round_, "result"))]),
                                deadline, "rejoin the round")
        if not ok:
            return None
        found = self._open(first_kv(reads[1])) if reads[1] else None
        doc = self._closed_round(round_, found) if found is not None else None
        if doc is None or not any(m["node_id"] == node.node_id for m in doc["members"]):
            self._retry(lambda: self._kv.delete(join_key), deadline, "move on")
            return None
        return self._round_result(round_, doc, cursor, deadline)

    def _watch_round(self, round_: int) -> None:
        """Watch what a node of ``round_`` acts on: its close (``result``, ``store``) and the markers
        that ask its members to act (``left/``, ``lost/``, ``next/``), not the joins themselves."""
        assert self._watch is not None
        self._watch.watch("round", self._r(round_, "left/"), one_key_end(self._r(round_, "store")),
                          self._kv.revision + 1)


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


    def _await_close(self, round_: int, cursor: int, deadline: float, seen: _Look) -> dict:
        """Wait for round ``round_``'s result; the earliest live joiner closes it when the rules allow.

        ``seen`` is the state read with this node's join.  The result normally arrives as a watch
        event, whose value is used as it is; the state is read again (one request) when the closer
        sees a join, when a join key vanishes, and every ``_RECHECK`` s in case the closer died.
        """
        assert self._watch is not None and self._node is not None
        me = self._node.node_id
        join_prefix = self._r(round_, "join/")
        min_reached: float | None = None
        joined = 0
        look = False  # re-read the state now
        closer = False
        next_recheck = 0.0
        report = WaitReport(self.say_waiting, float(self.conf["wait_report_interval"]))
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout_error(round_, joined)
            self._check_lease()
            report.tick(lambda: self._waiting_line(round_, deadline))
            if look or now >= next_recheck:
                next_recheck = now + _RECHECK
                if seen is None:
                    seen = self._retry(lambda: self._look(round_), deadline, "read the round")
                found = self._open(seen.result)
                if found is not None:
                    return self._closed_round(round_, found)
                first, joined, mine, since = seen.first, seen.joined, seen.mine, seen.revision + 1
                seen = None
                if not mine:
                    raise Reregister()  # our join key vanished (lease expired)
                closer = bool(first) and first[0].key == join_prefix + me
                self._watch_as_closer(round_, closer, since)
                if closer:
                    if joined >= self.min_nodes and min_reached is None:
                        min_reached = now
                    if self._may_close(round_, joined, min_reached) and self._try_close(round_, min_reached, deadline):
                        continue
                look = False
            wait = min(next_recheck - time.monotonic(), report.due_in())
            if closer and min_reached is not None:
                wait = min(wait, max(0.01, min_reached + float(self.conf["last_call_timeout"]) - time.monotonic()))
                look = wait <= 0.01 or look
            self._watch.wait(cursor, max(0.0, min(wait, deadline - time.monotonic())))
            events = self._watch.since(cursor)
            cursor = self._watch.seq
            if events is None:
                look = True
                continue
            found, look = self._scan(events, round_, closer, look)
            if found is not None:
                return self._closed_round(round_, found)
            if closer and min_reached is not None and \
                    time.monotonic() >= min_reached + float(self.conf["last_call_timeout"]):
                look = True


    def _scan(self, events: list, round_: int, closer: bool, look: bool) -> tuple[str | None, bool]:
        """What the watch's ``events`` tell a node waiting for ``round_``: its authentic result (None: not
        yet; a forged one is ignored, reported once), and whether to read the round's state again."""
        result_key, join_prefix = self._r(round_, "result"), self._r(round_, "join/")
        prev_prefix = self._r(round_ - 1, "") if round_ > 0 else None
        for ev in events:
            if ev.key == result_key and ev.kind == "PUT":
                found = self._auth.open(ev.key, ev.value)
                if found is not None:
                    return found, look
            elif ev.key == self._q + "abort":
                look = True
            elif ev.key.startswith(join_prefix):
                look = look or closer or ev.kind == "DELETE"
            elif closer and prev_prefix and ev.key.startswith(prev_prefix):
                look = True
        return None, look

    def _waiting_line(self, round_: int, deadline: float) -> str | None:
        """The line of this node waiting for ``round_`` to close (one request: the first joins)."""
        join_prefix = self._r(round_, "join/")
        try:
            first, joined = self._kv.range(join_prefix, prefix_end(join_prefix), by_create=True, limit=NAMED)
        except RendezvousError:
            return None
        hosts = []
        for kv in self._authentic(first):
            try:
                info = NodeInfo.from_json(kv.value)
            except (ValueError, TypeError):
                continue
            hosts.append(info.hostname or info.node_id)
        why = "" if round_ == 0 else f"the group of round {round_ - 1} to re-form (its members rejoin or are lost)"
        return waiting_line(round_, joined, self.min_nodes, self.max_nodes, hosts, deadline, why)

    def _closed_round(self, round_: int, found: str) -> dict:
        """The result document of ``round_`` (authentic text ``found``); a job ended by it fails here."""
        self._watch_as_closer(round_, False, 0)
        doc = decode_result(found)
        if doc.get("abort"):
            raise JobFailedError("the job was ended", doc["abort"], int(doc.get("abort_code", 1)),
                                 RoundCause.from_dict(doc.get("cause")))
        return doc


    def _watch_as_closer(self, round_: int, closer: bool, since: int) -> None:
        """The closer alone watches the round's joins and the previous round's keys (to count who is
        accounted for); the other joiners re-check every ``_RECHECK`` s in case the closer dies.

        The watches start right after the read (``since``) that made this node the closer, not at the
        client's latest revision: a join's other requests (waking the running members) come between
        that read and this call, and the joins that landed meanwhile would be neither in that read nor
        on the watch.  The closer then waited for the re-check (2 s) with every node joined: one
        re-formation in an etcd soak's 24 lost nodes.
        """
        assert self._watch is not None
        if closer:
            join_prefix = self._r(round_, "join/")
            self._watch.watch("joins", join_prefix, prefix_end(join_prefix), since)
            if round_ > 0:
                prev = self._r(round_ - 1, "")
                self._watch.watch("prev", prev, prefix_end(prev), since)
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
        revision = self._kv.revision  # this read's (requests on this client are sequential and ordered)
        result, (first, joined), (mine, _) = reads[-3:]
        if first and self._auth.enabled and self._open(first[0]) is None:
            every, _ = self._kv.range(join_prefix, prefix_end(join_prefix), by_create=True)
            first = self._authentic(every)[:1]
        return _Look(first_kv(result), first, joined, bool(mine), revision)


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
        host_missing: float | None = None
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
                found = self._open(first_kv(store))
                if found is not None:
                    break
                if alive[0]:
                    host_missing = None
                elif host_missing is None:
                    host_missing = time.monotonic()
                elif time.monotonic() - host_missing > 2 * float(self.conf["lease_ttl"]):
                    # The store host died before publishing: go to the next round.  Not at once: its
                    # lease may only have expired under an overloaded etcd, and it then takes its
                    # place back (_reattach) and publishes within a few seconds.
                    return None
            if time.monotonic() >= deadline:
                raise self._timeout_error(round_, len(members))
            first_wait = False
            self._watch.wait(seen, min(1.0, max(0.0, deadline - time.monotonic())))
        store_addr, _, store_port = found.rpartition(":")
        result = member_view(round_, doc, members, me, store_addr, int(store_port))
        self._take_round(round_, result, members, cursor)
        return result

    def _take_round(self, round_: int, result: RoundResult, members: list[Member], cursor: int) -> None:
        """Make ``result`` this node's round: its members, its ring (whose successor this node watches
        from now on) and the watch position its polls start from."""
        assert self._node is not None
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
