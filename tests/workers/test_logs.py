"""Per-attempt, per-rank log files, console prefixes, tee and the local-ranks filter."""

from tests.harness import base_env

SCRIPT = "import os,sys; print('hello from', os.environ['RANK']); print('oops', os.environ['RANK'], file=sys.stderr)"


def _script(tmp_path):
    path = tmp_path / "hello.py"
    path.write_text(SCRIPT + "\n")
    return [str(path)]


def test_redirects_write_per_attempt_per_rank_files(agents, tmp_path):
    logs = tmp_path / "logs"
    agent = agents.start(["--standalone", "--nproc-per-node=2", f"--log-dir={logs}", "--redirects=3"],
                         script=_script(tmp_path), env=base_env())
    assert agent.wait(60) == 0, agent.output()
    for rank in (0, 1):
        base = logs / "attempt_0" / f"rank_{rank}"
        assert (base / "stdout.log").read_text().strip() == f"hello from {rank}"
        assert (base / "stderr.log").read_text().strip() == f"oops {rank}"
    # Redirected output does not reach the console.
    assert "hello from" not in agent.output()
    assert list(logs.glob("events-*.jsonl"))


def test_console_lines_are_prefixed_and_filtered(agents, tmp_path):
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--local-ranks-filter=1"],
                         script=_script(tmp_path), env=base_env())
    assert agent.wait(60) == 0, agent.output()
    out = agent.output()
    assert "[node0 rank1]: hello from 1" in out
    assert "[node0 rank1]: oops 1" in out
    assert "hello from 0" not in out


def test_tee_writes_file_and_console(agents, tmp_path):
    logs = tmp_path / "logs"
    agent = agents.start(["--standalone", "--nproc-per-node=2", f"--log-dir={logs}", "--tee=1"],
                         script=_script(tmp_path), env=base_env())
    assert agent.wait(60) == 0, agent.output()
    assert "[node0 rank0]: hello from 0" in agent.output()
    assert (logs / "attempt_0" / "rank_0" / "stdout.log").read_text().strip() == "hello from 0"
    assert not (logs / "attempt_0" / "rank_0" / "stderr.log").exists()
