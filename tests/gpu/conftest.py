"""GPU tests: NCCL jobs and CUDA state on real devices.  Every test here is skipped, with the reason,
where this machine has no usable CUDA GPU (the CI machine has none; where a GPU machine is lent, run
``python -m pytest tests/gpu``).  ``gpus(n)`` marks a test that needs ``n`` GPUs.

The GPUs are counted in a child process, so that the pytest process itself never initialises CUDA.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.train.conftest import procs, work  # noqa: F401  (the fixtures of the launcher tests)

_PROBE = (
    "import torch\n"
    "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "print(n, torch.__version__, torch.version.cuda)\n"
)


def _probe() -> tuple[int, str]:
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return 0, f"could not ask torch for GPUs ({exc})"
    fields = out.stdout.split()
    if out.returncode != 0 or len(fields) != 3:
        return 0, f"could not ask torch for GPUs: {out.stderr.strip()[-300:]}"
    count, version, cuda = int(fields[0]), fields[1], fields[2]
    if cuda == "None":
        return 0, f"torch {version} is a CPU build: no CUDA, no NCCL"
    if count == 0:
        return 0, f"no CUDA GPU visible (torch {version}, CUDA {cuda})"
    return count, ""


_GPUS, _WHY_NOT = _probe()


def gpu_count() -> int:
    """How many CUDA GPUs the tests may use."""
    return _GPUS


def gpus(n: int) -> pytest.MarkDecorator:
    """Skip the test, with the reason, unless ``n`` GPUs are present."""
    return pytest.mark.skipif(n > _GPUS, reason=_WHY_NOT or f"needs {n} CUDA GPU(s), this machine has {_GPUS}")
