"""A rendezvous backend over an in-memory store, for the conformance suite's cases in milliseconds.

It keeps no storage protocol of its own: a job is a dict under one lock and one condition, and a
round closes on the same two decisions the real backends apply, :func:`elastrun.rendezvous.rounds.close_size`
(close or wait) and :func:`elastrun.rendezvous.outcome.decide` (members, ranks, what the round before
cost, the result document).  So a case that fails here and passes on c10d and etcd (or the other way
round) points at a backend's storage or waiting, not at the rules.  Test code: not a backend users
can choose.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from elastrun.rendezvous.api import (
    FailureRecord,
    JobFailedError,
    JobFinishedError,
    Member,
    NodeInfo,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
    RoundChange,
    RoundResult,
)
from elastrun.rendezvous.auth import JobTokenRejected
from elastrun.rendezvous.outcome import RoundEnd, decide
from elastrun.rendezvous.rounds import CloseInputs, assign_ranks, close_size, join_interrupts, member_view

#: The fake workers' store address every member is given (nothing listens: no worker runs).
STORE = ("127.0.0.1", 1)


@dataclass
class _Round:
    joins: list[NodeInfo] = field(default_factory=list)
    min_reached: float | None = None
    members: list[Member] | None = None  # set when it closed
    doc: dict | None = None
    rejoined: set[str] = field(default_factory=set)
    gone: dict[str, str] = field(default_factory=dict)  # node id -> how ("left", "silence")
    done: set[str] = field(default_factory=set)
    failures: list[FailureRecord] = field(default_factory=list)


class MemoryJob:
    """One job's whole state; its handlers share it (one per node, on threads of this process)."""

    def __init__(self, params: RendezvousParameters, token: bytes | None) -> None:
        self.params, self.token = params, token
        self.cond = threading.Condition()
        self.rounds: dict[int, _Round] = {0: _Round()}
        self.open = 0
        self.generation = 0
        self.restarts_used = 0
        self.streak = 0
        self.finished = False
        self.abort: tuple[str, int] | None = None

    def close_if_due(self, round_: int, now: float) -> None:
        """Under ``cond``: close ``round_`` when :func:`close_size` says so."""
        r, prev = self.rounds[round_], self.rounds.get(round_ - 1)
        prev_ok = prev is not None and prev.doc is not None and prev.members is not None
        if len(r.joins) >= self.params.min_nodes and r.min_reached is None:
            r.min_reached = now
        accounted = 0
        if prev_ok:
            accounted = sum(1 for m in prev.members if m.node_id in r.rejoined or m.node_id in prev.gone
                            or m.node_id in prev.done)
        size = close_size(CloseInputs(
            joined=len(r.joins), min_nodes=self.params.min_nodes, max_nodes=self.params.max_nodes,
            prev_members=len(prev.members) if prev_ok else None, prev_accounted=accounted,
            since_min=None if r.min_reached is None else now - r.min_reached,
            last_call=float(self.params.config.get("last_call_timeout", "0.2"))))
        if size is None:
            return
        ended = None
        if prev_ok:
            lost = [n for n in prev.gone if n not in prev.done]
            ended = RoundEnd(prev.failures, lost, dict(prev.gone), len(lost))
        outcome = decide(self.params.run_id, assign_ranks(r.joins[:size]), self.generation, self.restarts_used,
                         self.streak, ended, self.params.max_restarts, self.params.crash_loop_limit)
        self.generation += 1
        self.restarts_used, self.streak = outcome.restarts_used, outcome.no_progress_streak
        r.members, r.doc = outcome.members, outcome.document
        if outcome.abort is not None:
            self.abort = (outcome.abort, outcome.abort_code)
        self.open = round_ + 1
        self.rounds[self.open] = _Round(joins=r.joins[size:])  # the excluded joiners wait in the next round
        self.cond.notify_all()


class MemoryHandler(RendezvousHandler):
    """One node's handle on a :class:`MemoryJob`."""

    backend_name = "memory"

    def __init__(self, job: MemoryJob, token: bytes | None, join_timeout: float = 20.0) -> None:
        if token != job.token:
            raise JobTokenRejected("this node's job token does not match the job's")
        self.job, self.join_timeout = job, join_timeout
        self.round: int | None = None
        self.result: RoundResult | None = None
        self.node: NodeInfo | None = None

    def next_round(self, node: NodeInfo) -> RoundResult:
        job, deadline = self.job, time.monotonic() + self.join_timeout
        with job.cond:
            if job.finished:
                raise JobFinishedError(f"job {job.params.run_id!r} has already finished")
            if self.result is not None:
                node.prev_group_rank = self.result.group_rank  # as the real handlers do: ranks are kept
            self.node, round_ = node, job.open
            r = job.rounds[round_]
            r.joins.append(node)
            if self.round is not None and self.round == round_ - 1 and node.node_id not in job.rounds[self.round].gone:
                r.rejoined.add(node.node_id)
            job.cond.notify_all()
            while True:
                if job.rounds[round_].members is None:
                    job.close_if_due(round_, time.monotonic())
                if job.abort is not None:
                    raise JobFailedError("the job was ended", job.abort[0], job.abort[1])
                closed = job.rounds[round_]
                if closed.members is not None:
                    me = next((m for m in closed.members if m.node_id == node.node_id), None)
                    if me is not None:
                        self.round = round_
                        self.result = member_view(round_, closed.doc, closed.members, me, *STORE)
                        return self.result
                    round_ = job.open  # left out of a full round: wait in the next one
                if time.monotonic() >= deadline:
                    raise RendezvousTimeoutError(f"round {round_} did not close within {self.join_timeout:g} s")
                job.cond.wait(0.05)

    def poll(self) -> RoundChange:
        job, change = self.job, RoundChange()
        with job.cond:
            if self.round is None:
                return change
            if job.abort is not None:
                change.aborted, change.abort_exit_code = job.abort
                return change
            r, nxt = job.rounds[self.round], job.rounds.get(self.round + 1, _Round())
            change.lost_nodes = [n for n in r.gone if n != self.node.node_id]
            change.lost_causes = {n: r.gone[n] for n in change.lost_nodes}
            change.new_round_requested = bool(nxt.rejoined)
            if len(r.members) < job.params.max_nodes:
                change.nodes_waiting = len([n for n in nxt.joins if n.node_id not in nxt.rejoined])
            return change

    def join_interrupts(self) -> bool:
        job = self.job
        with job.cond:
            if self.result is not None or job.finished or job.abort is not None:
                return False
            prev = job.rounds.get(job.open - 1)
            return join_interrupts(job.open, len(job.rounds[job.open].joins), prev.doc if prev else None,
                                   job.params.max_nodes)

    def report_failure(self, failure: FailureRecord) -> None:
        with self.job.cond:
            if self.round is not None:
                self.job.rounds[self.round].failures.append(failure)

    def leave(self, reason: str) -> None:
        with self.job.cond:
            if self.round is not None:
                self.job.rounds[self.round].gone.setdefault(self.node.node_id, "left")
                self.job.cond.notify_all()

    def finish(self, timeout: float) -> bool:
        job, deadline = self.job, time.monotonic() + timeout
        with job.cond:
            if self.round is None:
                return True
            r = job.rounds[self.round]
            r.done.add(self.node.node_id)
            job.cond.notify_all()
            while len(r.done | set(r.gone)) < len(r.members):
                if time.monotonic() >= deadline:
                    return False
                job.cond.wait(0.05)
            job.finished = True
            return True

    def close(self) -> None:
        pass
