"""The warm starter's server (``python tests/warm_server.py SOCKET``): see tests/warm.py.

It loads what every agent loads (torch, ``torch.distributed``, the pool template's base imports, the
agent's modules) once, with the environment it was started with, then forks one child per request
on the Unix socket ``SOCKET``.  The child becomes ``python ARGV`` (``-m MODULE``, ``-c CODE`` or a
script) as an exec'd one would be: its stdio, working directory, environment, session, ``sys.path``
and ``sys.argv``; then it runs the code and exits as that interpreter would (atexit, flushed streams,
its exit code).

Protocol (``SOCK_SEQPACKET``, one connection per child): the client sends one JSON request
``{"argv", "cwd", "env", "session"}`` with stdin, stdout and stderr as three descriptors; the child
answers ``{"pid": N}`` once it is set up, and the server ``{"exit": CODE}`` (negative: the signal)
once the child has ended and been reaped.  The server runs one thread, so forking from it is safe,
and dies with its parent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import builtins
import ctypes
import gc
import json
import os
import runpy
import select
import signal
import socket
import sys
import types

#: What ``python -m elastrun`` imports before its first round, beside torch.
AGENT_MODULES = ("elastrun.cli.dispatch", "elastrun.launcher", "elastrun.agent.agent",
                 "elastrun.rendezvous.registry", "elastrun.agent.workers.pool")
_PR_SET_PDEATHSIG = 1


def load() -> None:
    """Import torch as the agent does (remembering the environment), the template's base, the agent's modules."""
    from elastrun.shared.imports import import_quickly
    from elastrun.worker.template import BASE_IMPORTS

    import_quickly("torch.distributed")
    for name in (*BASE_IMPORTS, *AGENT_MODULES):
        import_quickly(name)
    # The template's own modules are loaded afresh after each fork (template_fork._forget_agent).
    for name in [m for m in sys.modules if m.startswith("elastrun.worker")]:
        del sys.modules[name]
    gc.collect()
    gc.freeze()


def serve(listener: socket.socket) -> tuple[dict, list[int], socket.socket]:
    """Answer requests until one is forked: returns in that child only (its request, descriptors and
    connection, on which the child sends its pid once it is set up, as ``subprocess`` returns once the
    child has exec'd)."""
    waiting: dict[int, socket.socket] = {}
    running: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (connection, child pid)
    while True:
        ready, _, _ = select.select([listener, *waiting.values(), *running], [], [])
        for item in ready:
            if item is listener:
                conn, _ = listener.accept()
                waiting[conn.fileno()] = conn
            elif isinstance(item, int):
                conn, pid = running.pop(item)
                os.close(item)
                _, status = os.waitpid(pid, 0)
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
            else:
                del waiting[item.fileno()]
                try:
                    data, fds, _, _ = socket.recv_fds(item, 1 << 18, 3)
                except OSError:
                    data, fds = b"", []
                if not data or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    item.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in waiting.values():
                        other.close()
                    for pidfd, (other, _) in running.items():
                        os.close(pidfd)
                        other.close()
                    return json.loads(data), fds, item
                for fd in fds:
                    os.close(fd)
                running[os.pidfd_open(pid)] = (item, pid)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass  # the client is gone: its test ended; the child is its test's to clean up


def become(request: dict, fds: list[int]) -> None:
    """In the forked child: take the request's stdio, session, directory and environment."""
    if request["session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


def run(argv: list[str]) -> None:
    """Run ``python ARGV`` here: ``-m MODULE``, ``-c CODE`` or a script, with ``sys.path[0]`` and
    ``sys.argv`` as the interpreter sets them for each."""
    if argv[0] == "-m":
        sys.path[0] = os.getcwd()
        sys.argv = ["-m", *argv[2:]]  # runpy puts the module's path first, as ``-m`` does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.path[0] = ""
        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - what ``python -c`` does
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        sys.exit("warm server: its parent is gone")
    path = sys.argv[1]
    sys.path[0] = os.getcwd()  # not this file's folder; a child puts its own working directory there
    load()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the client waits for this name: the server is ready
    request, fds, conn = serve(listener)
    become(request, fds)
    _send(conn, {"pid": os.getpid()})
    conn.close()
    run(request["argv"])


if __name__ == "__main__":
    main()
