"""The one decision of what a closed round is (elastrun/rendezvous/outcome.py), as both backends apply it."""

from __future__ import annotations

import time

import pytest

from elastrun.rendezvous.api import FailureRecord, NodeInfo
from elastrun.rendezvous.outcome import RoundEnd, decide
from elastrun.rendezvous.rounds import assign_ranks, decode_result, encode_result

pytestmark = pytest.mark.unit


def _members(n: int):
    return assign_ranks([NodeInfo(f"n{i}", "127.0.0.1", 2, hostname=f"h{i}") for i in range(n)])


def _failure(node: str, rank: int, progress: bool = True) -> FailureRecord:
    return FailureRecord(node_id=node, hostname=f"h{node[1:]}", rank=rank, local_rank=0, exitcode=1, signal=None,
                         timestamp=time.time(), message="ValueError: x", progress=progress)


def test_a_first_round_charges_nothing_and_its_document_round_trips():
    outcome = decide("job", _members(3), 0, 0, 0, None, max_restarts=3, crash_loop_limit=3)
    assert (outcome.restarts_used, outcome.no_progress_streak, outcome.abort) == (0, 0, None)
    doc = decode_result(encode_result(outcome.document))
    assert [m["node_id"] for m in doc["members"]] == ["n0", "n1", "n2"]
    assert (doc["generation"], doc["lost"], doc["lost_causes"], doc.get("cause")) == (0, [], {}, None)


def test_a_failure_is_charged_and_named_as_the_next_round_s_cause():
    outcome = decide("job", _members(2), 4, 1, 0, RoundEnd([_failure("n1", 3)]), max_restarts=3, crash_loop_limit=3)
    assert (outcome.restarts_used, outcome.abort) == (2, None)
    doc = outcome.document
    assert (doc["generation"], doc["restarts_used"]) == (4, 2)
    assert (doc["cause"]["node_id"], doc["cause"]["rank"]) == ("n1", 3)


def test_a_lost_node_is_a_membership_change_and_without_its_marker_it_was_silent():
    ended = RoundEnd([_failure("n1", 3)], ["n2"], {}, nodes_gone=1)
    outcome = decide("job", _members(2), 4, 1, 0, ended, max_restarts=3, crash_loop_limit=3)
    assert outcome.restarts_used == 1, "the survivors' failures after a node loss were charged"
    assert (outcome.document["lost"], outcome.document["lost_causes"]) == (["n2"], {"n2": "silence"})


def test_a_spent_budget_ends_the_job_with_its_culprit():
    ended = RoundEnd([_failure("n1", 3)], [], {}, nodes_gone=0)
    outcome = decide("job", _members(2), 2, 1, 0, ended, max_restarts=1, crash_loop_limit=0)
    assert outcome.abort is not None and "restart budget" in outcome.abort and "rank 3" in outcome.abort
    assert outcome.document["abort"] == outcome.abort and outcome.document["restarts_used"] == 2


def test_attempts_without_progress_in_a_row_are_a_crash_loop():
    outcome = decide("job", _members(2), 2, 0, 1, RoundEnd([_failure("n0", 0, progress=False)]), max_restarts=10,
                     crash_loop_limit=2)
    assert outcome.no_progress_streak == 2 and outcome.abort is not None and "crash loop" in outcome.abort
