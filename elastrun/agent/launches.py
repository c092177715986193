"""What each worker of a round is started with: its environment, command line, log and error files.

The environment is torchrun's contract plus elastrun's own variables.  Scripts written for
torchrun read ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` … and call ``init_process_group`` with
``env://``.  Because ``TORCHELASTIC_USE_AGENT_STORE=True``, torch connects every rank as a *client*
to ``MASTER_ADDR:MASTER_PORT``, a TCPStore that the agent of group rank 0 bound and is listening on
before any worker starts: no port is ever probed free and released (torchrun's port race), and each
round gets a fresh store, so no key of an earlier attempt can leak into a new process group.
The node adds what outlives the round (the snapshot directory, the node services' variables: see
:mod:`elastrun.agent.runtime`) and each rank its heartbeat file.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from elastrun.agent.runtime import NodeRuntime
from elastrun.agent.workers.spawn import error_file_path
from elastrun.agent.workers.starter import WorkerLaunch
from elastrun.config import LaunchConfig, Std
from elastrun.rendezvous.api import RoundResult
from elastrun.shared.protocol import HEARTBEAT_ENV


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
            "ELASTRUN_AGENT_PID": str(agent_pid if agent_pid is not None else os.getpid()),
            "PYTHONUNBUFFERED": base.get("PYTHONUNBUFFERED", "1"),
        }
    )
    if "OMP_NUM_THREADS" not in base and nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    if extra:
        env.update(extra)
    return env


class LaunchBuilder:
    """Builds the :class:`WorkerLaunch` of every local rank of a round."""

    def __init__(self, config: LaunchConfig, base_env: Mapping[str, str], node_id: str, runtime: NodeRuntime) -> None:
        self.config = config
        self.base_env = dict(base_env)
        self.node_id = node_id
        self.runtime = runtime

    def for_round(self, result: RoundResult) -> list[WorkerLaunch]:
        return [self.launch(result, local_rank) for local_rank in range(self.config.nproc_per_node)]

    def _streams(self, local_rank: int) -> tuple[Std, Std]:
        def pick(mapping: dict[int, Std]) -> Std:
            return mapping.get(local_rank, mapping.get(-1, Std.NONE))

        return pick(self.config.redirects), pick(self.config.tee)

    def launch(self, result: RoundResult, local_rank: int) -> WorkerLaunch:
        """Local rank ``local_rank``'s launch; its error file is made ready (an old one removed)."""
        config = self.config
        rank = result.rank_offset + local_rank
        error_file = error_file_path(self.runtime.log_dir, result.generation, rank)
        error_file.parent.mkdir(parents=True, exist_ok=True)
        if error_file.exists():
            error_file.unlink()
        env = worker_environment(
            self.base_env,
            result=result,
            local_rank=local_rank,
            nproc=config.nproc_per_node,
            role=config.role,
            run_id=config.run_id,
            max_restarts=config.max_restarts,
            node_id=self.node_id,
            error_file=str(error_file),
            extra={**self.runtime.worker_env(), HEARTBEAT_ENV: str(self.runtime.heartbeat_file(rank))},
        )
        env.setdefault("PYTHONFAULTHANDLER", "1")
        redirect, tee = self._streams(local_rank)
        files = redirect | tee
        log_base = self.runtime.log_dir / f"attempt_{result.generation}" / f"rank_{rank}"
        shown = config.local_ranks_filter is None or local_rank in config.local_ranks_filter
        return WorkerLaunch(
            local_rank=local_rank,
            rank=rank,
            argv=config.worker_argv(sys.executable),
            env=env,
            cwd=os.getcwd(),
            stdout_path=log_base / "stdout.log" if files & Std.OUT else None,
            stderr_path=log_base / "stderr.log" if files & Std.ERR else None,
            tee_stdout=bool(tee & Std.OUT),
            tee_stderr=bool(tee & Std.ERR),
            console_prefix=f"[node{result.group_rank} rank{rank}]: ",
            show_on_console=shown,
            error_file=error_file,
            python_target=None if config.no_python else config.entrypoint,
            python_module=config.module,
            python_args=list(config.args),
        )


def link_kept_logs(old: WorkerLaunch, new: WorkerLaunch) -> None:
    """Make a kept worker's log files visible in the new attempt's directory as well.

    Its process keeps writing where it started (its streams stay open), so the new attempt's
    ``rank_<r>/stdout.log`` and ``stderr.log`` become relative symlinks to those files: every
    attempt's directory lists every rank, as after a restart.
    """
    for was, now in ((old.stdout_path, new.stdout_path), (old.stderr_path, new.stderr_path)):
        if was is None or now is None or was == now:
            continue
        try:
            now.parent.mkdir(parents=True, exist_ok=True)
            now.unlink(missing_ok=True)
            now.symlink_to(os.path.relpath(was, now.parent))
        except OSError:
            pass  # a log directory that cannot take a link: the worker's output is still in the old file
