import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import evidence
from tests.train.harness import Procs, standalone


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


@pytest.fixture(scope="session")
def uninterrupted(once, tmp_path_factory) -> Callable[[list[str]], dict]:
    """``uninterrupted(trainer_args)``: the parameters (``final.json``) of trainer.py run to its end with no
    fault, under the real launcher, which the faulted runs must equal bit for bit.  Pass the arguments of the
    model and data only: checkpoints, et.run (``--reform``) and snapshot spacing must not change the result.
    Each distinct argument list runs once per test run (:func:`tests.conftest.once`)."""

    def run(trainer_args: list[str]) -> dict:
        out = tmp_path_factory.mktemp("uninterrupted")
        procs = Procs()
        try:
            rc = procs.run(standalone(out, trainer_args), out / "run.log")
        finally:
            procs.cleanup()
        assert rc == 0, f"the uninterrupted run {trainer_args} failed:\n{(out / 'run.log').read_text()[-3000:]}"
        return json.loads((out / "final.json").read_text())

    return lambda trainer_args: once(("trainer.py final", *trainer_args), lambda: run(trainer_args))
