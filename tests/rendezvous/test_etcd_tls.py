"""The etcd backend over TLS with client certificates: a real etcd serving HTTPS only and requiring
a certificate signed by a test CA (``trustme``), real agents and DDP workers.

A job with the right files trains and leaves no keys; ``elastrun status`` reads it over TLS; each
wrong set-up (a certificate from another CA, no client certificate, plain HTTP against the HTTPS
port, no CA to check the server by) is a one-line error with exit code 2, quickly, not a hang.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.rendezvous.etcd_cluster import EtcdCluster, EtcdTLS, etcd_available
from tests.rendezvous.etcd_job import REPO, kill_group, read_steps, start_agent, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.etcd,
    pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)"),
]


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    tls = EtcdTLS.generate(tmp_path_factory.mktemp("tls"))
    with EtcdCluster(1, tls=tls) as cluster:
        yield cluster


def _elastrun(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "elastrun", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_job_over_tls_trains_is_visible_to_status_and_leaves_no_keys(tls_etcd, tmp_path):
    tls = tls_etcd.tls
    steps = tmp_path / "steps"
    steps.mkdir()
    agent = start_agent(tls_etcd.endpoints, "tls-job", steps, tmp_path / "a.log", nnodes="1", steps=100000,
                        conf=tls.rdzv_conf())
    try:
        wait_for(lambda: len(read_steps(steps)) >= 5, 60, "steps over a TLS rendezvous")
        status = _elastrun("status", "--rdzv-backend=etcd", f"--rdzv-endpoint={tls_etcd.endpoints}",
                           "--rdzv-id=tls-job", f"--rdzv-conf={tls.rdzv_conf()}", "--json")
        assert status.returncode == 0, status.stderr
        assert '"world_size": 1' in status.stdout, status.stdout
        assert any(k.startswith("/elastrun/tls-job/") for k in tls_etcd.list_keys())
    finally:
        kill_group(agent, signal.SIGTERM)
    assert agent.returncode == 128 + signal.SIGTERM, (tmp_path / "a.log").read_text()
    wait_for(lambda: tls_etcd.list_keys() == [], 15, "no keys left after the job")


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("client certificate from another CA", "TLS"),
        ("no client certificate", "TLS"),
        ("plain http to the https port", "protocol=https"),
        ("no CA to verify the server", "ca_cert"),
    ],
)
def test_wrong_tls_setup_is_a_clear_error(tls_etcd, tmp_path, case, needle):
    tls = tls_etcd.tls
    other = EtcdTLS.generate(tmp_path)  # a different CA with its own client certificate
    conf = {
        "client certificate from another CA": f"ca_cert={tls.ca},client_cert={other.client_cert},"
                                              f"client_key={other.client_key}",
        "no client certificate": f"ca_cert={tls.ca}",
        "plain http to the https port": "protocol=http",
        "no CA to verify the server": f"client_cert={tls.client_cert},client_key={tls.client_key}",
    }[case]
    started = time.monotonic()
    out = _elastrun("--nnodes=1", "--rdzv-backend=etcd", f"--rdzv-endpoint={tls_etcd.endpoints}",
                    "--rdzv-id=bad-tls", f"--rdzv-conf={conf}", "--no-python", "true")
    assert out.returncode == 2, (case, out.returncode, out.stderr)
    last = out.stderr.strip().splitlines()[-1]
    assert needle in last and tls_etcd.endpoint(0) in last, (case, out.stderr)
    assert time.monotonic() - started < 30, "a clear error, not a retry loop"
    assert tls_etcd.list_keys() == [], "nothing half-done"
