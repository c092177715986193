"""A plain install (the package and torch, nothing else) runs the README's training loop, and a
command that needs a missing extra stops with one line naming it.

The venv is built once per test session in a temporary directory: ``python -m venv --without-pip``,
then this interpreter's pip installs the same torch as the dev venv (served from the local wheel
directory) and a copy of the package with its runtime dependencies only (about 20 s of CPU time,
most of it unpacking torch).  No numpy, no etcd3gw,
no matplotlib: the test checks that they are absent before it relies on it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from tests.harness import REPO, free_port

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
LOOP = HERE / "readme_loop.py"
_RESULT = re.compile(r"rank (\d) source (\S+) restored (\d+) step (\d+) epoch (\d+) elastrun (\S+)")


def _plain_env() -> dict[str, str]:
    """This environment without anything that would put the checkout or the dev venv on sys.path."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")  # .pyc written as for a user
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    return env


@pytest.fixture(scope="session")
def plain_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding only elastrun, torch and their runtime dependencies (built once per session)."""
    root = tmp_path_factory.mktemp("plain-install")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "elastrun", source / "elastrun", ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-compile",
           f"torch=={metadata.version('torch')}", str(source)]
    res = subprocess.run(pip, capture_output=True, text=True, timeout=300, env=_plain_env())
    assert res.returncode == 0, f"pip install failed:\n{res.stderr[-3000:]}"
    # Byte-compile only what is imported (processes write .pyc files as they import), not all of
    # torch as pip would: one import here first, so that two workers do not both compile the bulk.
    warm = "import torch, torch.distributed, torch.nn.parallel, elastrun.train, elastrun.launcher, elastrun.agent.agent"
    subprocess.run([str(venv / "bin" / "python"), "-c", warm], env=_plain_env(), check=True, capture_output=True,
                   timeout=120)
    return venv


def _run(venv: Path, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "elastrun"), *args], cwd=cwd, env=_plain_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_the_plain_venv_has_no_optional_packages(plain_venv: Path) -> None:
    code = ("import importlib.util as u; "
            "print([m for m in ('numpy', 'etcd3gw', 'matplotlib', 'elastrun', 'torch', 'psutil') if u.find_spec(m)])")
    res = subprocess.run([str(plain_venv / "bin" / "python"), "-c", code], env=_plain_env(), capture_output=True,
                         text=True, timeout=30, cwd=plain_venv)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['elastrun', 'torch', 'psutil']"


def test_readme_training_loop_restores_after_a_worker_kill_then_from_disk(plain_venv: Path, tmp_path: Path) -> None:
    """Two workers; rank 1 is SIGKILLed mid-epoch, the restart restores from memory and finishes.
    A second job in the same directory restores the last checkpoint from disk (a broadcast)."""
    logs = tmp_path / "logs"
    first = _run(plain_venv, ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--log-dir", str(logs),
                              str(LOOP), str(REPO / "README.md"), "--kill-at", "10"], tmp_path, 240)
    output = first.stdout + first.stderr
    assert first.returncode == 0, output[-4000:]
    assert "Numpy is not available" not in output, output[-4000:]
    results = {m[0]: m[1:] for m in _RESULT.findall(first.stdout)}
    assert set(results) == {"0", "1"}, output[-4000:]
    for source, restored, step, epoch, module in results.values():
        # Killed in its 10th forward, after committing step 9.  Step 9 is safe once rank 0's memory
        # copy of it finished (docs/train.md), which the restart may overtake on a loaded machine.
        assert (source, step, epoch) == ("memory", "51", "3") and restored in ("8", "9"), output[-4000:]
        assert Path(module).is_relative_to(plain_venv), f"elastrun imported from {module}, not the plain venv"
    assert "SIGKILL" in output  # the agent's failure summary for the killed rank

    second = _run(plain_venv, ["--standalone", "--nproc-per-node=2", str(LOOP), str(REPO / "README.md")],
                  tmp_path, 120)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    results = {m[0]: m[1:5] for m in _RESULT.findall(second.stdout)}
    assert results == {r: ("disk", "50", "51", "3") for r in "01"}, second.stdout[-4000:]


def _one_error_line(res: subprocess.CompletedProcess[str], extra: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and f"pip install 'elastrun[{extra}]'" in lines[0], res.stderr


def test_missing_extras_are_one_line_naming_the_extra(plain_venv: Path, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    endpoint = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    for backend in ("etcd", "etcd-v3"):
        res = _run(plain_venv, ["--nnodes=1", f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}",
                                "--rdzv-id=job", str(script)], tmp_path, 60)
        _one_error_line(res, "etcd")
        assert f"--rdzv-backend={backend}" in res.stderr
    assert not marker.exists(), "a worker ran although the backend's extra is missing"
    res = _run(plain_venv, ["status", "--rdzv-backend=etcd", f"--rdzv-endpoint={endpoint}", "--rdzv-id=job"],
               tmp_path, 60)
    _one_error_line(res, "etcd")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "events-n0.jsonl").write_text('{"event": "agent_start", "t": 1.0, "node": "n0"}\n')
    res = _run(plain_venv, ["timeline", str(logs), "-o", str(tmp_path / "t.png")], tmp_path, 60)
    _one_error_line(res, "timeline")
    assert not (tmp_path / "t.png").exists()
    assert time.monotonic() - t0 < 45, "the checks should stop before torch or any agent starts"
