"""How a round and an agent end: failures, leaving, the exit barrier, clean-up.

Workers' failures go to ``r<R>/fail/``, a departure to ``r<R>/left/``; ``finish`` waits until
every member is done (``r<R>/done/``) and writes ``finished``; ``close`` drops the agent's lease,
and the last agent out removes the job's keys.
"""

from __future__ import annotations

import time

from elastrun.rendezvous.api import FailureRecord, RendezvousError
from elastrun.rendezvous.etcd.base import HandlerBase
from elastrun.rendezvous.etcd.client import (
    EtcdUnavailable,
    LeaseNotFound,
    cmp_absent,
    cmp_mod,
    cmp_range_empty,
    op_delete,
    op_delete_prefix,
    op_put,
    op_range,
    prefix_end,
)
from elastrun.rendezvous.rounds import fault_line


class Ending(HandlerBase):
    """Failures, departures, the exit barrier and this agent's clean-up."""

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

    def claim_hang(self, failure: FailureRecord) -> str | None:
        """The round's first fault, in one transaction: a lost or departed node, another node's
        failure, or the first ``r<R>/hang`` claim, which it puts when there is none of these."""
        if self._round is None:
            return None
        base = self._r(self._round, "")
        key = base + "hang"
        kinds = ("lost/", "left/", "fail/")
        try:
            won, reads = self._kv.txn_reads(
                [cmp_absent(key), *(cmp_range_empty(base + kind) for kind in kinds)],
                [op_put(key, self._seal(key, failure.to_json()), self._job_lease)],
                [op_range(base + kind, prefix_end(base + kind)) for kind in kinds] + [op_range(key)])
        except (EtcdUnavailable, LeaseNotFound):
            return None  # etcd does not answer now: this agent reports its own hang, as before claims
        if won:
            return None
        lost, left, failed, hang = (self._authentic(read[0]) if read else [] for read in reads)
        for kv in lost + left:
            node_id = kv.key[len(base) + 5:]
            if node_id != failure.node_id:
                return f"the loss of node {node_id}"
        for kv in failed + hang:
            record = FailureRecord.from_json(kv.value)
            if record.node_id != failure.node_id:
                return fault_line(record)
        return None

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
