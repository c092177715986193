"""The warm pool: a forked worker must look, to its script, exactly like an exec'd one.

The tests start a real template (torch imported once) and real workers running a probe script
that writes what it sees (argv, environment, descriptors, process group, RNG draws...) to a
JSON file; the same probe run through ``ExecStarter`` is the reference.  The last tests run
whole launches through the pool: real DDP on gloo with a restart, the Python API, and an agent
SIGKILLed under its template and workers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from elastrun.agent.workers.pool import PoolHandle, PoolStarter, select_starter
from elastrun.agent.workers.spawn import ChildHandle, ExecStarter
from elastrun.agent.workers.starter import WorkerLaunch
from elastrun.config import LaunchConfig
from elastrun.shared import log
from elastrun.shared.protocol import exec_argv

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

PROBE = textwrap.dedent(
    """
    import json, os, random, signal, sys, time
    import numpy, torch

    out, mode = sys.argv[1], sys.argv[2]
    if mode == "handler":
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), os._exit(7)))
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the descriptor of the listing itself
    report = {
        "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ),
        "pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(), "sys_path0": sys.path[0],
        "fds": sorted(fds), "stdin": fds.get("0"),
        "stdout_unbuffered": type(sys.stdout.buffer).__name__, "write_through": sys.stdout.write_through,
        "random": random.random(), "numpy": float(numpy.random.random()),
        "torch_seed": torch.initial_seed(), "torch_threads": torch.get_num_threads(),
        "sigterm": str(signal.getsignal(signal.SIGTERM)), "sigint": str(signal.getsignal(signal.SIGINT)),
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    }
    with open(out + ".tmp", "w") as fh:
        json.dump(report, fh)
    os.replace(out + ".tmp", out)
    print("probe stdout line")
    print("probe stderr line", file=sys.stderr)
    if mode.startswith("exit"):
        sys.exit(int(mode[4:]))
    if mode == "raise":
        def inner():
            raise ValueError("probe failure")
        inner()
    if mode in ("sleep", "handler"):
        time.sleep(60)
    """
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return path


@pytest.fixture(scope="module")
def pool():
    starter = PoolStarter(LaunchConfig(entrypoint="probe.py", nproc_per_node=2))
    starter.prepare()
    yield starter
    starter.close()


def make_launch(tmp: Path, probe: Path, tag: str, mode: str = "exit0", env: dict | None = None,
                bootstrap: bool = False) -> WorkerLaunch:
    """A launch of the probe; exec'd as plain ``python -u probe``, or through elastrun's bootstrap."""
    report = tmp / f"{tag}.json"
    worker_env = dict(os.environ, RANK="0", LOCAL_RANK="0", OMP_NUM_THREADS="1", PROBE_TAG=tag,
                      TORCHELASTIC_ERROR_FILE=str(tmp / f"{tag}.error.json"))
    worker_env.update(env or {})
    args = [str(report), mode]
    return WorkerLaunch(
        local_rank=0, rank=0,
        argv=exec_argv(PYTHON, str(probe), False, args) if bootstrap else [PYTHON, "-u", str(probe), *args],
        env=worker_env, cwd=str(tmp),
        stdout_path=tmp / f"{tag}.out", stderr_path=tmp / f"{tag}.err",
        error_file=tmp / f"{tag}.error.json",
        python_target=str(probe), python_args=[str(report), mode],
    )


def run_to_end(starter, launch: WorkerLaunch, timeout: float = 60.0):
    handle = starter.start(launch)
    status = handle.wait(timeout)
    assert status is not None, f"worker {handle.pid} did not end within {timeout} s"
    handle.close()
    return handle, status


def await_report(path: Path, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no report at {path}"
        time.sleep(0.05)
    return json.loads(path.read_text())


@pytest.mark.parametrize("how", ["fork", "bootstrap"])
def test_worker_looks_like_a_plain_python_one(pool, probe, tmp_path, how):
    """Forked from the pool, or exec'd through the bootstrap: what ``python -u probe.py`` would see."""
    execd, status_e = run_to_end(ExecStarter(), make_launch(tmp_path, probe, "exec"))
    starter = pool if how == "fork" else ExecStarter()
    forked, status_f = run_to_end(starter, make_launch(tmp_path, probe, "fork", bootstrap=how == "bootstrap"))
    assert isinstance(forked, PoolHandle if how == "fork" else ChildHandle) and isinstance(execd, ChildHandle)
    assert status_e.exitcode == status_f.exitcode == 0
    e, f = (json.loads((tmp_path / f"{t}.json").read_text()) for t in ("exec", "fork"))
    assert f["name"] == "__main__"
    assert f["argv"] == [str(probe), str(tmp_path / "fork.json"), "exit0"]
    assert e["argv"] == [str(probe), str(tmp_path / "exec.json"), "exit0"]
    for key in ("cwd", "sys_path0", "fds", "stdin", "stdout_unbuffered", "write_through",
                "torch_threads", "sigterm", "sigint", "blocked"):
        assert f[key] == e[key], key
    assert f["fds"] == ["0", "1", "2"], "descriptors leaked from the template"
    for key in ("PROBE_TAG", "TORCHELASTIC_ERROR_FILE"):
        e["env"].pop(key), f["env"].pop(key)
    assert f["env"] == e["env"]
    assert f["pgid"] == f["pid"] == forked.pid, "the worker must lead its own process group"
    assert f["ppid"] == os.getpid() == e["ppid"], "the worker must be the agent's child"
    for tag in ("fork", "exec"):
        assert (tmp_path / f"{tag}.out").read_text() == "probe stdout line\n"
        assert (tmp_path / f"{tag}.err").read_text() == "probe stderr line\n"


