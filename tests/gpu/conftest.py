"""GPU tests: NCCL jobs on real CUDA devices.  Every test here is skipped, with the reason, where
this machine has no usable CUDA GPU (the CI machine has none; a lent GPU machine runs them with
``python -m pytest tests/gpu``).

The check runs in a child process, so that the pytest process itself never initialises CUDA.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = (
    "import torch\n"
    "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "print(n, torch.__version__, torch.version.cuda, torch.cuda.nccl.version() if n else None)\n"
)


def _gpus() -> tuple[int, str]:
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return 0, f"could not ask torch for GPUs ({exc})"
    fields = out.stdout.split()
    if out.returncode != 0 or not fields:
        return 0, f"could not ask torch for GPUs: {out.stderr.strip()[-300:]}"
    count, version, cuda = int(fields[0]), fields[1], fields[2]
    if cuda == "None":
        return 0, f"torch {version} is a CPU build: no CUDA, no NCCL"
    if count == 0:
        return 0, f"no CUDA GPU visible (torch {version}, CUDA {cuda})"
    return count, ""


GPUS, WHY_NOT = _gpus()


def pytest_collection_modifyitems(config, items):
    if GPUS:
        return
    skip = pytest.mark.skip(reason=WHY_NOT)
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def gpus() -> int:
    """How many CUDA GPUs the tests may use."""
    return GPUS
