"""Worker failures: restart with new ranks and resume; a spent budget ends the job with its root cause."""

import pytest

from tests.harness import SCRIPTS, base_env, read_steps

pytestmark = pytest.mark.e2e


def test_crash_restarts_and_resumes_from_checkpoint(agents, tmp_path):
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    env = base_env(
        STEPS_LOG=str(steps_dir), STEPS="30", STEP_SECONDS="0.02", CRASH_AT_STEP="10", CRASH_RANK="1",
        CRASH_ONCE_FILE=str(tmp_path / "crashed"), CKPT=str(tmp_path / "ckpt.json"),
    )
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--max-restarts=2"], env=env)
    assert agent.wait(180) == 0, agent.output()
    steps = read_steps(steps_dir)
    first = [s for s in steps if s.gen == "0"]
    second = [s for s in steps if s.gen == "1"]
    assert first and second, agent.output()
    assert max(s.step for s in first) < 10
    # The new attempt resumes from the script's checkpoint, not from step 0, and reaches the end.
    assert min(s.step for s in second) >= 9
    assert {s.step for s in second if s.rank == 0} >= set(range(10, 30))
    out = agent.output()
    assert "rank 1 on " in out and "failed (exit code 1): RuntimeError: injected failure at step 10" in out
    assert "restarts used 1/2" in out


def test_spent_budget_fails_with_root_cause(agents, tmp_path):
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="50", STEP_SECONDS="0.02", CRASH_AT_STEP="3", CRASH_RANK="1")
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--max-restarts=1"], env=env)
    assert agent.wait(180) == 1, agent.output()
    out = agent.output()
    assert "restart budget (--max-restarts=1) is spent" in out
    assert "root cause: rank 1 (local rank 1)" in out
    assert "exit code 1" in out
    # The traceback of the failing rank (its stderr tail: the script has no @record) is in the summary.
    assert "RuntimeError: injected failure at step 3" in out


def test_record_error_file_traceback_in_summary(agents, tmp_path):
    agent = agents.start(
        ["--standalone", "--nproc-per-node=2"],
        script=[str(SCRIPTS / "record_fail.py")],
        env=base_env(FAIL_RANK="1"),
    )
    assert agent.wait(120) == 1, agent.output()
    out = agent.output()
    assert "root cause: rank 1" in out
    assert "ValueError: the answer is not 42" in out
    # From the error file written by torch's @record: the traceback names the raising function.
    assert 'in main' in out
