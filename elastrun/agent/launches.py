"""The environment each worker gets: torchrun's contract plus elastrun's own variables.

Scripts written for torchrun read ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` … and call
``init_process_group`` with ``env://``.  Because ``TORCHELASTIC_USE_AGENT_STORE=True``, torch
connects every rank as a *client* to ``MASTER_ADDR:MASTER_PORT``, a TCPStore that the agent of
group rank 0 bound and is listening on before any worker starts: no port is ever probed free and
released (torchrun's port race), and each round gets a fresh store, so no key of an earlier
attempt can leak into a new process group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from elastrun.rendezvous.api import RoundResult


def worker_environment(
    base: Mapping[str, str],
    *,
    result: RoundResult,
    local_rank: int,
    nproc: int,
    role: str,
    run_id: str,
    max_restarts: int,
    node_id: str,
    error_file: str,
    snapshot_dir: str,
    agent_pid: int | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Build the complete environment of one worker.

    ``base`` is the agent's own environment at start-up (what the user exported); the contract
    variables override it.  ``OMP_NUM_THREADS`` becomes 1 when it is unset and more than one
    worker runs on the node, as with torchrun, so that workers do not oversubscribe the cores.
    """
    rank = result.rank_offset + local_rank
    env = dict(base)
    env.update(
        {
            "LOCAL_RANK": str(local_rank),
            "RANK": str(rank),
            "GROUP_RANK": str(result.group_rank),
            "ROLE_RANK": str(result.role_rank_offset + local_rank),
            "ROLE_NAME": role,
            "LOCAL_WORLD_SIZE": str(nproc),
            "WORLD_SIZE": str(result.world_size),
            "GROUP_WORLD_SIZE": str(result.group_world_size),
            "ROLE_WORLD_SIZE": str(result.role_world_size),
            "MASTER_ADDR": result.store_addr,
            "MASTER_PORT": str(result.store_port),
            "TORCHELASTIC_RESTART_COUNT": str(result.generation),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_ERROR_FILE": error_file,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "ELASTRUN_NODE_ID": node_id,
            "ELASTRUN_ROUND": str(result.round),
            "ELASTRUN_SNAPSHOT_DIR": snapshot_dir,
            "ELASTRUN_AGENT_PID": str(agent_pid if agent_pid is not None else os.getpid()),
            "PYTHONUNBUFFERED": base.get("PYTHONUNBUFFERED", "1"),
        }
    )
    if "OMP_NUM_THREADS" not in base and nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    if extra:
        env.update(extra)
    return env
