"""Start end-to-end tests' agents forked from a warm interpreter instead of exec'd.

Why: a node's start-up is about three quarters of the suite's CPU, and importing torch is nine tenths
of a start-up (on 2 cores: ``torch.distributed`` 2.3 CPU-s in the agent, the template's ``torch._dynamo``
and DDP path 1.3 CPU-s more, against a whole one-worker job of about 4 CPU-s; docs/testing.md).  A user's
node pays that once per job; the suite starts ~250 nodes.

How: :func:`popen` and :func:`run` stand for ``subprocess.Popen`` and ``subprocess.run``.  A command
``python -m elastrun ...`` goes to a server (``tests/warm_server.py``) that has imported torch the way
the agent does, with the load-time variables (``PYTHON*``, ``OMP_*``, ``TORCH*``, ...; the template's, as
:func:`elastrun.agent.workers.pool.template_environment` gives them) of the command's environment: one
server per test process and per such set.  It forks a child that becomes ``python -m elastrun ...``
with the command's stdio, directory, environment and session.  From there on the agent is the real
one: it forks its template from itself because elastrun loaded its torch with the template's load-time
variables (:func:`elastrun.agent.workers.template_fork.why_not`), and its workers from that template.
Any other command, or any option this module does not carry, goes to ``subprocess`` unchanged.

What differs from an exec'd agent: the child's parent is the server, so the test learns its exit
code from the server (:class:`WarmProcess`); and it holds modules an exec'd agent loads later or never
(``torch._dynamo``).  The exec path stays tested where it is the subject: the command-line tests, the
template and pool tests, native output flushed at the exit, the install and demo tests.
``ELASTRUN_TEST_COLD=1`` execs every agent, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
SERVER = Path(__file__).resolve().parent / "warm_server.py"
ELASTRUN = [sys.executable, "-m", "elastrun"]
#: Seconds a server may take to import torch and listen (on a busy 2-core host: ~5 s).
_READY_TIMEOUT = 180.0
_NPROC = re.compile(r"--nproc[-_]per[-_]node(?:=|$)(.*)")

_lock = threading.Lock()
_servers: dict[tuple[tuple[str, str], ...], _Server] = {}


def cold() -> bool:
    """Whether agents are exec'd as a user's are (``ELASTRUN_TEST_COLD=1``)."""
    return os.environ.get("ELASTRUN_TEST_COLD", "") not in ("", "0")


def popen(cmd: Sequence[str], *, stdin: Any = None, stdout: Any = None, stderr: Any = None,
          env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
          start_new_session: bool = False, text: bool = False, **other: Any) -> subprocess.Popen | WarmProcess:
    """``subprocess.Popen(cmd, ...)``; an agent command is forked from a warm server (module docstring)."""
    if not _warm_command(cmd) or other or cold():
        return subprocess.Popen(list(cmd), stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                start_new_session=start_new_session, text=text, **other)
    environ = dict(os.environ if env is None else env)
    server = _server_for(_load_key(cmd, environ))
    return server.start(list(cmd), environ, str(cwd if cwd is not None else os.getcwd()), start_new_session,
                        (stdin, stdout, stderr), text)


def run(cmd: Sequence[str], *, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        text: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)`` through :func:`popen` (no ``input``)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(cmd, text=text, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _nproc(args: Sequence[str]) -> int:
    """``--nproc-per-node`` of an agent's arguments where it is a number; else 1."""
    for i, arg in enumerate(args):
        m = _NPROC.match(arg)
        if m:
            value = m[1] if m[1] or arg.endswith("=") else (args[i + 1] if i + 1 < len(args) else "")
            return int(value) if value.isdigit() else 1
    return 1


def _warm_command(cmd: Sequence[str]) -> bool:
    """``python -m MODULE ...``, ``python -c CODE ...`` or ``python SCRIPT ...``, with no interpreter option."""
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    return len(cmd) >= 3 if cmd[1] in ("-m", "-c") else not cmd[1].startswith("-")


