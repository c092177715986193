import shutil
import tempfile
from pathlib import Path

import pytest

from tests.train.harness import Procs


@pytest.fixture
def work():
    """A scratch directory removed after the test."""
    d = Path(tempfile.mkdtemp(prefix="elastrun-train-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.cleanup()
