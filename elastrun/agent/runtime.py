"""The node runtime: what an agent keeps on its node for as long as it runs, across rounds and restarts.

- the runtime directory, in node memory (``/dev/shm``): the workers' snapshot directory (where
  ``elastrun.train`` keeps its memory snapshots, so a restarted worker reloads them) and their
  heartbeat files;
- a private temporary directory (error files and attempt logs without ``--log-dir``, sockets
  whose path would be too long under the runtime directory);
- the node's services (:class:`NodeService`): servers the agent runs for its workers or its peers,
  such as the control server of in-process re-forms.  Each gives the workers' environment its
  variables, the agent's ``select`` its descriptors, and is closed with the runtime.

Everything is removed when the agent exits.  An agent that was SIGKILLed cannot remove its own
directories, so each agent first sweeps those of agents that no longer run (their ``owner.pid``
names a dead process).
"""

from __future__ import annotations

import abc
import os
import shutil
import tempfile
from pathlib import Path
from typing import TypeVar

from elastrun.shared import log
from elastrun.shared.protocol import SNAPSHOT_DIR_ENV

#: A Unix socket path is limited to 108 bytes: a longer one goes to the temporary directory.
MAX_SOCKET_PATH = 100

_log = log.get("agent")


class NodeService(abc.ABC):
    """A server the agent runs on its node from start to exit, owned by the :class:`NodeRuntime`.

    The runtime asks each service for the variables every worker's environment gets, for the
    descriptors the agent's loop waits on (readable: call :meth:`pump`), and closes it when the
    agent exits, before the directories go.  Example::

        class EchoService(NodeService):
            def __init__(self, runtime: NodeRuntime) -> None:
                self.server = UnixServer(runtime.socket_path("echo.sock"))
            def worker_env(self) -> dict[str, str]:
                return {"ECHO_SOCKET": str(self.server.path)}
            def filenos(self) -> list[int]:
                return self.server.filenos()
            def pump(self) -> None:
                self.server.serve_ready()      # never blocks: the agent's loop calls it
            def close(self) -> None:
                self.server.close()

        service = runtime.add(EchoService(runtime))
    """

    def worker_env(self) -> dict[str, str]:
        """Variables every worker's environment gets from this service."""
        return {}

    def filenos(self) -> list[int]:
        """Descriptors for the agent's ``select``; when one is readable the agent calls :meth:`pump`."""
        return []

    def pump(self) -> None:  # noqa: B027 - optional: a service without descriptors has nothing to do
        """Handle what arrived, without blocking."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving; called once, when the agent exits."""


S = TypeVar("S", bound=NodeService)


def sweep_stale_runtime_dirs(base: Path, pattern: str = "elastrun-*") -> None:
    """Remove the agent directories under ``base`` whose owning agent (``owner.pid``) no longer runs."""
    for path in base.glob(pattern):
        owner = path / "owner.pid"
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass


class NodeRuntime:
    """This agent's directories and services on its node (see the module docstring)."""

    def __init__(self, node_id: str, log_dir: Path | None) -> None:
        sweep_stale_runtime_dirs(Path(tempfile.gettempdir()), "elastrun-agent-*")
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="elastrun-agent-"))
        (self.tmp_dir / "owner.pid").write_text(str(os.getpid()))
        #: Where attempts' error files and (redirected) logs go: ``--log-dir``, else the temporary directory.
        self.log_dir = log_dir if log_dir is not None else self.tmp_dir
        self.dir = self._make_runtime_dir(node_id)
        self.snapshot_dir = self.dir / "snapshot"
        self.heartbeat_dir = self.dir / "heartbeat"
        self.snapshot_dir.mkdir()
        self.heartbeat_dir.mkdir()
        self.services: list[NodeService] = []

    def _make_runtime_dir(self, node_id: str) -> Path:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.tmp_dir
        sweep_stale_runtime_dirs(base)
        path = base / f"elastrun-{node_id}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "owner.pid").write_text(str(os.getpid()))
        return path

    def heartbeat_file(self, rank: int) -> Path:
        """The heartbeat file of global rank ``rank`` (its exit report lies beside it)."""
        return self.heartbeat_dir / f"rank_{rank}"

    def socket_path(self, name: str) -> Path:
        """A place for a Unix socket named ``name``: in the runtime directory unless that path is too long."""
        path = self.dir / name
        return path if len(str(path)) <= MAX_SOCKET_PATH else self.tmp_dir / name

    def add(self, service: S) -> S:
        """Own ``service`` from now on (closed with the runtime); returns it."""
        self.services.append(service)
        return service

    def worker_env(self) -> dict[str, str]:
        """What every worker's environment gets from the node: its snapshot directory and the services' variables."""
        env = {SNAPSHOT_DIR_ENV: str(self.snapshot_dir)}
        for service in self.services:
            env.update(service.worker_env())
        return env

    def filenos(self) -> list[int]:
        return [fd for service in self.services for fd in service.filenos()]

    def pump(self) -> None:
        for service in self.services:
            service.pump()

    def close(self) -> None:
        """Close every service, then remove the directories."""
        for service in reversed(self.services):
            try:
                service.close()
            except Exception as exc:  # one service's failure must not leave the others or the directories
                _log.warning(f"closing {type(service).__name__} failed: {exc}")
        self.services = []
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
