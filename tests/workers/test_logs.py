"""Per-attempt, per-rank log files, console prefixes, tee and the local-ranks filter; the hold of a
dying worker's traceback (a real pump on a real pipe)."""

import os
import threading

import pytest

from elastrun.agent.workers import logs
from elastrun.agent.workers.logs import StreamPump
from tests.harness import base_env, wait_until

pytestmark = pytest.mark.unit

SCRIPT = "import os,sys; print('hello from', os.environ['RANK']); print('oops', os.environ['RANK'], file=sys.stderr)"


def _script(tmp_path):
    path = tmp_path / "hello.py"
    path.write_text(SCRIPT + "\n")
    return [str(path)]


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_console_lines_are_prefixed_and_filtered(agents, tmp_path):
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--local-ranks-filter=1"],
                         script=_script(tmp_path), env=base_env())
    assert agent.wait(60) == 0, agent.output()
    out = agent.output()
    assert "[node0 rank1]: hello from 1" in out
    assert "[node0 rank1]: oops 1" in out
    assert "hello from 0" not in out


@pytest.mark.e2e
def test_tee_writes_file_and_console(agents, tmp_path):
    logs = tmp_path / "logs"
    agent = agents.start(["--standalone", "--nproc-per-node=2", f"--log-dir={logs}", "--tee=1"],
                         script=_script(tmp_path), env=base_env())
    assert agent.wait(60) == 0, agent.output()
    assert "[node0 rank0]: hello from 0" in agent.output()
    assert (logs / "attempt_0" / "rank_0" / "stdout.log").read_text().strip() == "hello from 0"
    assert not (logs / "attempt_0" / "rank_0" / "stderr.log").exists()


# -- a dying worker's traceback is held from the console until the agent judges it (docs/failures.md) --

TRACEBACK = (b"[rank0]: Traceback (most recent call last):\n[rank0]:   File \"train.py\", line 3, in <module>\n"
             b"[rank0]: RuntimeError: Connection closed by peer\n")


class _Console:
    """A console stream the pump writes to (bytes), readable by the test."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, text: bytes) -> None:
        self.data += text

    def flush(self) -> None:
        pass


def _pump(tmp_path, error_file_exists: bool):
    error_file = tmp_path / "error.json"
    if error_file_exists:
        error_file.write_text("{}")
    read_fd, write_fd = os.pipe()
    console = _Console()
    pump = StreamPump(read_fd, console, threading.Lock(), "[node0 rank0]: ", tmp_path / "stderr.log", True,
                      hold_when=error_file)
    pump.start()
    return pump, console, write_fd


def _written(pump, line: str) -> bool:
    return pump.tail is not None and line in pump.tail


def test_healthy_output_and_a_traceback_of_a_live_script_pass_at_once(tmp_path):
    pump, console, w = _pump(tmp_path, error_file_exists=False)
    os.write(w, b"step 1\n" + TRACEBACK + b"step 2\n")
    wait_until(lambda: _written(pump, "step 2"), 10, 0.01, "the pump to read the lines")
    assert not pump.holding
    assert console.data == b"".join(b"[node0 rank0]: " + line + b"\n" for line in (b"step 1\n" + TRACEBACK +
                                                                                  b"step 2").split(b"\n"))
    os.close(w)
    pump.join(10)


def test_a_dying_workers_traceback_is_held_until_released(tmp_path):
    pump, console, w = _pump(tmp_path, error_file_exists=True)  # the bootstrap writes it before it prints
    os.write(w, b"step 1\n" + TRACEBACK)
    os.close(w)  # the worker is gone
    pump.join(10)
    assert _written(pump, "[rank0]: RuntimeError: Connection closed by peer") and pump.holding
    assert console.data == b"[node0 rank0]: step 1\n"  # healthy output went through at once
    assert (tmp_path / "stderr.log").read_bytes() == b"step 1\n" + TRACEBACK  # the log file has it all
    pump.release()
    assert not pump.holding and console.data.endswith(b"[node0 rank0]: [rank0]: RuntimeError: Connection closed by "
                                                      b"peer\n")


def test_a_consequence_is_dropped_from_the_console_with_what_follows(tmp_path):
    pump, console, w = _pump(tmp_path, error_file_exists=True)
    os.write(w, TRACEBACK)
    wait_until(lambda: pump.holding and _written(pump, "[rank0]: RuntimeError: Connection closed by peer"), 10, 0.01,
               "the traceback held")
    pump.drop()
    os.write(w, b"more of the dying worker's output\n")
    os.close(w)
    pump.join(10)
    assert console.data == b"" and not pump.holding
    assert b"more of the dying" in (tmp_path / "stderr.log").read_bytes()


def test_a_held_traceback_is_shown_when_no_judgement_comes_while_the_worker_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "HOLD_LIMIT", 0.2)
    pump, console, w = _pump(tmp_path, error_file_exists=True)
    os.write(w, TRACEBACK)
    wait_until(lambda: b"RuntimeError" in console.data, 10, 0.01, "the hold to run out")
    assert not pump.holding
    os.close(w)
    pump.join(10)


def test_a_traceback_that_comes_after_the_judgement_is_shown_at_the_end(tmp_path):
    """The agent judged the worker (released) before its stream ended, and a traceback came later (a
    child of the worker's, still holding the pipe): nobody will judge it, so the end shows it."""
    pump, console, w = _pump(tmp_path, error_file_exists=True)
    pump.release()
    os.write(w, TRACEBACK)
    os.close(w)
    pump.join(10)
    assert not pump.holding and console.data.endswith(b"[node0 rank0]: [rank0]: RuntimeError: Connection closed by "
                                                      b"peer\n")