def test_fresh_random_state_in_every_worker(pool, probe, tmp_path):
    reports = []
    for i in range(3):
        run_to_end(pool, make_launch(tmp_path, probe, f"w{i}"))
        reports.append(json.loads((tmp_path / f"w{i}.json").read_text()))
    assert len({r["random"] for r in reports}) == 3, "Python's random state is shared between workers"
    assert len({r["numpy"] for r in reports}) == 3, "NumPy's random state is shared between workers"
    assert len({r["torch_seed"] for r in reports}) == 3, "torch's random state is shared between workers"


def test_omp_num_threads_is_honoured(pool, probe, tmp_path):
    run_to_end(pool, make_launch(tmp_path, probe, "omp", env={"OMP_NUM_THREADS": "3"}))
    assert json.loads((tmp_path / "omp.json").read_text())["torch_threads"] == 3


def _still_running(pid: int, tmp: Path, tag: str) -> str:
    """What a worker that did not end after its signal was doing (each thread's state, wait channel and
    blocked and pending signals, its output), before it is killed: the evidence of a rare failure."""
    threads = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
            wchan = (task / "wchan").read_text()
        except OSError:
            continue
        threads.append(f"{task.name} {status.get('Name', '?').strip()} {status.get('State', '?').strip()} "
                       f"wchan={wchan} blocked={status.get('SigBlk', '?').strip()} "
                       f"pending={status.get('SigPnd', '?').strip()} shared={status.get('ShdPnd', '?').strip()}")
    os.kill(pid, signal.SIGKILL)
    output = " | ".join(p.read_text()[-500:] for p in (tmp / f"{tag}.out", tmp / f"{tag}.err") if p.exists())
    return f"still running 30 s after the signal; threads: {'; '.join(threads)}; output: {output}"


