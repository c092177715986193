"""The Python API: launch a function from code and get each rank's return value."""

import subprocess
import sys
import textwrap

from tests.harness import REPO, base_env


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=180)


def test_launch_a_function_returns_each_ranks_value():
    proc = _run("""
        from elastrun.config import LaunchConfig
        from elastrun.launcher import launch
        from tests.scripts.funcs import allreduce_rank

        config = LaunchConfig(entrypoint="", nproc_per_node=2, rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", standalone=True, run_id="api")
        print("RESULT", sorted(launch(config, allreduce_rank, 10).items()))
    """)
    assert proc.returncode == 0, proc.stderr
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
