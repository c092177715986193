"""The pure rules of a round: closing, rank assignment, budget charging, root cause."""

import base64
import json
import zlib

import pytest

from elastrun.rendezvous.api import FailureRecord, Member, NodeInfo, RoundCause
from elastrun.rendezvous.rounds import (
    CloseInputs,
    assign_ranks,
    close_size,
    decode_result,
    encode_result,
    format_failure,
    is_charged,
    join_interrupts,
    member_view,
    result_document,
    root_cause,
    round_cause,
)

pytestmark = pytest.mark.unit


def _inputs(**kw):
    base = dict(joined=1, min_nodes=1, max_nodes=3, prev_members=None, prev_accounted=0, since_min=0.0,
                last_call=1.0)
    base.update(kw)
    return CloseInputs(**base)


def test_first_round_waits_for_last_call_then_closes():
    assert close_size(_inputs(joined=0, since_min=None)) is None
    assert close_size(_inputs(joined=1, since_min=0.5)) is None
    assert close_size(_inputs(joined=2, since_min=1.0)) == 2


def test_max_nodes_closes_at_once():
    assert close_size(_inputs(joined=3, since_min=0.0)) == 3
    assert close_size(_inputs(joined=5, since_min=0.0)) == 3


def test_later_round_waits_for_every_previous_member():
    # Two of three previous members accounted for: a newcomer must not form a group beside them.
    assert close_size(_inputs(joined=2, prev_members=3, prev_accounted=2, since_min=99)) is None
    assert close_size(_inputs(joined=2, prev_members=3, prev_accounted=3, since_min=0)) == 2
    # Below the minimum it waits even when everyone is accounted for.
    assert close_size(_inputs(joined=1, min_nodes=2, prev_members=2, prev_accounted=2)) is None


def _node(name, prev=-1, fixed=-1, nproc=2, role="default"):
    return NodeInfo(node_id=name, addr="127.0.0.1", nproc=nproc, role=role, prev_group_rank=prev, fixed_rank=fixed)


def test_ranks_are_contiguous_and_keep_previous_group_rank():
    members = assign_ranks([_node("a"), _node("b", prev=0), _node("c", prev=1, nproc=3)])
    by_id = {m.node_id: m for m in members}
    assert by_id["b"].group_rank == 0 and by_id["c"].group_rank == 1 and by_id["a"].group_rank == 2
    assert [m.rank_offset for m in sorted(members, key=lambda m: m.group_rank)] == [0, 2, 5]


def test_conflicting_previous_ranks_go_to_the_earlier_joiner():
    members = assign_ranks([_node("a", prev=0), _node("b", prev=0)])
    assert {m.node_id: m.group_rank for m in members} == {"a": 0, "b": 1}


def test_out_of_range_previous_rank_is_reassigned():
    members = assign_ranks([_node("a", prev=5), _node("b")])
    assert sorted(m.group_rank for m in members) == [0, 1]


def test_fixed_ranks_win():
    members = assign_ranks([_node("a", fixed=1), _node("b", fixed=0)])
    assert {m.node_id: m.group_rank for m in members} == {"a": 1, "b": 0}


def test_role_ranks_count_within_role():
    members = assign_ranks([_node("a", role="x"), _node("b", role="y"), _node("c", role="x")])
    by_id = {m.node_id: m for m in members}
    assert by_id["a"].role_rank_offset == 0 and by_id["c"].role_rank_offset == 2
    assert by_id["b"].role_rank_offset == 0


def test_charging_rules():
    assert is_charged(failures=2, nodes_gone=0)
    assert not is_charged(failures=2, nodes_gone=1)
    assert not is_charged(failures=0, nodes_gone=0)


def test_root_cause_is_the_earliest_failure():
    late = FailureRecord("n1", "h1", 3, 1, 1, None, 10.0, "consequence")
    early = FailureRecord("n2", "h2", 0, 0, None, "SIGSEGV", 5.0, "Traceback ...\nboom")
    cause = root_cause([late, early])
    assert cause is early
    text = format_failure(cause)
    assert "rank 0" in text and "killed by SIGSEGV" in text and "boom" in text
    assert root_cause([]) is None


