"""Shared fixtures (a per-test cluster of real agents that is always cleaned up), how tools/test.sh hands
tests out to its xdist workers, and the test tiers.

Every test carries one tier mark (docs/testing.md): ``unit`` (in-process, no child process),
``contract`` (a contract checked in-process: the rendezvous backends' conformance suite, groups of
a few ranks on threads; a fixture may start a server such as etcd) or ``e2e`` (real agents and
workers).  A test without one is a usage error; a ``unit`` or ``contract`` test that starts a
child process fails, so the fast tier (``tools/test.sh --fast``) stays what its name says.
"""

from __future__ import annotations

import _posixsubprocess
import fcntl
import getpass
import hashlib
import json
import os
import re
import signal
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import evidence
from tests.harness import Cluster

# A shell without job control starts background commands (`bash .ci/run &`) with SIGINT ignored,
# and exec'd children inherit that: the tests that send SIGINT to a worker they started directly
# would see it ignored.  A caught signal is reset to the default by exec, as an agent's is.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_PYTEST_PID = os.getpid()


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (a CI time limit, ``timeout``) unwinds the test like Ctrl-C, so its context managers
    and fixtures stop what it started: etcd members and agents run in sessions of their own, and
    a killed pytest would leave them running.  A forked child takes the default action."""
    if os.getpid() != _PYTEST_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"pytest got signal {signum}")


signal.signal(signal.SIGTERM, _terminated)

# Two variables that code run in the test process sets in its own environment: torch._inductor sets its
# cache folder the first time it asks for it, and elastrun.launch() quiets torch's C++ log (as the agent
# does).  The environment a test hands its processes would then differ before and after another test did
# that, and tests/warm.py would start another warm server for each difference (~4 CPU-s).  Set from the
# start, to the values they get, they are the same for every test, whatever ran before it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r"[^\w]", "_", getpass.getuser())))
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


#: Files whose tests one xdist worker runs, one after the other (tools/test.sh runs the suite on several):
#: each builds something once per module or session, or its tests must not run at the same time.  Every
#: other test is a unit of its own.  (pytest-xdist's ``xdist_group`` marks do nothing with pytest 9.2:
#: pytest-xdist issue #1386.)
ONE_WORKER_FILES = {
    "tests/observe/test_goodput_accuracy.py": "the faulted job is run once per mode for the module",
    "tests/observe/test_recorded_run.py": "the recorded job is run once for the module",
    "tests/install/test_plain_install.py": "the plain venv (pip install torch) is built once per session",
    "tests/workers/test_pool.py": "the pool and the stub driver are built once for the module",
    "tests/rendezvous/test_etcd_tls.py": "the TLS etcd member is started once for the module",
    "tests/deploy/test_slurm_cluster.py": "two SLURM clusters at once would be the same node (this host's name)",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """With ``-n N`` (``--dist load``): each test is a unit, but each of :data:`ONE_WORKER_FILES` is one
    unit, handed out first (the largest units go first)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in ONE_WORKER_FILES else nodeid

    return OneWorkerFiles(config, log)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations", action="store_true",
        help="write each test's duration (1 s or more) into tests/durations.json, which orders the tests "
             "handed out to xdist workers, longest first")
    parser.addoption(
        "--tier", default=",".join(TIERS),
        help=f"comma-separated tiers to run, of {', '.join(TIERS)} (default: all); tools/test.sh --fast runs "
             "unit,contract")


#: The test tiers, fastest first (module docstring).
TIERS = ("unit", "contract", "e2e")


def tier_of(item: pytest.Item) -> str | None:
    """The test's tier: its closest tier mark (a test's own mark overrides its module's ``pytestmark``)."""
    for mark in item.iter_markers():
        if mark.name in TIERS:
            return mark.name
    return None


