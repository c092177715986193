"""The ``elastrun`` command forks its pool's template from the agent, after the agent imported torch.

The worker of such a template must still look like an exec'd one (``--start-method spawn``, the
reference) and carry nothing of the agent: no agent module, no elastrun logging set up, torch's
C++ log level as torch loads it.  Real launches through ``python -m elastrun``; the probe writes what
the worker sees, including which process its template is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest

from elastrun.agent.workers import template_fork
from elastrun.shared import imports

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

PROBE = textwrap.dedent(
    """
    import atexit, ctypes, gc, json, logging, os, signal, sys, warnings
    import psutil, torch, torch._dynamo  # the DDP path: what a forked worker has loaded already

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"), mode=os.RTLD_NOLOAD)
    agent = psutil.Process(os.getppid())

    def cmdline(p):
        try:
            return p.cmdline()
        except psutil.Error:  # the other worker, finished: a zombie until the agent reaps it, or gone
            return None

    others = [c for c in (cmdline(p) for p in agent.children() if p.pid != os.getpid()) if c is not None]
    elastrun_logger = logging.getLogger("elastrun")
    report = {
        "agent_cmdline": agent.cmdline(), "other_children": others,
        "cpp_log_level": ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level").value,
        "modules": sorted(m for m in sys.modules if m == "elastrun" or m.startswith("elastrun.")),
        "elastrun_logger": [elastrun_logger.level, len(elastrun_logger.handlers), elastrun_logger.propagate],
        "root_handlers": len(logging.getLogger().handlers), "warning_filters": len(warnings.filters),
        "atexit": atexit._ncallbacks(), "argv": sys.argv, "sys_path0": sys.path[0], "cwd": os.getcwd(),
        "fds": sorted(os.listdir("/proc/self/fd")), "pgid_is_pid": os.getpgid(0) == os.getpid(),
        "sigterm": str(signal.getsignal(signal.SIGTERM)), "sigint": str(signal.getsignal(signal.SIGINT)),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "TORCH_", "PYTORCH_"))},
        "torch_threads": torch.get_num_threads(), "gc_enabled": gc.isenabled(),
        "frozen": gc.get_freeze_count(),
    }
    with open(sys.argv[1], "w") as fh:
        json.dump(report, fh)
    """
)

#: Modules of the agent's side that a worker must not inherit from the agent it was forked under.
AGENT_MODULES = ("elastrun.agent", "elastrun.cli", "elastrun.launcher", "elastrun.rendezvous", "elastrun.config")


def _probe(tmp_path: Path, method: str) -> tuple[dict, str]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / f"{method}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CPP_LOG_LEVEL", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [PYTHON, "-m", "elastrun", "--standalone", "--nproc-per-node=2", f"--start-method={method}", "-v",
         str(script), str(out)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stderr


@pytest.mark.e2e
def test_the_command_forks_its_template_and_the_worker_keeps_nothing_of_the_agent(tmp_path):
    forked, log_f = _probe(tmp_path, "fork")
    execd, _ = _probe(tmp_path, "spawn")
    # The template is the agent's fork: it runs the agent's command line, not the exec'd bootstrap.
    assert forked["agent_cmdline"] in forked["other_children"], forked["other_children"]
    assert "not forked from the agent" not in log_f and "starting workers with exec" not in log_f
    assert not [m for m in forked["modules"] if m.startswith(AGENT_MODULES)], forked["modules"]
    for key in ("cpp_log_level", "elastrun_logger", "root_handlers", "warning_filters", "atexit", "sys_path0",
                "cwd", "fds", "pgid_is_pid", "sigterm", "sigint", "env", "torch_threads", "gc_enabled"):
        assert forked[key] == execd[key], key
    assert forked["env"]["OMP_NUM_THREADS"] == "1" and forked["torch_threads"] == 1
    assert forked["gc_enabled"]  # the template imports with its collector paused, and puts it back
    # torch's objects reach the worker frozen (no collection there walks, and so copies, their pages);
    # an exec'd worker has frozen nothing.
    assert forked["frozen"] > 100_000 and execd["frozen"] == 0, (forked["frozen"], execd["frozen"])
    assert "TORCH_CPP_LOG_LEVEL" not in forked["env"]  # the agent's own setting stays the agent's


@pytest.mark.e2e
def test_reread_cpp_log_level_applies_the_variable_to_a_loaded_torch():
    program = textwrap.dedent(
        """
        import ctypes, os
        import torch
        from elastrun.agent.workers.template_fork import reread_cpp_log_level
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        level = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
        before = level.value
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        reread_cpp_log_level()
        print(before, level.value)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([PYTHON, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "2"]  # torch's default WARNING, then ERROR


@pytest.mark.unit
def test_why_not_refuses_a_callers_process_and_a_loaded_torch(monkeypatch):
    env = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert "elastrun.launch" in (template_fork.why_not(False, env) or "")
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())
    monkeypatch.setattr(imports, "_torch_env", None)
    assert "torch was imported" in (template_fork.why_not(True, env) or "")
    monkeypatch.delitem(sys.modules, "torch")
    threads = threading.active_count()
    assert template_fork.why_not(True, env) == (None if threads == 1 else f"{threads} threads run in the agent")


@pytest.mark.unit
def test_a_torch_that_elastrun_loaded_with_the_templates_load_time_variables_may_be_forked(monkeypatch):
    """The warm starter's case (tests/warm.py): torch loaded through import_quickly, with the variables
    that the template would load it with; any other variable may differ (the agent's own)."""
    template_env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/repo", "TORCH_CPP_LOG_LEVEL": "ERROR", "PATH": "/bin"}
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())
    monkeypatch.setattr(imports, "_torch_env", {**template_env, "PATH": "/usr/bin", "RUN_ID": "x"})
    threads = threading.active_count()
    expected = None if threads == 1 else f"{threads} threads run in the agent"
    assert template_fork.why_not(True, template_env) == expected
    for name, value in (("OMP_NUM_THREADS", "2"), ("PYTHONPATH", "/other"), ("TORCH_CPP_LOG_LEVEL", None),
                        ("LD_PRELOAD", "libx.so")):
        loaded = {**template_env, name: value} if value is not None else {
            k: v for k, v in template_env.items() if k != name}
        monkeypatch.setattr(imports, "_torch_env", loaded)
        assert template_fork.why_not(True, template_env) == f"torch was loaded with another {name} than the template's"


@pytest.mark.unit
def test_import_quickly_remembers_the_environment_only_where_it_loaded_torch(monkeypatch):
    fake = types.ModuleType("torch")

    def load(name: str) -> types.ModuleType:
        return sys.modules.setdefault(name, fake)

    monkeypatch.setattr(imports.importlib, "import_module", load)
    monkeypatch.setattr(imports, "_torch_env", None)
    monkeypatch.setitem(sys.modules, "torch", fake)  # loaded before, by someone else
    imports.import_quickly("torch")
    assert imports.torch_loaded_with() is None
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert imports.import_quickly("torch") is fake
    assert (imports.torch_loaded_with() or {}).get("OMP_NUM_THREADS") == "3"
