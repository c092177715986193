"""What a closed round is: its members and ranks, what the round before it cost, and its result document.

One decision for every backend, pure, beside :mod:`elastrun.rendezvous.rounds` (whose rules it
applies).  A backend's closer reads the facts from its storage (the admitted joiners in arrival
order, how the previous round ended, the job's budget so far), calls :func:`decide`, and writes
what comes out its own way: c10d with counters and a compare-and-set, etcd in one transaction.

Example (a closer)::

    ended = RoundEnd(failures, lost, lost_causes, nodes_gone=len(lost))
    outcome = decide(run_id, assign_ranks(infos), generation, used, streak, ended, max_restarts, crash_loop_limit)
    store(outcome.document)          # and, where it keeps them apart, outcome.restarts_used / .no_progress_streak
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastrun.rendezvous.api import FailureRecord, Member
from elastrun.rendezvous.rounds import judge_round_end, result_document, round_cause


@dataclass
class RoundEnd:
    """How the previous round ended, as its closer's successor read it."""

    #: The failure records of its nodes (any order; the rules pick the culprit).
    failures: list[FailureRecord] = field(default_factory=list)
    #: Its members declared lost or departed (not finished), in the order they were declared.
    lost: list[str] = field(default_factory=list)
    #: How each of ``lost`` was found out (``link``, ``silence``, ``left``).
    lost_causes: dict[str, str] = field(default_factory=dict)
    #: The departures the budget rule weighs (the backend's count: c10d its lost nodes, etcd every
    #: member whose join key is gone, finished ones included).
    nodes_gone: int = 0


@dataclass
class Outcome:
    """The closed round: what to publish, and the job's budget after it."""

    members: list[Member]
    #: The result document (:func:`elastrun.rendezvous.rounds.encode_result` stores it); a backend may
    #: add its own fields (the workers' store address) before it writes it.
    document: dict[str, Any]
    restarts_used: int
    no_progress_streak: int
    #: The job's end, when the round that ended spent the budget or was one crash too many.
    abort: str | None = None
    abort_code: int = 1


def decide(
    run_id: str, members: list[Member], generation: int, restarts_used: int, no_progress_streak: int,
    ended: RoundEnd | None, max_restarts: int, crash_loop_limit: int,
) -> Outcome:
    """The outcome of a round that closes with ``members`` (ranks assigned), after ``ended`` (None: the
    job's first round, or one after a round that never formed: nothing to charge).

    ``restarts_used`` and ``no_progress_streak`` are the job's values before this round.
    """
    used, streak, abort, abort_code = restarts_used, no_progress_streak, None, 1
    extra: dict[str, Any] = {"lost_causes": {}}
    lost: list[str] = []
    if ended is not None:
        verdict = judge_round_end(run_id, ended.failures, ended.nodes_gone, restarts_used, no_progress_streak,
                                  max_restarts, crash_loop_limit)
        used, streak, abort, abort_code = (verdict.restarts_used, verdict.no_progress_streak, verdict.abort,
                                           verdict.abort_code)
        lost = list(ended.lost)
        extra["lost_causes"] = {n: ended.lost_causes.get(n, "silence") for n in lost}
        cause = round_cause(ended.failures, lost)
        if cause is not None:
            extra["cause"] = cause.to_dict()
    document = result_document(members, generation, used, max_restarts, abort, abort_code, lost,
                               no_progress_streak=streak, **extra)
    return Outcome(members, document, used, streak, abort, abort_code)
