"""Finding lost members while the workers run.

Each member watches its ring successor's join key and holds a liveness link to it; the one that
sees it go writes ``r<R>/lost/<node>``, which every member watches.  ``poll`` turns the watch events
(loss, departure, joiners of the next round, abort) into a :class:`RoundChange`, and re-reads the
round when the watch may have missed events.
"""

from __future__ import annotations

import time

from elastrun.rendezvous.api import RendezvousConnectionError, RendezvousError, RoundChange
from elastrun.rendezvous.etcd.base import HandlerBase, one_key_end
from elastrun.rendezvous.etcd.client import (
    KV,
    EtcdClient,
    EtcdUnavailable,
    LeaseNotFound,
    cmp_absent,
    cmp_mod,
    op_delete,
    op_put,
    prefix_end,
)
from elastrun.rendezvous.link import ring_successor


class Liveness(HandlerBase):
    """The ring watch, the liveness link, and what ``poll`` reports while the workers run."""

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
                self._watch.watch("ring", key, one_key_end(key), self._kv.revision + 1)
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