@pytest.mark.parametrize("how", ["fork", "bootstrap"])
def test_exit_codes_exceptions_and_signals(pool, probe, tmp_path, how):
    starter = pool if how == "fork" else ExecStarter()
    boot = how == "bootstrap"
    _, status = run_to_end(starter, make_launch(tmp_path, probe, "code", "exit3", bootstrap=boot))
    assert (status.exitcode, status.signal) == (3, None)

    _, status = run_to_end(starter, make_launch(tmp_path, probe, "raise", "raise", bootstrap=boot))
    assert status.exitcode == 1
    err = (tmp_path / "raise.err").read_text()
    assert err.splitlines()[1].startswith("Traceback (most recent call last):")
    assert "ValueError: probe failure" in err
    assert "template.py" not in err and "bootstrap.py" not in err and "runpy" not in err
    assert "ValueError: probe failure" in (tmp_path / "raise.error.json").read_text()

    for mode, sig, expected in (("sleep", signal.SIGTERM, (None, signal.SIGTERM)),
                                ("handler", signal.SIGTERM, (7, None)),
                                ("sleep", signal.SIGINT, (None, signal.SIGINT))):
        tag = f"{mode}-{sig}"
        launch = make_launch(tmp_path, probe, tag, mode, bootstrap=boot)
        handle = starter.start(launch)
        await_report(tmp_path / f"{tag}.json")
        handle.send_signal(sig)
        status = handle.wait(30)
        seen = "" if status is not None else _still_running(handle.pid, tmp_path, tag)
        handle.close()
        assert status is not None and (status.exitcode, status.signal) == expected, f"{tag}: {seen}"


def test_fallbacks_exec_with_a_notice(pool, probe, tmp_path, capfd):
    assert isinstance(select_starter(LaunchConfig(entrypoint="x", start_method="spawn")), ExecStarter)
    assert isinstance(select_starter(LaunchConfig(entrypoint="x", no_python=True, start_method="fork")),
                      ExecStarter)
    assert isinstance(select_starter(LaunchConfig(entrypoint="x", start_method="fork")), PoolStarter)
    # An interpreter setting that the template read at its start cannot be changed by forking.
    handle, status = run_to_end(pool, make_launch(tmp_path, probe, "hashseed", env={"PYTHONHASHSEED": "123"}))
    assert isinstance(handle, ChildHandle) and status.exitcode == 0
    assert "PYTHONHASHSEED differs" in capfd.readouterr().err


def test_dead_template_falls_back_to_exec(probe, tmp_path, capfd):
    starter = PoolStarter(LaunchConfig(entrypoint="probe.py"))
    starter.prepare()
    try:
        os.kill(starter.template_pid, signal.SIGKILL)
        handle, status = run_to_end(starter, make_launch(tmp_path, probe, "dead"))
        assert isinstance(handle, ChildHandle) and status.exitcode == 0
        assert "the template did not start" in capfd.readouterr().err
    finally:
        starter.close()


SLEEPER = textwrap.dedent(
    """
    import os, sys, time
    open(os.path.join(sys.argv[1], f"pid{os.environ['LOCAL_RANK']}"), "w").write(str(os.getpid()))
    time.sleep(120)
    """
)


