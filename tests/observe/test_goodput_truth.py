"""The yardstick of the goodput accuracy test (goodput_truth.py) on time lines built by hand.

The accuracy test passes or fails by this yardstick, so its rules are checked where they can be
stated exactly: three ranks of 0.1 s steps, one fault, and the workers' logs that follow from it.
"""

from __future__ import annotations

import pytest

from tests.observe.goodput_truth import Injection, Proc, truth

pytestmark = pytest.mark.unit

STEP = 0.1


def _stepping(pid: int, first: int, count: int, start: float) -> Proc:
    p = Proc(pid)
    for i in range(count):
        t0 = start + i * STEP
        p.steps.append((first + i, t0, t0 + 0.09, t0 + STEP))
    return p


def _hang_job(victim_finishes_at: float | None) -> dict[int, Proc]:
    """Ranks 1-3 step from 0 to 5 s; rank 3 is stopped at 5.03 s inside step 51 (5.0 to 5.1 s).  Ranks
    1 and 2 re-form and resume from step 50 at 7.2 s.  ``victim_finishes_at``: the stopped rank,
    woken to dump its stacks, ends step 51 then before it dies."""
    procs = {pid: _stepping(pid, 1, 50, 0.0) for pid in (1, 2, 3)}
    if victim_finishes_at is not None:
        procs[3].steps.append((51, 5.0, 5.09, victim_finishes_at))
    for pid in (1, 2):
        procs[pid].resumes.append((7.2, 7.2, 50))
        procs[pid].steps += _stepping(pid, 51, 20, 7.2).steps
    return procs


@pytest.mark.parametrize("victim_finishes_at", [None, 7.01], ids=["dies-stopped", "finishes-its-step"])
def test_a_hang_is_timed_from_the_victims_last_step_to_the_detection(victim_finishes_at: float | None) -> None:
    """Every slot waits from the victim's last sign of life (its step 50 ended at 5.0 s; the stop landed
    at 5.03 s, which no log shows) to the detection (7.0 s): 3 x 2.0 worker-s of hang, whether or not the
    woken victim ended the step it was stopped in after the detection (0.01 s of it past the detection,
    redone)."""
    seen = truth(_hang_job(victim_finishes_at), [Injection("hang", 5.03, [3])], {0: 7.0})
    assert seen["hang"] == pytest.approx(3 * 2.0)
    assert seen["redone"] == pytest.approx(0.01 if victim_finishes_at else 0.0)


def test_a_peers_later_commit_shows_the_hung_rank_was_still_there() -> None:
    """The victim's last record is step 50 (5.0 s), but ranks 1 and 2 recorded step 51 at 5.1 s, before the
    detection (7.0 s): its commit's all-reduce had the victim in it, so the hang starts at 5.1 s.  Their
    step 51, rolled back by the resume from step 50, is redone (0.1 s each), and so is the victim's 5.0 to
    5.1 s (cut short)."""
    procs = _hang_job(None)
    for pid in (1, 2):
        procs[pid].steps.insert(50, (51, 5.0, 5.09, 5.1))
    seen = truth(procs, [Injection("hang", 5.03, [3])], {0: 7.0})
    assert seen["hang"] == pytest.approx(3 * 1.9)
    assert seen["redone"] == pytest.approx(3 * 0.1)


def test_a_crash_is_placed_at_the_victims_last_step_end() -> None:
    """The test's clock read (4.5 s) came before the kill, and the victim went on to step 50's end (5.0 s):
    the fault is at 5.0 s, so the surviving slots wait 5.0 to 5.2 s for the detection, not 0.7 s."""
    procs = {pid: _stepping(pid, 1, 50, 0.0) for pid in (1, 2, 3)}
    for pid in (1, 2):
        procs[pid].steps.append((51, 5.0, 5.09, 5.25))
    seen = truth(procs, [Injection("crash", 4.5, [3])], {0: 5.2})
    assert seen["detection"] == pytest.approx(3 * 0.2)


def test_a_step_in_progress_that_is_rolled_back_is_redone_once() -> None:
    """Rank 3 is killed after its step 50 (ending 5.0 s); ranks 1 and 2 ended theirs at 4.97 s, and end step 51
    at 5.25 s, after the detection (5.2 s), then resume from step 50 at 5.5 s.  Their step 51 is redone outside
    the detection's window (0.03 + 0.05 s each) and not again as the step the crash cut short.  (Counted twice,
    the yardstick's redone time ran 0.1-0.15 s above elastrun's in the accuracy test, a third of its
    tolerance.)"""
    procs = {pid: _stepping(pid, 1, 50, 0.0) for pid in (1, 2, 3)}
    for pid in (1, 2):
        procs[pid].steps[-1] = (50, 4.9, 4.96, 4.97)
        procs[pid].steps.append((51, 4.97, 5.09, 5.25))
        procs[pid].resumes.append((5.5, 5.5, 50))
        procs[pid].steps += _stepping(pid, 51, 5, 5.5).steps
    seen = truth(procs, [Injection("crash", 5.03, [3])], {0: 5.2})
    assert seen["redone"] == pytest.approx(2 * (0.03 + 0.05))
    assert seen["detection"] == pytest.approx(3 * 0.2)


def test_a_join_cuts_no_step_short_when_the_step_in_progress_committed() -> None:
    """A node joins at 5.03 s; ranks 1 and 2 finish step 51 (5.0 to 5.1 s) and leave at its commit, then
    resume from it (step 51) at 5.5 s: no redone time, and step 51 is good."""
    procs = {pid: _stepping(pid, 1, 51, 0.0) for pid in (1, 2)}
    for pid in (1, 2):
        procs[pid].resumes.append((5.5, 5.5, 51))
        procs[pid].steps += _stepping(pid, 52, 10, 5.5).steps
    seen = truth(procs, [Injection("join", 5.03, [], joined=5.03)], {0: 5.03})
    assert seen["redone"] == 0.0
    assert seen["good"] == pytest.approx(2 * 61 * 0.09)
