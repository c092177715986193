"""Real etcd servers for tests: start 1 or 3 members on free loopback ports with temporary data
directories, kill and restart members, and remove everything afterwards (by PID, never by name).

Used by tests/rendezvous/test_etcd*.py, tests/netns/ and bench/bench_rendezvous_etcd.py::

    with EtcdCluster(3) as cluster:
        cluster.endpoints           # "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
        cluster.kill(0); cluster.restart(0)

With ``tls=EtcdTLS(...)`` the members serve clients over HTTPS only and require a client
certificate signed by the given CA; health is then read from a plain-HTTP metrics listener.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.harness import free_port

ETCD_BINARY = shutil.which("etcd") or "/usr/bin/etcd"


def etcd_available() -> bool:
    return os.path.isfile(ETCD_BINARY) and os.access(ETCD_BINARY, os.X_OK)


@dataclass(frozen=True)
class EtcdTLS:
    """PEM files of a test CA, the server's certificate for 127.0.0.1 and a client certificate,
    all signed by that CA (``trustme``); the server requires client certificates from it."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def generate(cls, directory: Path) -> EtcdTLS:
        import trustme

        ca = trustme.CA()
        server = ca.issue_cert("127.0.0.1", "localhost")
        client = ca.issue_cert("elastrun-agent@example.org")
        files = cls(*(directory / f"{n}.pem" for n in ("ca", "server", "server-key", "client", "client-key")))
        ca.cert_pem.write_to_path(str(files.ca))
        server.cert_chain_pems[0].write_to_path(str(files.cert))
        server.private_key_pem.write_to_path(str(files.key))
        client.cert_chain_pems[0].write_to_path(str(files.client_cert))
        client.private_key_pem.write_to_path(str(files.client_key))
        return files

    def rdzv_conf(self) -> str:
        """The ``--rdzv-conf`` keys with which an agent talks to this server."""
        return f"ca_cert={self.ca},client_cert={self.client_cert},client_key={self.client_key}"

    def ssl_context(self):
        import ssl

        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def _die_with_parent() -> None:
    """In the member's child process: SIGKILL it when the test process dies, even by SIGKILL or a
    timeout (its own session keeps it out of the test's process group, so nothing else would)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EtcdCluster:
    """``size`` etcd members on ``host``; ``wrap`` prefixes each command (e.g. ``ip netns exec NS``)."""

    def __init__(self, size: int = 1, host: str = "127.0.0.1", wrap: list[str] | None = None,
                 ports: list[tuple[int, int]] | None = None, tls: EtcdTLS | None = None,
                 data_root: str | None = None) -> None:
        self.tls = tls
        self.metrics_ports = [free_port() for _ in range(size)] if tls else []
        self.size = size
        self.host = host
        self.wrap = list(wrap or [])
        self.dir = Path(tempfile.mkdtemp(prefix="elastrun-etcd-", dir=data_root))  # data_root: e.g. a tmpfs
        self.ports = ports or [(free_port(), free_port()) for _ in range(size)]
        self.procs: list[subprocess.Popen | None] = [None] * size
        self.names = [f"m{i}" for i in range(size)]

    @property
    def endpoints(self) -> str:
        return ",".join(f"{self.host}:{client}" for client, _ in self.ports)

    def endpoint(self, i: int) -> str:
        return f"{self.host}:{self.ports[i][0]}"

    def _command(self, i: int) -> list[str]:
        client, peer = self.ports[i]
        cluster = ",".join(f"{n}=http://{self.host}:{p}" for n, (_, p) in zip(self.names, self.ports, strict=True))
        scheme = "https" if self.tls else "http"
        tls: list[str] = []
        if self.tls:
            tls = ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                   "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth",
                   "--listen-metrics-urls", f"http://{self.host}:{self.metrics_ports[i]}"]
        return [
            *self.wrap, ETCD_BINARY, "--name", self.names[i], "--data-dir", str(self.dir / self.names[i]),
            "--listen-client-urls", f"{scheme}://{self.host}:{client}",
            "--advertise-client-urls", f"{scheme}://{self.host}:{client}", *tls,
            "--listen-peer-urls", f"http://{self.host}:{peer}",
            "--initial-advertise-peer-urls", f"http://{self.host}:{peer}",
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", self.dir.name, "--log-level", "error", "--logger", "zap",
        ]

    def start(self) -> EtcdCluster:
        for i in range(self.size):
            self.restart(i, wait=False)
        self.wait_healthy()
        return self

    def restart(self, i: int, wait: bool = True) -> None:
        log = open(self.dir / f"{self.names[i]}.log", "ab")  # noqa: SIM115 - kept by the process
        self.procs[i] = subprocess.Popen(self._command(i), stdout=log, stderr=log, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        log.close()
        if wait:
            self.wait_healthy([i])

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.procs[i] = None

    def healthy(self, i: int) -> bool:
        url = f"http://{self.endpoint(i)}/health"
        if self.tls:  # the client port wants a certificate; the metrics listener is plain HTTP
            url = f"http://{self.host}:{self.metrics_ports[i]}/health"
        if self.wrap:  # not reachable from here: ask from inside the namespace
            out = subprocess.run([*self.wrap, "curl", "-s", "-m", "1", url], capture_output=True, text=True)
            return '"true"' in out.stdout
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                return json.loads(reply.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def wait_healthy(self, members: list[int] | None = None, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        for i in members if members is not None else range(self.size):
            while not self.healthy(i):
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"etcd member {i} exited: {self.log(i)[-2000:]}")
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"etcd member {i} not healthy after {timeout} s: {self.log(i)[-2000:]}")
                time.sleep(0.1)

    def log(self, i: int) -> str:
        path = self.dir / f"{self.names[i]}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def list_keys(self, prefix: str = "/elastrun/") -> list[str]:
        """Every key under ``prefix`` (through the first member that answers)."""
        import base64

        end = bytearray(prefix.encode())
        end[-1] += 1
        body = json.dumps({"key": base64.b64encode(prefix.encode()).decode(),
                           "range_end": base64.b64encode(bytes(end)).decode(), "keys_only": True}).encode()
        for i in range(self.size):
            if self.procs[i] is None:
                continue
            try:
                scheme = "https" if self.tls else "http"
                request = urllib.request.Request(f"{scheme}://{self.endpoint(i)}/v3/kv/range", data=body)
                context = self.tls.ssl_context() if self.tls else None
                with urllib.request.urlopen(request, timeout=3, context=context) as reply:
                    doc = json.loads(reply.read())
                return [base64.b64decode(kv["key"]).decode() for kv in doc.get("kvs", [])]
            except OSError:
                continue
        raise RuntimeError("no etcd member answered")

    def stop(self) -> None:
        for i in range(self.size):
            self.kill(i)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