def test_no_orphans_after_agent_sigkill(tmp_path):
    """A SIGKILLed agent (the default start method) leaves neither its template nor its workers running."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    agent = subprocess.Popen(
        [PYTHON, "-m", "elastrun", "--standalone", "--nproc-per-node=2", "--start-method=fork",
         str(script), str(tmp_path)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        pids = []
        deadline = time.monotonic() + 90
        for rank in (0, 1):
            path = tmp_path / f"pid{rank}"
            while not path.exists() or not path.read_text():
                assert time.monotonic() < deadline and agent.poll() is None, "workers did not start"
                time.sleep(0.05)
            pids.append(int(path.read_text()))
        children = {p.pid for p in psutil.Process(agent.pid).children()}
        assert set(pids) <= children, "forked workers must be the agent's children"
        template = children - set(pids)
        assert len(template) == 1
        agent.kill()
        agent.wait(10)
        deadline = time.monotonic() + 10
        left = set(pids) | template
        while left and time.monotonic() < deadline:
            left = {p for p in left if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"}
            time.sleep(0.05)
        assert not left, f"orphans left running: {left}"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_ddp_job_through_the_pool_recovers(tmp_path):
    logs = tmp_path / "logs"
    steps = tmp_path / "steps"
    steps.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), STEPS_LOG=str(steps), STEPS="6", STEP_SECONDS="0.01",
               CRASH_AT_STEP="3", CRASH_RANK="1", CRASH_ONCE_FILE=str(tmp_path / "crashed"))
    proc = subprocess.run(
        [PYTHON, "-m", "elastrun", "--standalone", "--nproc-per-node=2", "--start-method=fork",
         "--max-restarts=1", f"--log-dir={logs}", str(ROOT / "tests" / "scripts" / "steps.py")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        lines = (steps / f"rank{rank}.log").read_text().splitlines()
        assert any(line.endswith("gen 0") or " gen 0 " in line for line in lines)
        assert sum(" gen 1 " in line for line in lines) == 6, lines
    events = [json.loads(line) for path in logs.glob("events-*.jsonl") for line in path.read_text().splitlines()]
    starts = [e for e in events if e["event"] == "worker_start"]
    assert len(starts) == 4
    assert {e["start_method"] for e in starts} == {"fork-pool"}
    assert "starting workers with exec" not in proc.stderr


def _where_am_i() -> tuple[int, bool]:
    import sys as _sys

    return os.getppid(), "torch._dynamo" in _sys.modules


def test_python_api_launch_uses_the_pool(tmp_path, monkeypatch):
    from elastrun.launcher import launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    config = LaunchConfig(entrypoint="", nproc_per_node=2, standalone=True, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", start_method="fork", quiet=True)
    results = launch(config, _where_am_i)
    assert results == {0: (os.getpid(), True), 1: (os.getpid(), True)}


_STUB_DRIVER = """
static int initialised;
int cuInit(unsigned int flags) { (void)flags; initialised = 1; return 0; }
int cuDeviceGetCount(int *count) { if (!initialised) return 3; *count = 0; return 0; }
"""


@pytest.fixture(scope="module")
def stub_driver(tmp_path_factory) -> Path:
    """A stand-in for the NVIDIA driver library, named as it is: it answers as the real one does
    before and after ``cuInit`` (``CUDA_ERROR_NOT_INITIALIZED``, then success)."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in driver library")
    folder = tmp_path_factory.mktemp("driver")
    (folder / "stub.c").write_text(_STUB_DRIVER)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"), str(folder / "stub.c")],
                   check=True, capture_output=True, timeout=60)
    return folder / "libcuda.so.1"


def _pool_with_preload(tmp_path, monkeypatch, probe, preload: str, name: str):
    """Start a template whose --preload module runs ``preload``; run one worker through it."""
    (tmp_path / f"{name}.py").write_text(preload)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{ROOT}")
    log.configure()  # the default console level (an earlier launch() in this process may have set -q)
    starter = PoolStarter(LaunchConfig(entrypoint="probe.py", preload=[name]))
    starter.prepare()
    try:
        return run_to_end(starter, make_launch(tmp_path, probe, name, env={"PYTHONPATH": os.environ["PYTHONPATH"]}))
    finally:
        starter.close()


def test_cuda_driver_mapped_but_not_initialised_keeps_the_pool(probe, stub_driver, tmp_path, capfd, monkeypatch):
    """CUDA builds of torch map the driver at ``import torch`` without ``cuInit``: still safe to fork.

    (Before this was known, every GPU host lost the warm pool: the workers were exec'd after the
    template's imports, and a one-worker NCCL job started seconds later than under torchrun.)
    """
    handle, status = _pool_with_preload(tmp_path, monkeypatch, probe,
                                        f"import ctypes\nctypes.CDLL({str(stub_driver)!r})\n", "maps_driver")
    assert isinstance(handle, PoolHandle), capfd.readouterr().err
    assert status.exitcode == 0
    assert "CUDA was initialised" not in capfd.readouterr().err


def test_cuda_driver_initialised_in_the_template_means_exec(probe, stub_driver, tmp_path, capfd, monkeypatch):
    """A --preload that calls ``cuInit`` (torch would not know) must not be forked from."""
    handle, status = _pool_with_preload(
        tmp_path, monkeypatch, probe,
        f"import ctypes\nassert ctypes.CDLL({str(stub_driver)!r}).cuInit(0) == 0\n", "inits_driver")
    assert isinstance(handle, ChildHandle) and not isinstance(handle, PoolHandle)
    assert status.exitcode == 0
    assert "CUDA was initialised in the template" in capfd.readouterr().err
