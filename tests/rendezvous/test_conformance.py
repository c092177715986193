"""The rendezvous conformance suite (elastrun/rendezvous/conformance.py) on every built-in backend, and on
an in-memory fake that applies the same rules with no storage protocol (in milliseconds).

c10d and static on a real ``TCPStore`` hosted by node 0's handler, etcd on one real etcd server for
the module (each case is a job of its own: its run id is its key prefix).  The handlers of a case run
on threads of this process; a third-party backend runs the same cases (docs/rendezvous-protocol.md,
"Conformance").
"""

from __future__ import annotations

import dataclasses

import pytest

from elastrun.rendezvous import conformance
from elastrun.rendezvous.api import NodeInfo, RendezvousHandler
from elastrun.rendezvous.c10d import create_handler as c10d_handler
from elastrun.rendezvous.c10d.static import create_handler as static_handler
from elastrun.rendezvous.etcd import create_handler as etcd_handler
from tests.harness import free_port
from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available
from tests.rendezvous.memory_backend import MemoryHandler, MemoryJob

pytestmark = pytest.mark.contract

#: Short waits where the cases need them; losses in the cases are departures (``leave``), never a
#: silence, so the heartbeat time-out (c10d) and the lease (etcd) are long: a loaded CI host must not
#: turn a slow thread into a loss.
_COMMON = {"join_timeout": "20", "last_call_timeout": "0.5"}


class C10dJobs(conformance.Jobs):
    backend = "c10d"

    def __init__(self, directory) -> None:
        super().__init__(directory)
        self._ports: dict[str, int] = {}

    def handler(self, job: conformance.JobSpec, node: int) -> RendezvousHandler:
        port = self._ports.setdefault(job.run_id, free_port())
        return c10d_handler(self.params(job, node, f"127.0.0.1:{port}", **_COMMON, host_linger="0",
                                        heartbeat_timeout="30", is_host=str(node == 0).lower()))


class StaticJobs(C10dJobs):
    backend = "static"
    elastic = False

    def node_info(self, job: conformance.JobSpec, node: int) -> NodeInfo:
        return dataclasses.replace(super().node_info(job, node), fixed_rank=node)

    def handler(self, job: conformance.JobSpec, node: int) -> RendezvousHandler:
        port = self._ports.setdefault(job.run_id, free_port())
        params = self.params(job, node, "", join_timeout="20", host_linger="0", heartbeat_timeout="30")
        return static_handler(dataclasses.replace(params, master_addr="127.0.0.1", master_port=port))


class EtcdJobs(conformance.Jobs):
    backend = "etcd"
    endpoints = ""

    def handler(self, job: conformance.JobSpec, node: int) -> RendezvousHandler:
        return etcd_handler(self.params(job, node, self.endpoints, **_COMMON, lease_ttl="10"))


class MemoryJobs(conformance.Jobs):
    """The in-memory fake (tests/rendezvous/memory_backend.py): the rules without a storage protocol."""

    backend = "memory"

    def __init__(self, directory) -> None:
        super().__init__(directory)
        self._jobs: dict[str, MemoryJob] = {}

    def handler(self, job: conformance.JobSpec, node: int) -> RendezvousHandler:
        params = self.params(job, node, "", last_call_timeout="0.2")
        shared = self._jobs.setdefault(job.run_id, MemoryJob(params, job.token))
        return MemoryHandler(shared, job.token_of(node))


@pytest.fixture(scope="module")
def etcd_endpoints():
    if not etcd_available():
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    with EtcdCluster(1) as cluster:
        yield cluster.endpoints


@pytest.fixture
def no_env_token(monkeypatch):
    """The cases set tokens per node (token files): one in the environment would apply to every node."""
    monkeypatch.delenv("ELASTRUN_JOB_TOKEN", raising=False)


def _ids(case) -> str:
    return case.__name__


@pytest.mark.unit
@pytest.mark.parametrize("case", conformance.cases_for(MemoryJobs), ids=_ids)
def test_memory(case, tmp_path):
    case(MemoryJobs(tmp_path))


@pytest.mark.parametrize("case", conformance.cases_for(C10dJobs), ids=_ids)
def test_c10d(case, tmp_path, no_env_token):
    case(C10dJobs(tmp_path))


@pytest.mark.parametrize("case", conformance.cases_for(StaticJobs), ids=_ids)
def test_static(case, tmp_path, no_env_token):
    case(StaticJobs(tmp_path))


@pytest.mark.etcd
@pytest.mark.parametrize("case", conformance.cases_for(EtcdJobs), ids=_ids)
def test_etcd(case, tmp_path, no_env_token, etcd_endpoints):
    jobs = EtcdJobs(tmp_path)
    jobs.endpoints = etcd_endpoints
    case(jobs)