class _InProcessGuard:
    """Fails a ``unit`` or ``contract`` test that starts a child process (while the test body runs).

    The functions through which Python starts one are wrapped: ``subprocess``'s ``_fork_exec`` and
    ``_posixsubprocess.fork_exec`` (``multiprocessing``'s spawn and forkserver), ``os.fork``,
    ``os.forkpty``, ``os.posix_spawn``/``posix_spawnp`` and ``os.system``.  Not an audit hook: on
    CPython 3.11 a Python audit hook runs inside ``sys.settrace``, and a thread that starts meanwhile
    under a tracer (coverage in ``tools/test.sh --fast``) dies before its target runs ("Cannot install a
    trace function while another trace function is being installed"): a heartbeat thread was lost so.
    """

    WRAPPED = ((subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"), (os, "forkpty"),
               (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"))

    def __init__(self) -> None:
        self.test: str | None = None  # the node id of the in-process test running now
        #: What the running test was refused: the test fails with it even where the refusal was
        #: raised in a thread of its own (seen: a library's helper thread running ``ldconfig``).
        self.refused: str | None = None
        for module, name in self.WRAPPED:
            real = getattr(module, name, None)
            if real is not None:
                setattr(module, name, self._guarded(real, f"{module.__name__}.{name}"))

    def _guarded(self, real, what: str):
        def guarded(*args, **kwargs):
            self._refuse(what)
            return real(*args, **kwargs)

        return guarded

    def _refuse(self, what: str) -> None:
        if self.test is not None:
            test, self.test = self.test, None  # one report; the test fails with it
            self.refused = (f"{test} is marked unit or contract (in-process) but started {what}: "
                            "mark it e2e (tests/conftest.py, docs/testing.md)")
            raise RuntimeError(self.refused)


_GUARD = _InProcessGuard()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    _GUARD.refused = None
    if tier_of(item) in ("unit", "contract"):
        _GUARD.test = item.nodeid
    try:
        result = yield
    finally:
        _GUARD.test = None
        refused, _GUARD.refused = _GUARD.refused, None
    if refused is not None:  # refused in a thread of the test's: the test body itself did not fail
        pytest.fail(refused, pytrace=False)
    return result


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests of the tiers asked for (``--tier``); every test must have a tier."""
    untiered = [item.nodeid for item in items if tier_of(item) is None]
    if untiered:
        raise pytest.UsageError(f"{len(untiered)} test(s) without a tier mark ({', '.join(TIERS)}; see "
                                f"tests/conftest.py): {', '.join(untiered[:10])}")
    tiers = {t.strip() for t in config.getoption("--tier").split(",") if t.strip()}
    if not tiers or tiers - set(TIERS):
        raise pytest.UsageError(f"--tier takes tiers among {', '.join(TIERS)}, got {config.getoption('--tier')!r}")
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (keep if tier_of(item) in tiers else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    if hasattr(config, "workerinput"):  # an xdist worker: the order it reports is the order work is handed out
        known = _recorded_durations()
        items.sort(key=lambda item: _hand_out_order(item, known))


def _hand_out_order(item: pytest.Item, known: dict[str, float]) -> float:
    """Longest first; the files one worker runs keep their order (their module fixtures are built once for it)."""
    if item.nodeid.split("::", 1)[0] in ONE_WORKER_FILES:
        return float("-inf")
    return -known.get(item.nodeid, 0.0)


#: Each slow test's last recorded seconds (setup, call and teardown), by node id: ``--record-durations``.
DURATIONS_FILE = Path(__file__).with_name("durations.json")


def _recorded_durations() -> dict[str, float]:
    """The recorded durations; empty when the file is missing or unreadable (the order is then collection order).

    On two cores the suite is CPU-bound, and tests/train's long end-to-end tests come last in collection
    order: handed out last, they ran alone at the end while the other workers sat idle.  Under xdist the
    tests are handed out longest first instead; a test not in the file counts as short.
    """
    try:
        data = json.loads(DURATIONS_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}


_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each test's setup, call and teardown time, for ``--record-durations``."""
    _SPENT[report.nodeid] = _SPENT.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With ``--record-durations``: merge this run's durations of 1 s or more into tests/durations.json."""
    config = session.config
    if not config.getoption("--record-durations") or hasattr(config, "workerinput"):
        return
    merged = {**_recorded_durations(), **{k: round(v, 1) for k, v in _SPENT.items()}}
    DURATIONS_FILE.write_text(json.dumps({k: v for k, v in sorted(merged.items()) if v >= 1.0}, indent=0) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Keep each phase's report on the test item (``item.report_setup``, ``item.report_call``): the
    fixtures that keep a failed test's evidence ask :func:`tests.evidence.test_failure`."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def agents(tmp_path, request):
    """A :class:`tests.harness.Cluster` whose processes are killed (by PID) after the test; when the
    test failed (a timeout included), every process's stacks are taken first and its directory
    (agents' output, logs) is kept (:mod:`tests.evidence`)."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        why = evidence.test_failure(request.node)
        if why:
            evidence.dump_stacks(c.pids(), tmp_path)
        c.cleanup()
        if why:
            evidence.keep(tmp_path, why, request.node.name, move=False)


@pytest.fixture(scope="session")
def once(tmp_path_factory) -> Callable[[tuple, Callable[[], Any]], Any]:
    """``once(key, compute)``: ``compute()``'s result (JSON), computed once per test run for each ``key``.

    For what is a pure function of its key and costs a job to learn, such as the parameters of a fault-free
    training run that the faulted runs must equal bit for bit.  Shared by the xdist workers of one run
    through its base directory, with a file lock per key: the first test to ask computes, the others wait
    for it and read its result.  A failed ``compute`` stores nothing: the next to ask tries again.
    """
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is popen-gwN, inside this run's directory
        shared = shared.parent
    root = shared / "once"
    root.mkdir(exist_ok=True)

    def get(key: tuple, compute: Callable[[], Any]) -> Any:
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
        result = root / f"{name}.json"
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not result.exists():
                value = compute()
                partial = result.with_suffix(".partial")
                partial.write_text(json.dumps(value))
                partial.rename(result)
            return json.loads(result.read_text())

    return get
