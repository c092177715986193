"""The warm pool's template process: imports torch once, then forks ready-to-run workers.

Started by :class:`elastrun.agent.workers.pool.PoolStarter` before the rendezvous, forked from the
``elastrun`` command's agent once it imported torch (:mod:`elastrun.agent.workers.template_fork`) or
as ``python -c <bootstrap> AGENT_PID SOCKET_FD PRELOAD``, so that its
imports (torch, ``torch._dynamo``, the DDP path, ``torch.distributed`` and the user's
``--preload`` modules: 5 to 7 s on two cores) overlap the round instead of delaying every
worker of every attempt.

Protocol, over a ``SOCK_SEQPACKET`` socketpair (one message per request and per reply, so
message boundaries and the descriptors that travel with them never get mixed up):

- template → agent, once the imports are done: ``{"ready": true, "failed_preload": [...],
  "cuda": false, "threads": 1}``;
- agent → template: a JSON launch request with three descriptors attached (``SCM_RIGHTS``):
  the worker's stdin and the write ends of its stdout and stderr pipes;
- template → agent: ``{"pid": N}`` or ``{"error": "why"}`` (the agent then execs instead).

The template double-forks: its child forks the worker, puts it in its own process group and
exits at once, so the worker is re-parented to the agent (a child subreaper) and the agent
reaps it and sees its real exit status, exactly as for an exec'd child.  The worker waits for
that re-parenting before it sets ``PR_SET_PDEATHSIG=SIGKILL``: a death signal armed earlier
would fire when the intermediate child exits.

The worker is turned into what ``python -u SCRIPT ARGS`` would have been (see
:func:`_become_worker`); then it runs the job and leaves through
:func:`elastrun.worker.bootstrap.run_target`, exactly as an exec'd worker does (exit codes,
atexit handlers, non-daemon threads, flushing, death by SIGINT after ``KeyboardInterrupt``, then
``os._exit`` past the interpreter's teardown).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from elastrun.shared.imports import collector_paused
from elastrun.shared.prctl import set_parent_death_signal
from elastrun.worker.bootstrap import run_target

#: Imports every worker of a torch job pays: ``torch._dynamo`` comes with the first DDP model.
BASE_IMPORTS = ("torch", "torch._dynamo", "torch.nn.parallel", "torch.distributed")
_MAX_MESSAGE = 4 << 20
_REPARENT_TIMEOUT = 5.0

@dataclass
class Job:
    """What a forked worker runs once it has become a worker: a script path or a module name."""

    target: str
    module: bool
    args: list[str]
    error_file: str | None


# ---------------------------------------------------------------------------------------- template
def _import_all(preload: list[str]) -> list[str]:
    """Import the base modules and ``preload`` with the collector paused, then freeze every object this
    process has (:func:`elastrun.shared.imports.collector_paused`); returns the preload modules that failed
    to import.  Those objects are shared by every worker: frozen, no collection in a worker walks them, and
    so none touches (and copies) their pages."""
    failed = []
    with collector_paused(freeze=True):
        for name in BASE_IMPORTS:
            importlib.import_module(name)
        for name in preload:
            try:
                importlib.import_module(name)
            except Exception as exc:  # a bad --preload must not cost the pool: the worker imports it itself
                failed.append(f"{name} ({type(exc).__name__}: {exc})")
    return failed


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


#: What a CUDA driver API call returns before ``cuInit`` (``CUDA_ERROR_NOT_INITIALIZED``).
_CUDA_ERROR_NOT_INITIALIZED = 3


def _mapped_driver() -> str | None:
    """The path of the CUDA driver library mapped into this process, or None."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if "/libcuda.so" in line:
                    return line.split(None, 5)[-1].strip()
    except OSError:
        pass
    return None


def _driver_initialised(path: str) -> bool:
    """Whether the already mapped CUDA driver at ``path`` has been initialised (``cuInit`` called).

    CUDA builds of torch map the driver library at ``import torch`` without initialising it (a
    constructor of cuBLASLt opens it), so a mapped driver alone says nothing: forking is unsafe
    only after ``cuInit``.  Before ``cuInit`` every driver call but a few answers
    ``CUDA_ERROR_NOT_INITIALIZED`` and does nothing else; ``cuDeviceGetCount`` is asked.  The
    library is reached with ``RTLD_NOLOAD`` (never loaded by this check); anything unexpected
    counts as initialised, so a doubt costs the warm pool, never a broken GPU in a worker.
    """
    import ctypes

    try:
        driver = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        count = ctypes.c_int(0)
        return driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED
    except (OSError, AttributeError):
        return True