def test_a_peers_error_is_not_the_root_cause_even_when_seen_first():
    """Issue 34: rank 1 SIGKILLed, rank 0's collective failed on the closed connection; an agent that
    finds both in one look (or another node's quicker agent) gives rank 0 the earlier time."""
    peer = FailureRecord("n1", "h1", 0, 0, 1, None, 5.0, "RuntimeError: Connection closed by peer", peer_error=True)
    killed = FailureRecord("n2", "h2", 1, 0, None, "SIGKILL", 5.1, "")
    assert root_cause([peer, killed]) is killed
    assert round_cause([peer, killed], []) == RoundCause("n2", "h2", 1, "killed by SIGKILL")
    # Only peer errors (a real network fault): the earliest is to blame, and its node says so in full.
    late = FailureRecord("n2", "h2", 1, 0, 1, None, 6.0, "RuntimeError: Connection reset by peer", peer_error=True)
    assert root_cause([late, peer]) is peer
    assert round_cause([late, peer], []) == RoundCause("n1", "h1", 0, "exit code 1")
    # A lost node closed those connections: it is the culprit, unless a worker failed of its own error.
    assert round_cause([peer], ["n3"]) == RoundCause("n3", "", None, "lost")
    assert round_cause([peer, killed], ["n3"]).rank == 1
    hang = FailureRecord("n2", "h2", 1, 0, None, "SIGKILL", 7.0, "hang detected: no heartbeat for 2.0 s")
    assert round_cause([hang], []).what == "hung" and round_cause([], []) is None


def test_the_culprit_travels_in_the_round_result():
    doc = result_document(assign_ranks([NodeInfo("a", "10.0.0.1", 2)]), 1, 1, 3, None, 1, [],
                          cause=RoundCause("b", "hb", 3, "killed by SIGKILL").to_dict())
    got = decode_result(encode_result(doc))
    me = Member("a", "10.0.0.1", 0, 2, 0)
    assert member_view(1, got, [me], me, "10.0.0.1", 1).cause == RoundCause("b", "hb", 3, "killed by SIGKILL")
    assert member_view(1, {**got, "cause": "forged"}, [me], me, "10.0.0.1", 1).cause is None
    assert member_view(1, {k: v for k, v in got.items() if k != "cause"}, [me], me, "10.0.0.1", 1).cause is None


def _failure(progress: bool, t: float = 1.0) -> FailureRecord:
    return FailureRecord("n", "h", 1, 1, 1, None, t, "boom", progress=progress)


def test_verdict_charges_once_and_aborts_when_the_budget_is_spent():
    from elastrun.rendezvous.rounds import judge_round_end

    ok = judge_round_end("job", [_failure(True), _failure(True, 2.0)], 0, 0, 0, max_restarts=1, crash_loop_limit=3)
    assert (ok.restarts_used, ok.abort) == (1, None)
    spent = judge_round_end("job", [_failure(True)], 0, 1, 0, max_restarts=1, crash_loop_limit=3)
    assert spent.restarts_used == 2 and spent.abort_code == 1
    assert "restart budget (--max-restarts=1) is spent" in spent.abort and "root cause: rank 1" in spent.abort
    lost = judge_round_end("job", [_failure(True)], 1, 1, 0, max_restarts=1, crash_loop_limit=3)
    assert (lost.restarts_used, lost.abort) == (1, None)


def test_verdict_stops_a_crash_loop_before_the_budget():
    from elastrun.config import EXIT_NO_REQUEUE
    from elastrun.rendezvous.rounds import judge_round_end

    first = judge_round_end("job", [_failure(False)], 0, 0, 0, max_restarts=10, crash_loop_limit=2)
    assert first.no_progress_streak == 1 and first.abort is None
    second = judge_round_end("job", [_failure(False)], 0, 1, 1, max_restarts=10, crash_loop_limit=2)
    assert second.abort_code == EXIT_NO_REQUEUE and "crash loop" in second.abort
    progress = judge_round_end("job", [_failure(True)], 0, 1, 1, max_restarts=10, crash_loop_limit=2)
    assert progress.no_progress_streak == 0 and progress.abort is None


