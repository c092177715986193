"""The end of a member's part in a store-backend round: its failures, a hang's claim, leaving, the exit
barrier, and closing the handler (the store's host lingers for the others).

:class:`Ending` is a part of :class:`~elastrun.rendezvous.c10d.StoreRendezvousHandler`, which owns its
state (``_node``, ``_round``, ``_result``, ``_roster``, ``_heartbeat``, ``_link``, ``_wakeup``,
``_server``, ``_registered``, ``_closed``; see its ``__init__``).  The keys are listed in
docs/rendezvous-protocol.md.
"""

from __future__ import annotations

import time

from elastrun.rendezvous.api import FailureRecord
from elastrun.rendezvous.c10d.client import StoreClient, store_errors
from elastrun.rendezvous.c10d.seats import FullRoster
from elastrun.rendezvous.keepalive import RingWatch
from elastrun.rendezvous.rounds import fault_line


class Ending(StoreClient):
    """Failures, hang claims, leaving, the exit barrier and the close of one store-backend handler."""

    @store_errors
    def report_failure(self, failure: FailureRecord) -> None:
        if self._round is None:
            return
        failure.after_growth = self._read(self._r(self._round, "grown")) is not None
        self._put(self._r(self._round, "fail", failure.node_id), failure.to_json())
        self._append(self._r(self._round, "fail_list"), failure.node_id)

    @store_errors
    def claim_hang(self, failure: FailureRecord) -> str | None:
        """The round's first fault (docs/rendezvous-protocol.md, "Hangs"): a lost or departed node, a
        failure recorded by another node, or the first ``r<R>/hang`` claim, which this call makes."""
        if self._round is None:
            return None
        round_ = self._round
        if self._count(self._r(round_, "gone")):
            gone = [n for n in self._lines(self._r(round_, "gone_list")) if n != failure.node_id]
            if gone:
                return f"the loss of node {gone[0]}"
        for node_id in dict.fromkeys(self._lines(self._r(round_, "fail_list"))):
            record = self._read(self._r(round_, "fail", node_id)) if node_id != failure.node_id else None
            if record is not None:
                return fault_line(FailureRecord.from_json(record))
        won, first = self._claim(self._r(round_, "hang"), failure.to_json())
        if won or first is None:  # None: a value that is not authentic holds the key
            return None
        claimed = FailureRecord.from_json(first)
        return None if claimed.node_id == failure.node_id else fault_line(claimed)

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