def _cuda_initialised() -> bool:
    """Whether CUDA was set up in this process: by torch, or by anything else that called ``cuInit``.

    A child forked after ``cuInit`` cannot use the GPU ("initialization error").  torch's own flag
    covers its lazy init; asking the mapped driver covers a ``cuInit`` that torch does not know
    about (``torch.cuda.is_available()`` without NVML, another library).
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    path = _mapped_driver()
    return path is not None and _driver_initialised(path)


def _unsafe_reason() -> str | None:
    """Why forking now would be unsafe, or None."""
    if _cuda_initialised():
        return "CUDA was initialised in the template (by a --preload module)"
    if threading.active_count() != 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.current_thread())
        return f"a --preload module started Python threads ({names})"
    return None


def _send(sock: socket.socket, message: dict) -> bool:
    """Send one message to the agent; False if the agent is gone (it closed its end)."""
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        return False
    return True


def serve(agent_pid: int, sock_fd: int, preload: list[str]) -> Job | None:
    """The template's loop.  Returns None in the template (agent gone), a :class:`Job` in a worker."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != agent_pid:
        os._exit(0)
    sock = socket.socket(fileno=sock_fd)
    failed = _import_all(preload)
    if not _send(sock, {"ready": True, "failed_preload": failed, "cuda": _cuda_initialised(),
                        "threads": _native_threads()}):
        return None  # the agent left while the imports ran (e.g. its rendezvous failed)
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except (ConnectionError, OSError):
            return None
        if not data:
            for fd in fds:
                os.close(fd)
            return None
        request = json.loads(data)
        reason = _unsafe_reason()
        if reason is not None or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            if not _send(sock, {"error": reason or f"expected 3 descriptors, got {len(fds)}"}):
                return None
            continue
        job = _fork_worker(sock, request, fds, agent_pid)
        if job is not None:
            return job


def _fork_worker(sock: socket.socket, request: dict, fds: list[int], agent_pid: int) -> Job | None:
    """Double-fork a worker; returns its :class:`Job` in the worker, None in the template."""
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        # The intermediate child: fork the worker, give it its own process group before the
        # agent can signal it, report its pid and leave (re-parenting the worker to the agent).
        middle_pid = os.getpid()
        try:
            os.close(pid_r)
            worker = os.fork()
            if worker == 0:
                os.close(pid_w)
                return _become_worker(sock, request, fds, agent_pid, middle_pid)
            try:
                os.setpgid(worker, worker)
            except OSError:
                pass  # the worker does the same; whichever comes first wins
            os.write(pid_w, str(worker).encode())
        finally:
            if os.getpid() == middle_pid:
                os._exit(0)
    os.close(pid_w)
    for fd in fds:
        os.close(fd)
    chunks = []
    while True:
        chunk = os.read(pid_r, 64)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(pid_r)
    os.waitpid(middle, 0)
    if not chunks:
        _send(sock, {"error": "the intermediate process did not report a worker pid"})
    else:
        _send(sock, {"pid": int(b"".join(chunks))})
    return None


# ---------------------------------------------------------------------------------------- worker
def _await_reparent(middle_pid: int, agent_pid: int) -> None:
    """Wait until the intermediate child has exited, then die with the agent (or now if it is gone)."""
    deadline = time.monotonic() + _REPARENT_TIMEOUT
    while os.getppid() == middle_pid:
        if time.monotonic() > deadline:
            os._exit(137)
        time.sleep(0.0002)
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != agent_pid:
        os._exit(137)  # the agent died in between: do not run as an orphan


def _reset_signals() -> None:
    """The dispositions a fresh ``python`` starts with, and an empty signal mask."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            current = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        wanted = signal.SIG_DFL
        if sig == signal.SIGINT:
            wanted = signal.default_int_handler
        elif sig in (signal.SIGPIPE, getattr(signal, "SIGXFSZ", None)):
            wanted = signal.SIG_IGN
        if current is not wanted and current is not None:
            try:
                signal.signal(sig, wanted)
            except (OSError, ValueError):
                pass


def _reopen_stdio() -> None:
    """New ``sys.std*`` objects on fds 0-2, as ``python -u`` makes them (unbuffered output)."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding, errors=errors
    )
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding=encoding, errors=errors, write_through=True
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding=encoding, errors="backslashreplace", write_through=True
    )


def _apply_interpreter_settings() -> None:
    """The ``PYTHON*`` settings that can still be applied after start-up, as the new environment says."""
    import faulthandler

    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    elif faulthandler.is_enabled():
        faulthandler.disable()
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))


def _reseed() -> None:
    """Fresh random state for Python, NumPy and torch, drawn from the OS as a new interpreter does.

    Forked children would otherwise all continue the template's generators.  Only torch's CPU
    generator needs it: the CUDA generators are created when the worker initialises CUDA.
    """
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()


def _become_worker(sock: socket.socket, request: dict, fds: list[int], agent_pid: int, middle_pid: int) -> Job:
    """Turn this forked process into the worker ``request`` describes."""
    _await_reparent(middle_pid, agent_pid)
    try:
        os.setpgid(0, 0)
    except OSError:
        pass  # already done by the intermediate child
    sock.detach()  # its descriptor goes with closerange below; no later close of a reused number
    stdin_fd, out_fd, err_fd = fds
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 65536)
    _reset_signals()
    _reopen_stdio()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    target = request["target"]
    module = bool(request["module"])
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(target))
    sys.argv = [target if not module else "-m", *request["args"]]
    _apply_interpreter_settings()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))
    _reseed()
    return Job(target=target, module=module, args=list(request["args"]), error_file=request.get("error_file"))


def main(argv: list[str]) -> None:
    """Entry point of the template process (see the module docstring)."""
    _reset_signals()  # a template forked from the agent would keep the agent's handlers
    agent_pid, sock_fd = int(argv[0]), int(argv[1])
    preload = [name for name in argv[2].split(",") if name] if len(argv) > 2 else []
    job = serve(agent_pid, sock_fd, preload)
    if job is None:
        os._exit(0)
    run_target(job.target, job.module, job.error_file)
