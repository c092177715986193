"""The Python API: launch a function from code and get each rank's return value."""

import re
import subprocess
import sys
import textwrap
import time

import pytest

from elastrun.config import LaunchConfig
from elastrun.errors import UsageError
from elastrun.launcher import launch
from tests import warm
from tests.harness import REPO, base_env

pytestmark = pytest.mark.e2e


def _run(code: str) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=base_env(),
                    capture_output=True, text=True, timeout=180)


def test_launch_a_function_returns_each_ranks_value():
    proc = _run("""
        import copy, logging, os
        from elastrun.config import LaunchConfig
        from elastrun.launcher import launch
        from tests.scripts.funcs import allreduce_rank

        config = LaunchConfig(entrypoint="", nproc_per_node=2, rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", standalone=True, run_id="api", quiet=True)
        before = copy.deepcopy(config)
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        level = logging.getLogger("elastrun").level
        print("RESULT", sorted(launch(config, allreduce_rank, 10).items()))
        print("UNCHANGED", config == before)
        # the caller's process is left as it was: quiet=True silenced elastrun for good once
        print("LEFT ALONE", logging.getLogger("elastrun").level == level, "TORCH_CPP_LOG_LEVEL" in os.environ)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "UNCHANGED True" in proc.stdout, proc.stdout
    assert "LEFT ALONE True False" in proc.stdout, proc.stdout
    assert ("RESULT [(0, {'rank': 0, 'sum': 10.0, 'world': 2}), (1, {'rank': 1, 'sum': 10.0, 'world': 2})]"
            in proc.stdout), proc.stdout + proc.stderr


def test_a_failing_function_raises_launch_error_with_root_cause():
    proc = _run("""
        from elastrun.config import LaunchConfig
        from elastrun.launcher import LaunchError, launch
        from tests.scripts.funcs import fail_on_rank_one

        config = LaunchConfig(entrypoint="", nproc_per_node=2, rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", standalone=True, run_id="api-fail")
        try:
            launch(config, fail_on_rank_one)
        except LaunchError as exc:
            print("EXIT", exc.exit_code)
    """)
    assert "EXIT 1" in proc.stdout, proc.stdout + proc.stderr
    # elastrun.record (used by the function runner) put the traceback in the error file.
    assert "root cause: rank 1" in proc.stderr
    assert "KeyError: 'missing shard'" in proc.stderr
    assert "fail_on_rank_one" in proc.stderr


@pytest.mark.parametrize(("fields", "words"), [
    ({"nproc_per_node": 0}, "nproc_per_node=0 is out of range"),
    ({"min_nodes": 3, "max_nodes": 2}, "MIN (3) is greater than MAX (2)"),
    ({"rdzv_conf_bogus": True}, "unknown --rdzv-conf key 'bogus'"),
    ({"start_method": "thread"}, "start_method='thread' is not a start method"),
])
@pytest.mark.unit
def test_a_bad_request_is_refused_before_anything_starts_and_left_unchanged(fields, words, tmp_path):
    """launch() holds a request to the command line's rules (LaunchConfig.validate, the backend's checks)."""
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    fields = dict(fields)
    conf = {"bogus": "1"} if fields.pop("rdzv_conf_bogus", False) else {}
    config = LaunchConfig(entrypoint="", rdzv_backend="c10d", rdzv_endpoint="localhost:0", standalone=True,
                          rdzv_configs=conf, log_dir=str(tmp_path / "logs"), **fields)
    before = repr(config)
    started = time.monotonic()
    with pytest.raises(UsageError, match=re.escape(words)):
        launch(config, str(script))
    assert time.monotonic() - started < 10
    assert repr(config) == before
    assert not (tmp_path / "ran").exists() and not (tmp_path / "logs").exists()
