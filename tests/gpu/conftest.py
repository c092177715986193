"""GPU tests: skipped, with the reason, on a machine without CUDA GPUs (CI has none).

Run them where a GPU is lent: ``pytest tests/gpu``.  ``gpus(n)`` marks a test that needs ``n``.
"""

import pytest
import torch

from tests.train.conftest import procs, work  # noqa: F401  (the fixtures of the launcher tests)


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} CUDA GPU(s), this machine has {gpu_count()}")
