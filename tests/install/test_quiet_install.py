"""Installing elastrun prints no warning of the project's own making (issue 34).

setuptools warns, through pip, about the project's own packaging: a deprecated ``project.license``
table, or the notice of an editable install whose layout it must guess.  Both installs a developer
makes are built here exactly as pip builds them (an isolated build environment with the newest
setuptools it finds), without dependencies, into a throwaway venv; what pip prints must hold no
warning of the build backend.  Warnings of pip itself about this machine's configuration (index
locations) are not the project's and are left out of the check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO

pytestmark = pytest.mark.e2e

#: What a build backend's warning looks like in pip's output (setuptools' warning classes, ``!!`` banners).
BACKEND_WARNINGS = ("BuildBackendWarning", "DeprecationWarning", "SetuptoolsWarning", "!!", "deprecated")


def _source(root: Path) -> Path:
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "elastrun", source / "elastrun", ignore=shutil.ignore_patterns("__pycache__"))
    return source


@pytest.mark.parametrize("editable", [False, True], ids=["install", "install -e"])
def test_install_prints_no_build_backend_warning(tmp_path: Path, editable: bool) -> None:
    source = _source(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # -v: pip shows the build backend's own output, where its warnings are.
    cmd = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-v", "--no-deps",
           "--no-compile", *(["-e"] if editable else []), str(source)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, f"pip install failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    output = res.stdout + res.stderr
    found = [line for line in output.splitlines() if any(w in line for w in BACKEND_WARNINGS)]
    assert not found, "\n".join(found)
    assert "Successfully installed elastrun" in output
