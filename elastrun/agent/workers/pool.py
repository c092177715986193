"""The warm worker pool: workers forked from a template that has already imported torch.

``import torch`` costs about 2.5 s on two cores and the first DDP model pulls in
``torch._dynamo`` for 2 to 4 s more; torchrun pays that in every worker, at every restart, all
workers at once on the same cores.  :class:`PoolStarter` pays it once per agent, in a template
process (:mod:`elastrun.worker.template`) started by :meth:`PoolStarter.prepare` before the
rendezvous, and then forks each worker in milliseconds.

How a forked worker stays a normal child of the agent:

- the agent becomes a *child subreaper* (``PR_SET_CHILD_SUBREAPER``) and the template
  double-forks, so the worker is re-parented to the agent: the agent ``waitpid``s it, watches it
  through a pidfd and sees its real exit code or signal, as for an exec'd worker;
- the worker leads its own process group and dies with the agent (``PR_SET_PDEATHSIG``, armed
  once it is the agent's child); the template dies with the agent too, so a SIGKILLed agent
  leaves nothing behind;
- its stdin and the write ends of the same stdout/stderr pipes an exec'd worker would get travel
  to the template with the launch request (``SCM_RIGHTS``), so log pumps, prefixes, files, tee
  and rank filters are unchanged.

Where forking is not safe the starter execs instead and says so once: no template (it died or
failed to start), CUDA initialised or threads started in the template by a ``--preload``
module, a worker environment that changes what the interpreter or its libraries read at load
time (``PYTHON*``, ``LD_*``, allocator and BLAS/OpenMP settings other than
``OMP_NUM_THREADS``), or a launch that is not a Python script or module (``--no-python``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from elastrun.agent.workers import template_fork
from elastrun.agent.workers.spawn import ChildHandle, ExecStarter, StreamSet
from elastrun.agent.workers.starter import WorkerHandle, WorkerLaunch, WorkerStarter
from elastrun.config import LaunchConfig
from elastrun.shared import log
from elastrun.shared.prctl import child_subreaper, set_child_subreaper

#: ``--start-method`` values served by the pool (``fork``, the default); "spawn" execs every worker.
POOL_METHODS = ("fork", "forkserver")
#: How long a start waits for the template's imports before giving up on the pool.
READY_TIMEOUT = 300.0
#: How long a start waits for the template to fork once it is ready.
FORK_TIMEOUT = 30.0
#: Variables read when the interpreter or a native library loads: a worker whose value differs
#: from the template's cannot be forked from it faithfully.
LOAD_TIME_PREFIXES = template_fork.NATIVE_LOAD_PREFIXES
#: Load-time variables the worker applies itself after the fork.
APPLIED_IN_WORKER = frozenset({"PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE",
                               "OMP_NUM_THREADS"})

_BOOTSTRAP = (
    "import sys\n"
    "sys.path[0] = {root!r}\n"
    "from elastrun.worker.template import main\n"
    "main(sys.argv[1:])\n"
)

def template_environment(base: Mapping[str, str], nproc: int) -> dict[str, str]:
    """The template's environment: the workers' base, with the thread count they will get.

    ``OMP_NUM_THREADS`` is read by OpenMP and OpenBLAS when they load, so the template must load
    them with the value the workers get (1 when unset and several workers share the node, the
    rule of :func:`elastrun.agent.launches.worker_environment`).  It also keeps OpenBLAS from
    starting its thread pool in the template.
    """
    env = dict(base)
    if "OMP_NUM_THREADS" not in env and nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    # A CUDA availability check during the imports asks NVML instead of initialising the driver,
    # which would make every forked worker unable to use the GPU.  Read when called, not at load.
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return env


def load_time_mismatch(template_env: Mapping[str, str], worker_env: Mapping[str, str]) -> str | None:
    """The first load-time variable whose value differs between template and worker, or None."""
    return template_fork.first_difference(template_env, worker_env, LOAD_TIME_PREFIXES, APPLIED_IN_WORKER)


class PoolHandle(ChildHandle):
    """A forked worker, re-parented to the agent: reaped with ``waitpid``, watched through a pidfd."""

    start_method = "fork-pool"

    def close(self) -> None:
        super().close()
        self._reap_adopted()

    def _reap_adopted(self) -> None:
        """Reap the worker's own children that the agent adopted (same process group) when it died."""
        for _ in range(1024):
            try:
                pid, _status = os.waitpid(-self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return


class PoolStarter(WorkerStarter):
    """Forks workers from a warm template; execs (with a one-line notice) where it cannot."""

    name = "fork-pool"

    def __init__(self, config: LaunchConfig, base_env: Mapping[str, str] | None = None,
                 own_process: bool = False) -> None:
        self.config = config
        #: Whether this process is the ``elastrun`` command's own, so the template may be forked from it.
        self.own_process = own_process
        self.template_env = template_environment(base_env if base_env is not None else os.environ,
                                                 config.nproc_per_node)
        self._exec = ExecStarter()
        self._proc: subprocess.Popen | template_fork.ForkedProcess | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._broken: str | None = None
        self._noticed: set[str] = set()
        self._was_subreaper: bool | None = None

    # ------------------------------------------------------------------ life cycle
    def prepare(self) -> None:
        """Become a child subreaper and start the template (its imports run in the background).

        In the ``elastrun`` command's own process the template is forked from it after it imported
        torch (:mod:`elastrun.agent.workers.template_fork`: one torch import per node, not two);
        elsewhere it is exec'd.
        """
        if self._proc is not None or self._broken is not None:
            return
        try:
            self._was_subreaper = child_subreaper()
            set_child_subreaper(True)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as exc:
            self._give_up(f"cannot set up the template ({exc})")
            return
        reason = template_fork.why_not(self.own_process, self.template_env)
        if reason is None:
            try:
                self._proc = template_fork.start(self.template_env, theirs.fileno(), self.config.preload)
                if self._proc is None:
                    reason = "importing torch started threads in the agent"
            except OSError as exc:
                reason = f"fork failed ({exc})"
        if self._proc is not None:
            theirs.close()
            self._sock = ours
            return
        log.get("pool").debug(f"warm pool: template exec'd, not forked from the agent: {reason}")
        root = str(Path(__file__).resolve().parents[3])
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP.format(root=root), str(os.getpid()), str(theirs.fileno()),
                 ",".join(self.config.preload)],
                env=self.template_env,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                process_group=0,
            )
        except OSError as exc:
            ours.close()
            self._give_up(f"cannot start the template ({exc})")
            return
        finally:
            theirs.close()
        self._sock = ours

    def close(self) -> None:
        """Stop the template and stop adopting orphans (when this starter turned that on)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if not self._ready and self._proc.poll() is None:
                self._proc.kill()  # still importing: it has nothing to finish
            try:
                self._proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._was_subreaper is False:
            try:
                set_child_subreaper(False)
            except OSError:
                pass
            self._was_subreaper = None

    def ready_fileno(self) -> int | None:
        """The template's socket while its first message (ready, or the end of file of its death) is due."""
        if self._ready or self._broken is not None or self._sock is None:
            return None
        return self._sock.fileno()

    @property
    def template_pid(self) -> int | None:
        """PID of the template process, while it runs."""
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------ starting workers
    def start(self, launch: WorkerLaunch) -> WorkerHandle:
        reason = self._why_not_fork(launch)
        if reason is not None:
            self._notice(reason)
            return self._exec.start(launch)
        streams = StreamSet(launch)
        try:
            pid = self._request_fork(launch, streams)
        except OSError as exc:
            streams.abandon()
            self._give_up(f"the template failed ({exc})")
            self._notice(self._broken or "")
            return self._exec.start(launch)
        streams.start()
        return PoolHandle(launch, pid, streams)

    def _why_not_fork(self, launch: WorkerLaunch) -> str | None:
        if launch.python_target is None:
            return "--no-python workers are always exec'd"
        if self._sock is None and self._broken is None:
            self.prepare()
        if self._broken is not None:
            return self._broken
        if not self._ready:
            self._await_ready()
            if self._broken is not None:
                return self._broken
        name = load_time_mismatch(self.template_env, launch.env)
        if name is not None:
            return f"{name} differs from the template's, which read it at start-up"
        return None

    def _await_ready(self) -> None:
        try:
            reply = self._receive(READY_TIMEOUT)
        except OSError as exc:
            self._give_up(f"the template did not start ({exc})")
            return
        self._ready = True
        if reply.get("failed_preload"):
            self._notice(f"--preload could not import {'; '.join(reply['failed_preload'])}", broken=False)
        if reply.get("cuda"):
            self._give_up("CUDA was initialised in the template by a --preload module")

    def _request_fork(self, launch: WorkerLaunch, streams: StreamSet) -> int:
        assert self._sock is not None and launch.python_target is not None
        request = {
            "env": launch.env,
            "cwd": launch.cwd,
            "target": launch.python_target,
            "module": launch.python_module,
            "args": launch.python_args,
            "error_file": str(launch.error_file) if launch.error_file is not None else None,
        }
        stdin_fd, own_stdin = _stdin_fd()
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [stdin_fd, streams.out_w, streams.err_w])
        finally:
            if own_stdin:
                os.close(stdin_fd)
        reply = self._receive(FORK_TIMEOUT)
        if "pid" not in reply:
            raise OSError(reply.get("error", f"unexpected reply {reply!r}"))
        return int(reply["pid"])

    def _receive(self, timeout: float) -> dict:
        assert self._sock is not None
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            raise OSError(f"no answer from the template within {timeout:g} s")
        data = self._sock.recv(1 << 16)
        if not data:
            code = self._proc.poll() if self._proc is not None else None
            raise OSError("the template exited" + (f" with code {code}" if code is not None else ""))
        return json.loads(data)

    # ------------------------------------------------------------------ fallbacks
    def _give_up(self, reason: str) -> None:
        """Stop using the template for good (every later worker is exec'd)."""
        if self._broken is None:
            self._broken = reason
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()
            self._proc = None

    def _notice(self, reason: str, broken: bool = True) -> None:
        if reason in self._noticed:
            return
        self._noticed.add(reason)
        suffix = "; starting workers with exec" if broken else ""
        log.get("pool").warning(f"warm pool: {reason}{suffix}")


def _stdin_fd() -> tuple[int, bool]:
    """The agent's stdin for the worker (what an exec'd worker inherits), or /dev/null if closed."""
    try:
        os.fstat(0)
        return 0, False
    except OSError:
        return os.open(os.devnull, os.O_RDONLY), True


def select_starter(config: LaunchConfig, base_env: Mapping[str, str] | None = None,
                   own_process: bool = False) -> WorkerStarter:
    """The starter for ``config``: the warm pool unless ``--start-method spawn`` or ``--no-python``.

    ``base_env`` is the environment the workers are built from (default: ``os.environ``);
    ``own_process``: this is the ``elastrun`` command's process (see :class:`PoolStarter`).
    """
    if config.no_python or config.start_method not in POOL_METHODS:
        return ExecStarter()
    if not sys.platform.startswith("linux"):
        return ExecStarter()
    return PoolStarter(config, base_env, own_process)
