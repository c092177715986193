"""Starting workers as fresh processes (``--start-method spawn``) and handling them afterwards.

Each worker:

- leads its own process group, so the agent signals the worker *and* its children (DataLoader
  workers, subprocesses) with one ``killpg``, and a Ctrl-C on the terminal reaches only the
  agent, which forwards it once;
- dies with the agent: a small exec shim sets ``PR_SET_PDEATHSIG=SIGKILL`` and checks that the
  agent is still its parent before exec'ing the real command, so even a SIGKILLed agent leaves
  no orphan (torchrun's workers keep running);
- is watched through a pidfd, so the agent wakes the moment a worker exits instead of polling.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastrun.agent.workers.logs import StreamPump, tail_text
from elastrun.agent.workers.starter import ExitStatus, WorkerHandle, WorkerLaunch, WorkerStarter
from elastrun.shared.log import CONSOLE_LOCK

# Runs under ``python -S``: set the parent-death signal (prctl(PR_SET_PDEATHSIG), spelled out: this
# bare interpreter cannot import elastrun.shared.prctl), make sure the agent did not die before
# that, then become the real worker.  argv: shim, agent_pid, program, args...
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys\n"
    "libc=ctypes.CDLL(None,use_errno=True)\n"
    "libc.prctl(1,signal.SIGKILL,0,0,0)\n"
    "os.getppid()==int(sys.argv[1]) or os._exit(137)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def _shim_argv(argv: list[str]) -> list[str]:
    return [sys.executable, "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]


class StreamSet:
    """The pipes and pumps of one worker's stdout and stderr."""

    def __init__(self, launch: WorkerLaunch) -> None:
        console_out = sys.stdout.buffer if launch.show_on_console else None
        console_err = sys.stderr.buffer if launch.show_on_console else None
        # A redirected stream goes to its file only, unless tee'd.
        if launch.stdout_path is not None and not launch.tee_stdout:
            console_out = None
        if launch.stderr_path is not None and not launch.tee_stderr:
            console_err = None
        out_r, self.out_w = os.pipe()
        err_r, self.err_w = os.pipe()
        self.out = StreamPump(out_r, console_out, CONSOLE_LOCK, launch.console_prefix, launch.stdout_path, False)
        self.err = StreamPump(err_r, console_err, CONSOLE_LOCK, launch.console_prefix, launch.stderr_path, True,
                              hold_when=launch.error_file)

    def start(self) -> None:
        """Close the agent's copies of the write ends (the child holds them) and start pumping."""
        os.close(self.out_w)
        os.close(self.err_w)
        self.out.start()
        self.err.start()

    def abandon(self) -> None:
        """Undo a failed start."""
        for fd in (self.out_w, self.err_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def join(self, timeout: float = 2.0) -> None:
        self.out.join(timeout)
        self.err.join(timeout)


def exit_status_from_wait(status: int) -> ExitStatus:
    """Turn a ``waitpid`` status into an :class:`ExitStatus`."""
    if os.WIFSIGNALED(status):
        return ExitStatus(exitcode=None, signal=os.WTERMSIG(status), timestamp=time.time())
    return ExitStatus(exitcode=os.waitstatus_to_exitcode(status), signal=None, timestamp=time.time())


class ChildHandle(WorkerHandle):
    """A worker the agent reaps itself (exec'd, or forked and re-parented), watched through a pidfd."""

    #: How the worker was started, for the event log.
    start_method = "exec"

    def __init__(self, launch: WorkerLaunch, pid: int, streams: StreamSet, proc: subprocess.Popen | None = None):
        self.launch = launch
        self.pid = pid
        self._proc = proc
        self.streams = streams
        self._pidfd = os.pidfd_open(pid)
        self._status: ExitStatus | None = None

    def poll(self) -> ExitStatus | None:
        if self._status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid == 0:
                return None
            self._status = exit_status_from_wait(status)
            if self._proc is not None:  # keep Popen from reaping (or warning about) it again
                self._proc.returncode = (
                    self._status.exitcode if self._status.signal is None else -self._status.signal
                )
        return self._status

    def fileno(self) -> int:
        return self._pidfd

    def send_signal(self, sig: int) -> None:
        if self._status is not None:
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            self.hasten()  # its idle-priority threads must run their exit before the process ends

    def set_console_prefix(self, prefix: str) -> None:
        self.streams.out.set_prefix(prefix)
        self.streams.err.set_prefix(prefix)

    def stderr_tail(self, lines: int = 20) -> str:
        return tail_text(self.streams.err, self.launch.stderr_path, lines)

    def console_held(self) -> bool:
        return self.streams.err.holding

    def release_console(self) -> None:
        self.streams.err.release()

    def drop_console(self) -> None:
        self.streams.err.drop()

    def close(self) -> None:
        self.streams.join()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class ExecStarter(WorkerStarter):
    """Starts each worker as a new interpreter (what torchrun does), with the orphan guard."""

    name = "exec"

    def start(self, launch: WorkerLaunch) -> WorkerHandle:
        streams = StreamSet(launch)
        try:
            proc = subprocess.Popen(
                _shim_argv(launch.argv),
                env=launch.env,
                cwd=launch.cwd,
                stdout=streams.out_w,
                stderr=streams.err_w,
                process_group=0,
                close_fds=True,
            )
        except OSError:
            streams.abandon()
            raise
        streams.start()
        return ChildHandle(launch, proc.pid, streams, proc)


def error_file_path(base: Path, generation: int, rank: int) -> Path:
    """Where rank ``rank`` of generation ``generation`` writes its error file."""
    return base / f"attempt_{generation}" / f"rank_{rank}" / "error.json"