def test_a_failure_recorded_after_a_stop_for_a_joiner_is_not_charged():
    from elastrun.rendezvous.rounds import judge_round_end

    consequence = FailureRecord("n", "h", 1, 1, 1, None, 1.0, "Connection closed by peer", after_growth=True)
    grown = judge_round_end("job", [consequence], 0, 0, 0, max_restarts=0, crash_loop_limit=3)
    assert (grown.restarts_used, grown.abort, grown.no_progress_streak) == (0, None, 0)
    both = judge_round_end("job", [consequence, _failure(True, 0.5)], 0, 0, 0, max_restarts=0, crash_loop_limit=3)
    assert both.restarts_used == 1 and "restart budget (--max-restarts=0) is spent" in both.abort


def _result(n: int) -> dict:
    nodes = [NodeInfo(f"node-{i}", f"10.0.0.{i}", 1 + i % 3, role="a" if i % 2 else "b", hostname=f"h{i}",
                      link_port=30000 + i, prev_group_rank=n - 1 - i) for i in range(n)]
    return result_document(assign_ranks(nodes), 3, 1, 5, None, 1, ["gone-1"], lost_causes={"gone-1": "link"},
                           no_progress_streak=2)


def test_result_document_round_trips_through_its_compact_encoding():
    doc = _result(64)
    text = encode_result(doc)
    assert text.startswith("z1:") and len(text) < len(json.dumps(doc)) / 3
    assert decode_result(text) == doc
    assert decode_result(text.encode()) == doc


def test_result_with_ranks_the_rows_cannot_express_is_stored_as_plain_json():
    doc = _result(8)
    doc["members"] = list(reversed(doc["members"]))
    text = encode_result(doc)
    assert text.startswith("{") and decode_result(text) == doc


def test_a_result_that_inflates_past_the_limit_is_refused():
    bomb = "z1:" + base64.b64encode(zlib.compress(b" " * (65 << 20))).decode()
    with pytest.raises(ValueError, match="larger than"):
        decode_result(bomb)
    with pytest.raises(ValueError, match="cannot be decoded"):
        decode_result("z1:not-base64!")


def test_ring_watch_gives_a_successor_never_seen_beating_its_first_beat_grace(monkeypatch):
    from elastrun.rendezvous import keepalive

    now = [100.0]
    monkeypatch.setattr(keepalive.time, "monotonic", lambda: now[0])
    watch = keepalive.RingWatch(2.5, first_beat_grace=2.5)
    watch.retarget("b")
    now[0] += 4.0
    assert not watch.observe(None)  # no beat seen yet: 2.5 s + 2.5 s of grace
    now[0] += 1.0
    assert watch.observe(None)
    watch.retarget("c")
    assert not watch.observe("1:0.0")  # seen beating: the plain timeout from now on
    now[0] += 2.5
    assert watch.observe("1:0.0")


def test_a_join_interrupts_only_a_group_that_trains_below_its_maximum_with_no_round_forming():
    two = {"members": [{"node_id": "a"}, {"node_id": "b"}], "generation": 0}
    assert join_interrupts(1, 0, two, max_nodes=3)
    assert join_interrupts(7, 0, {"size": 2}, max_nodes=3), "a seated round's header gives its size"
    assert not join_interrupts(0, 0, None, max_nodes=3), "a job's first round"
    assert not join_interrupts(1, 1, two, max_nodes=3), "a round is forming: join it at once"
    assert not join_interrupts(1, 0, two, max_nodes=2), "the group is full: the join waits, stops nobody"
    assert not join_interrupts(1, 0, None, max_nodes=3), "no authentic result: nothing known to run"
    assert not join_interrupts(1, 0, {"void": "closer went silent", "members": []}, max_nodes=3)
    assert not join_interrupts(1, 0, {**two, "abort": "budget spent"}, max_nodes=3), "the job ended"
