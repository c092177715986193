"""The ``etcd`` rendezvous backend (alias ``etcd-v3``): rounds on an etcd cluster through its v3 API.

The job's state lives in a replicated etcd cluster, not in any agent, so the job survives the loss
of any one node or any one etcd member (of three).  docs/etcd.md says how to run etcd for a job
and lists every ``--rdzv-conf`` key; :mod:`elastrun.rendezvous.etcd.handler` documents the keys
written.
"""

from __future__ import annotations

from elastrun.rendezvous.api import FunctionBackend, RendezvousHandler, RendezvousParameters
from elastrun.rendezvous.etcd.handler import EtcdRendezvousHandler
from elastrun.rendezvous.etcd.settings import (
    CONFIG_ALIASES,
    CONFIG_KEYS,
    DEFAULT_PORT,
    parse_config,
    parse_endpoints,
    require_client,
    validate_params,
)
from elastrun.rendezvous.etcd.status import read_job_status


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """This agent's handler for ``--rdzv-backend=etcd`` (and ``etcd-v3``)."""
    return EtcdRendezvousHandler(params, parse_endpoints(params.endpoint), parse_config(params))


#: ``--rdzv-backend=etcd`` and ``etcd-v3``: settings, handler and status reader of this package.
BACKEND = FunctionBackend(validate_params, create_handler, read_job_status)

__all__ = [
    "BACKEND", "CONFIG_ALIASES", "CONFIG_KEYS", "DEFAULT_PORT", "create_handler", "parse_config",
    "parse_endpoints", "read_job_status", "require_client", "validate_params",
]
