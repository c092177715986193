"""The closer of a round: when it may close, and the one transaction that closes it.

The earliest live joiner applies :mod:`elastrun.rendezvous.rounds` (close size, ranks, what is
charged) to the authentic joins and the previous round's keys, and publishes ``r<R>/result`` and
``current`` in a transaction that succeeds only if no result exists yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from elastrun.rendezvous.api import FailureRecord, NodeInfo
from elastrun.rendezvous.etcd.base import HandlerBase
from elastrun.rendezvous.etcd.client import cmp_absent, cmp_mod, op_delete_prefix, op_put, prefix_end
from elastrun.rendezvous.outcome import Outcome, RoundEnd, decide
from elastrun.rendezvous.rounds import CloseInputs, assign_ranks, close_size, decode_result, encode_result


@dataclass
class _Previous:
    """What a closer read of the round before the one it closes (:meth:`Closing._previous_round`)."""

    doc: dict[str, Any]
    members: int
    accounted: int
    ended: RoundEnd


class Closing(HandlerBase):
    """The closer's part: apply the round rules to the joiners and publish the result."""

    def _may_close(self, round_: int, joined: int, min_reached: float | None) -> bool:
        """False where the rules cannot close the round yet whoever joined (spares the closer a read
        of every join at each arrival); :meth:`_try_close` decides the rest."""
        if joined < self.min_nodes:
            return False
        if joined >= self.max_nodes or round_ > 0:
            return True
        return min_reached is not None and time.monotonic() - min_reached >= float(self.conf["last_call_timeout"])


    def _try_close(self, round_: int, min_reached: float | None, deadline: float) -> bool:
        """As the closer: apply the rules to the joiners and publish the result if the round may close."""
        join_prefix = self._r(round_, "join/")
        joiners, _ = self._retry(lambda: self._kv.range(join_prefix, prefix_end(join_prefix), by_create=True),
                                 deadline, "read joins")
        joiners = self._authentic(joiners)
        prev = self._previous_round(round_, {kv.key[len(join_prefix):] for kv in joiners}, deadline)
        now = time.monotonic()
        size = close_size(CloseInputs(
            joined=len(joiners), min_nodes=self.min_nodes, max_nodes=self.max_nodes,
            prev_members=prev.members if prev is not None else None,
            prev_accounted=prev.accounted if prev is not None else 0,
            since_min=None if min_reached is None else now - min_reached,
            last_call=float(self.conf["last_call_timeout"]),
        ))
        if size is None:
            return False
        members = assign_ranks([NodeInfo.from_json(kv.value) for kv in joiners[:size]])
        generation, used, streak, ended = 0, 0, 0, None  # a job's first round
        if prev is not None:
            fail_prefix = self._r(round_ - 1, "fail/")
            kvs, _ = self._retry(lambda: self._kv.range(fail_prefix, prefix_end(fail_prefix)), deadline, "read")
            prev.ended.failures = [FailureRecord.from_json(kv.value) for kv in self._authentic(kvs)]
            generation, used, streak, ended = (int(prev.doc["generation"]) + 1, int(prev.doc.get("restarts_used", 0)),
                                               int(prev.doc.get("no_progress_streak", 0)), prev.ended)
        outcome = decide(self.run_id, members, generation, used, streak, ended, self.params.max_restarts,
                         self.params.crash_loop_limit)
        return self._write_close(round_, outcome, deadline)

    def _previous_round(self, round_: int, joined: set[str], deadline: float) -> _Previous | None:
        """Round ``round_ - 1`` as the closer of ``round_`` needs it: its result, its members accounted
        for (rejoined in ``joined``, departed or finished), and how it ended (the failures are read
        only once the round may close).  None: no round before, or it has no result."""
        if round_ == 0:
            return None
        found = self._open(self._retry(lambda: self._kv.get(self._r(round_ - 1, "result")), deadline,
                                       "read the round"))
        if found is None:
            return None
        doc = decode_result(found)
        prev_members = [m["node_id"] for m in doc["members"]]
        old = self._r(round_ - 1, "")
        kvs, _ = self._retry(lambda: self._kv.range(old, prefix_end(old), keys_only=not self._auth.enabled),
                             deadline, "read")
        kvs = self._authentic(kvs)
        still = {kv.key[len(old) + 5:] for kv in kvs if kv.key.startswith(old + "join/")}
        done = {kv.key[len(old) + 5:] for kv in kvs if kv.key.startswith(old + "done/")}
        marked, _ = self._retry(lambda: self._kv.range(old + "l", prefix_end(old + "l")), deadline, "read")
        marks = self._causes_of(self._authentic(marked), old)
        gone = [m for m in prev_members if m not in still]
        lost = [m for m in gone if m not in done]
        accounted = sum(1 for m in prev_members if m in joined or m not in still or m in done)
        ended = RoundEnd([], lost, {n: marks.get(n, "silence") for n in lost}, len(gone))
        return _Previous(doc, len(prev_members), accounted, ended)

    def _write_close(self, round_: int, outcome: Outcome, deadline: float) -> bool:
        """Publish ``outcome`` as ``round_``'s result (and ``current``, and the job's end if it is one) in
        one transaction that holds only while no result exists; delete the keys of round ``round_ - 2``."""

        def put(key: str, value: str) -> dict[str, Any]:
            return op_put(key, self._seal(key, value), self._job_lease)

        result_key = self._r(round_, "result")
        ops = [put(result_key, encode_result(outcome.document)), put(self._q + "current", str(round_ + 1))]
        if round_ >= 2:
            ops.append(op_delete_prefix(self._r(round_ - 2, "")))
        if outcome.abort is not None:
            ops.append(put(self._q + "abort_code", str(outcome.abort_code)))
            ops.append(put(self._q + "abort", outcome.abort))
        guard = cmp_absent(result_key)
        if self._auth.enabled:
            # A forged result in the way is replaced (if it is still the same forged value).
            squatter = self._retry(lambda: self._kv.get(result_key), deadline, "read the round")
            if squatter is not None and self._open(squatter) is None:
                guard = cmp_mod(result_key, squatter.mod_revision)
        return self._retry(lambda: self._kv.txn([guard], ops), deadline, "close")
