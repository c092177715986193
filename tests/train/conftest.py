import shutil
import tempfile
from pathlib import Path

import pytest

from tests import evidence
from tests.train.harness import Procs


@pytest.fixture
def work(request):
    """A scratch directory removed after the test, kept as evidence when the test failed."""
    d = Path(tempfile.mkdtemp(prefix="elastrun-train-test-"))
    yield d
    why = evidence.test_failure(request.node)
    if why:
        evidence.keep(d, why, request.node.name)
    else:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def procs(request, work):
    """Launched agents, killed after the test; when it failed, every process's stacks first (into ``work``)."""
    p = Procs()
    yield p
    if evidence.test_failure(request.node):
        evidence.dump_stacks(p.pids(), work)
    p.cleanup()
