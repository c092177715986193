"""Start the warm pool's template by forking the agent, right after the agent imported torch.

Every agent imports torch (its store client, then ``torch.distributed`` before its first round):
about 1.5 CPU-s.  A template started with exec imports it a second time before its own imports
(``torch._dynamo`` and the DDP path, about 1.3 CPU-s).  Forked from the agent just after that
import, the template starts with torch loaded and pays only its own: a node's start-up costs one
torch import instead of two, a third less CPU (docs/testing.md measured node start-ups at three
quarters of the test suite's CPU; on a busy node that CPU is wall time).

The fork is used only where the child is what a fresh ``python`` that imported torch would be
(:func:`why_not`); elsewhere :class:`~elastrun.agent.workers.pool.PoolStarter` execs the template:

- in the ``elastrun`` command's own process, never in one that calls ``elastrun.launch()`` (it holds
  an application's modules, threads and state);
- torch not imported yet, so that it loads here with the template's environment: ``OMP_NUM_THREADS``
  (read by OpenMP at load) and ``TORCH_CPP_LOG_LEVEL`` (read by c10 at load: the agent quiets its
  own store client afterwards with :func:`reread_cpp_log_level`); or loaded already by
  :func:`~elastrun.shared.imports.import_quickly` with the same load-time variables as the
  template's (the test suite's warm starter, ``tests/warm.py``, forks agents from such a process);
- one thread in the process, before and after the import.

What the child leaves behind of the agent before it serves (:func:`_become_template`): its own
process group, stdin on ``/dev/null`` and every descriptor but stdio and the template's socket
(what ``subprocess`` gives an exec'd template), the template's environment, elastrun's modules (the
template and its workers import what they use, afresh) and the ``elastrun`` loggers' settings; the
template's ``main`` resets the signal dispositions.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence

from elastrun.shared import log
from elastrun.shared.imports import collector_paused, import_quickly, torch_loaded_with

#: The template's own entry point, reached by name in the child: from the fork on, the child is not
#: the agent, and it loads the worker's side of the package as the exec'd template's bootstrap does.
TEMPLATE_MODULE = "elastrun.worker.template"
#: Exit code of a child that could not become the template (the agent then execs its workers).
_FAILED = 70
#: c10's ``initLogging()``: reads ``TORCH_CPP_LOG_LEVEL`` again (torch reads it once, at load).
_INIT_LOGGING = "_ZN3c1011initLoggingEv"
#: Variables the interpreter or a native library (OpenMP, OpenBLAS, MKL, the allocator) reads when it loads.
NATIVE_LOAD_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES", "OPENBLAS_", "GOTO", "MKL_", "KMP_",
                        "GOMP_", "OMP_")
#: Those, and torch's own, that a torch loaded before the template must have loaded with as the template would.
TORCH_LOAD_PREFIXES = (*NATIVE_LOAD_PREFIXES, "TORCH", "PYTORCH", "CUDA", "NCCL")


class ForkedProcess:
    """A child started with ``os.fork``: the parts of :class:`subprocess.Popen` the pool uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (negative: the signal) once the child ended, else None; reaps it."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = 0  # reaped elsewhere: its status is gone
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; raises :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"template {self.pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the child unless it was already reaped (its pid may be someone else's by now)."""
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def why_not(own_process: bool, template_env: Mapping[str, str]) -> str | None:
    """Why the template cannot be forked from this process now, or None."""
    if not own_process:
        return "the agent runs in a caller's process (elastrun.launch)"
    if "torch" in sys.modules:
        loaded = torch_loaded_with()
        if loaded is None:
            return "torch was imported before the template's environment could be applied"
        name = first_difference(loaded, template_env, TORCH_LOAD_PREFIXES)
        if name is not None:
            return f"torch was loaded with another {name} than the template's"
    if threading.active_count() != 1:
        return f"{threading.active_count()} threads run in the agent"
    return None


def first_difference(a: Mapping[str, str], b: Mapping[str, str], prefixes: tuple[str, ...],
                     exempt: frozenset[str] = frozenset()) -> str | None:
    """The first variable named with one of ``prefixes`` (and not in ``exempt``) whose value differs between
    the environments ``a`` and ``b``, or None: where a process loaded with ``a`` cannot stand for one
    loaded with ``b``."""
    for name in sorted(set(a) | set(b)):
        if name.startswith(prefixes) and name not in exempt and a.get(name) != b.get(name):
            return name
    return None


def start(template_env: Mapping[str, str], sock_fd: int, preload: Sequence[str]) -> ForkedProcess | None:
    """Import torch here with ``template_env``, then fork the template; None (nothing started) where
    the import left more than one thread (the caller then execs the template)."""
    # Every object the agent has then (torch's, mostly) leaves the collector's care for good, as Python's
    # gc.freeze() documentation advises before a fork: the template's collections (and the agent's later
    # ones) no longer walk them (0.3 CPU-s less per node start, docs/benchmarks.md), and no collection in
    # either process writes to, and so copies, the pages they share.
    with collector_paused(freeze=True):
        _import_torch(template_env)
    if threading.active_count() != 1:
        return None
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # else the child holds, and may one day write, the same pending bytes
        except (OSError, ValueError):
            pass
    agent_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        _become_template(agent_pid, sock_fd, list(preload), dict(template_env))
    return ForkedProcess(pid)


def reread_cpp_log_level() -> None:
    """Apply ``TORCH_CPP_LOG_LEVEL`` as it is now to this process's c10 logging, if torch is loaded.

    c10 reads the variable once, when torch loads.  An agent that imported torch for its template
    (with the workers' setting) sets its own level afterwards: c10's ``initLogging`` reads it again.
    A torch without that function keeps the level it loaded with (store wait timeouts may then be
    logged as warnings).
    """
    torch = sys.modules.get("torch")
    if torch is None or not os.environ.get("TORCH_CPP_LOG_LEVEL"):
        return
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        getattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD), _INIT_LOGGING)()
    except (OSError, AttributeError) as exc:
        log.get("pool").debug(f"c10 logging level not re-read ({exc})")


def _import_torch(env: Mapping[str, str]) -> None:
    """``import torch.distributed`` with ``os.environ`` set to ``env``, then put the agent's back."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        import_quickly("torch.distributed")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _become_template(agent_pid: int, sock_fd: int, preload: list[str], env: dict[str, str]) -> None:
    """In the forked child: drop what belongs to the agent, then serve as the template.  Never returns."""
    try:
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.clear()
        os.environ.update(env)
        _forget_agent()
        limit = os.sysconf("SC_OPEN_MAX")
        if limit <= 0:
            limit = 65536
        os.closerange(3, sock_fd)
        os.closerange(sock_fd + 1, limit)
        template = importlib.import_module(TEMPLATE_MODULE)
        template.main([str(agent_pid), str(sock_fd), ",".join(preload)])
    except BaseException:  # noqa: BLE001 - the agent hears of it as a template that exited
        traceback.print_exc()
    finally:
        os._exit(_FAILED)


def _forget_agent() -> None:
    """Unload elastrun's modules and put its loggers back as a fresh interpreter has them."""
    for name in [m for m in sys.modules if m == "elastrun" or m.startswith("elastrun.")]:
        del sys.modules[name]
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == log.ROOT or name.startswith(log.ROOT + ".")):
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            logger.setLevel(logging.NOTSET)
            logger.propagate = True
            logger.disabled = False
    # The agent's objects were frozen before the fork: those of the modules just unloaded stay, unreachable,
    # and are never finalised here (no descriptor of the agent's is closed by the template afterwards).
    gc.collect()
