"""The ``static`` backend: a fixed number of nodes with fixed ranks (``--node-rank``).

It runs the same rounds as ``c10d`` (so restarts, failure summaries and the job-wide budget work
the same), with three differences: the store is hosted by node rank 0 at
``--master-addr:--master-port``; every round needs exactly ``--nnodes`` nodes; and a node's group
rank is its ``--node-rank``.  A single-node job with no ``--master-port`` binds a free port.
"""

from __future__ import annotations

import os

from elastrun.config import DEFAULT_MASTER_PORT
from elastrun.rendezvous.api import FunctionBackend, RendezvousConfigError, RendezvousHandler, RendezvousParameters
from elastrun.rendezvous.c10d.handler import StoreRendezvousHandler, parse_config
from elastrun.rendezvous.c10d.status import read_job_status


class StaticRendezvousHandler(StoreRendezvousHandler):
    """Rounds of exactly ``nnodes`` nodes; the node with rank 0 hosts the store."""

    backend_name = "static"


def validate_params(params: RendezvousParameters) -> None:
    """Reject a bad node count, node rank or ``--rdzv-conf`` before anything starts."""
    if params.min_nodes != params.max_nodes:
        raise RendezvousConfigError(
            f"the static backend needs a fixed node count, got --nnodes={params.min_nodes}:{params.max_nodes}; "
            "use --rdzv-backend=c10d for an elastic range"
        )
    if not 0 <= params.node_rank < params.max_nodes:
        raise RendezvousConfigError(
            f"--node-rank={params.node_rank} is outside 0..{params.max_nodes - 1} for --nnodes={params.max_nodes}"
        )
    parse_config(params)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Factory for ``--rdzv-backend=static``."""
    validate_params(params)
    port = params.master_port
    if port is None:
        port = 0 if params.max_nodes == 1 else DEFAULT_MASTER_PORT
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return StaticRendezvousHandler(params, params.master_addr, port, is_host=params.node_rank == 0)


#: ``--rdzv-backend=static``: c10d's rounds and status reader, with fixed ranks and node count.
BACKEND = FunctionBackend(validate_params, create_handler, read_job_status)
