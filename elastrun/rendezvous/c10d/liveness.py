"""Liveness in the store backends: this node's heartbeats, and its watch over its ring successor.

Each agent writes ``hb/<node>`` every ``heartbeat_interval`` from a thread of its own (on a second
connection to the store), from the moment it is in a round's hands (slot 1, a close, or its round
closed with it admitted: a fresh joiner still waiting is watched by nobody), and on the same beat
reads the ``hb`` key of its ring successor in the
current round: a successor silent for ``heartbeat_timeout``, or whose process the liveness link
(:mod:`elastrun.rendezvous.link`) found gone, is declared gone from the round (``r<R>/dead/<node>``,
``gone_list``, ``gone``, ``signal``), which wakes every member's :meth:`poll`.  A member marked dead
is skipped and the next successor watched, so a run of lost nodes is found one beat after another.

:class:`Liveness` is a part of :class:`~elastrun.rendezvous.c10d.StoreRendezvousHandler`, which owns
its state (``_node``, ``_round``, ``_roster``, ``_lock``, ``_heartbeat``, ``_hb_store``, ``_watch``,
``_link``, ``_link_lost``, ``_wakeup``, ``_error``; see its ``__init__``).  The keys are listed in
docs/rendezvous-protocol.md.
"""

from __future__ import annotations

import time

from elastrun.rendezvous.api import Member, NodeInfo
from elastrun.rendezvous.c10d.client import StoreClient
from elastrun.rendezvous.c10d.seats import Roster
from elastrun.rendezvous.keepalive import Heartbeat
from elastrun.rendezvous.link import listen_for_watchers


class Liveness(StoreClient):
    """Heartbeats, the ring watch and the liveness link of one store-backend handler."""

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
        """Reads a member's seat of ``round_`` (seated: :mod:`elastrun.rendezvous.c10d.seats`) over ``store``."""
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