def _load_key(cmd: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The load-time variables a server for ``cmd`` must import torch with.

    An agent's are its template's (:func:`~elastrun.agent.workers.pool.template_environment`), the
    ones :func:`~elastrun.agent.workers.template_fork.why_not` compares.  Any other command's are its
    own, less ``TORCHELASTIC_*`` (a launcher's job facts, read when a worker runs, not when torch loads).
    """
    from elastrun.agent.workers.pool import template_environment
    from elastrun.agent.workers.template_fork import TORCH_LOAD_PREFIXES

    if list(cmd[:3]) == ELASTRUN:
        env = template_environment(env, _nproc(cmd[3:]))
        return {k: v for k, v in env.items() if k.startswith(TORCH_LOAD_PREFIXES)}
    return {k: v for k, v in env.items() if k.startswith(TORCH_LOAD_PREFIXES) and not k.startswith("TORCHELASTIC_")}


def _server_for(key: dict[str, str]) -> _Server:
    from elastrun.agent.workers.template_fork import TORCH_LOAD_PREFIXES

    frozen = tuple(sorted(key.items()))
    with _lock:
        server = _servers.get(frozen)
        if server is None or not server.alive():
            rest = {k: v for k, v in os.environ.items() if not k.startswith(TORCH_LOAD_PREFIXES)}
            server = _servers[frozen] = _Server({**rest, **key})
        return server


class _Server:
    """One warm server process, started with ``env`` (load-time variables as its commands need them)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix="elastrun-warm-"), "server.sock")
        self.log = Path(self.path).with_name("server.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(SERVER), self.path], env=dict(env), cwd=REPO,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _READY_TIMEOUT
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"warm server did not start; its output:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, args: list[str], env: dict[str, str], cwd: str, session: bool, stdio: tuple, text: bool,
              ) -> WarmProcess:
        ends = _Ends(stdio, text)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            request = {"argv": args[1:], "cwd": cwd, "env": env, "session": session}
            socket.send_fds(conn, [json.dumps(request).encode()], ends.theirs)
            reply = json.loads(conn.recv(4096) or b"{}")
        except BaseException:
            conn.close()
            ends.close_ours()
            raise
        finally:
            ends.close_theirs()
        if "pid" not in reply:
            conn.close()
            ends.close_ours()
            raise RuntimeError(f"warm server refused {args}; its output:\n{self.log.read_text()[-3000:]}")
        return WarmProcess(args, conn, reply["pid"], ends)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.unlink(self.log)
            os.rmdir(os.path.dirname(self.path))


class _Ends:
    """The three descriptors a child gets (``theirs``) and the test's ends of any pipes (``ours``)."""

    def __init__(self, stdio: tuple, text: bool) -> None:
        self.theirs: list[int] = []
        self._close: list[int] = []
        self.files: list[IO | None] = [None, None, None]
        for index, spec in enumerate(stdio):
            if spec is None:
                fd = index
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                self._close.append(fd)
            elif spec == subprocess.PIPE:
                read, write = os.pipe()
                fd, ours = (read, write) if index == 0 else (write, read)
                self._close.append(fd)
                raw = open(ours, "wb" if index == 0 else "rb")  # noqa: SIM115 - the process object owns it
                self.files[index] = io.TextIOWrapper(raw) if text else raw
            elif spec == subprocess.STDOUT and index == 2:
                fd = self.theirs[1]
            elif isinstance(spec, int):
                fd = spec
            else:
                fd = spec.fileno()
            self.theirs.append(fd)

    def close_theirs(self) -> None:
        for fd in self._close:
            os.close(fd)
        self._close = []

    def close_ours(self) -> None:
        for file in self.files:
            if file is not None:
                file.close()


class WarmProcess:
    """An agent forked by a warm server: the parts of ``subprocess.Popen`` the tests use.

    Its exit code comes from the server, which reaps it.  Signals go to the PID while the server
    has not reported the end (after that, the PID may be someone else's).
    """

    def __init__(self, args: list[str], conn: socket.socket, pid: int, ends: _Ends) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdin, self.stdout, self.stderr = ends.files
        self._conn = conn

    def poll(self) -> int | None:
        self._hear(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._hear(left)
            if self.returncode is None and deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def _hear(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        if not select.select([self._conn], [], [], timeout)[0]:
            return
        data = self._conn.recv(4096)
        if not data:
            raise RuntimeError(f"the warm server went away before agent {self.pid} ended")
        self.returncode = int(json.loads(data)["exit"])
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:  # noqa: A002
        """Read stdout and stderr (where piped) to their end, then wait; ``input`` is not supported."""
        if input is not None:
            raise NotImplementedError("the warm starter gives a child no input")
        results: dict[int, Any] = {}
        readers = [threading.Thread(target=lambda i=i, f=f: results.__setitem__(i, f.read()), daemon=True)
                   for i, f in ((1, self.stdout), (2, self.stderr)) if f is not None]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for file in (self.stdout, self.stderr):
            if file is not None:
                file.close()
        return results.get(1), results.get(2)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for file in (self.stdin, self.stdout, self.stderr):
            if file is not None:
                with contextlib.suppress(OSError, ValueError):
                    file.close()
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(0 if exc[0] is not None else None)


@atexit.register
def stop_all() -> None:
    """Stop every server of this process (at its exit; each also dies with its parent)."""
    with _lock:
        for server in _servers.values():
            server.stop()
        _servers.clear()
