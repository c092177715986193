"""Fixtures of the agent tests."""

import pytest

from tests.agent.jobs import Job
from tests.harness import free_port
from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available


@pytest.fixture(params=["c10d", "etcd"])
def job(request):
    """A job on the c10d backend, then on a one-member etcd (skipped where no etcd binary is installed)."""
    if request.param == "c10d":
        yield Job("c10d", f"127.0.0.1:{free_port()}")
        return
    if not etcd_available():
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    with EtcdCluster(1) as cluster:
        yield Job("etcd", cluster.endpoints)
