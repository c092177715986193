"""Launching from code: the ``elastrun`` command's engine, and a Python API like torch's ``elastic_launch``.

``run(config)`` is what the command line calls.  ``launch`` runs a job from Python, with a
script or a function as the entry point::

    from elastrun.config import LaunchConfig
    from elastrun.launcher import launch

    def train(lr):                      # must be importable (defined at module level)
        import torch.distributed as dist
        dist.init_process_group("gloo")
        return dist.get_rank()

    results = launch(LaunchConfig(entrypoint="", nproc_per_node=2, standalone=True,
                                  rdzv_backend="c10d", rdzv_endpoint="localhost:0"),
                     train, 0.1)
    # {0: 0, 1: 1}: return values of this node's ranks
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elastrun.config import LaunchConfig
from elastrun.errors import UsageError
from elastrun.rendezvous.api import RendezvousConfigError, RendezvousError, RendezvousParameters
from elastrun.shared import log
from elastrun.shared.imports import import_quickly

_log = log.get("launcher")


class LaunchError(RuntimeError):
    """A job launched through :func:`launch` failed; ``exit_code`` is the agent's."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def rendezvous_parameters(config: LaunchConfig) -> RendezvousParameters:
    """The rendezvous settings of a launch configuration."""
    return RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        max_restarts=config.max_restarts,
        crash_loop_limit=config.crash_loop_limit,
        local_addr=config.local_addr,
        config=dict(config.rdzv_configs),
        node_rank=config.node_rank,
        master_addr=config.master_addr,
        master_port=config.master_port,
    )


def check(config: LaunchConfig) -> None:
    """Validate a launch request before anything starts: its own fields, then its backend's settings.

    Raises :class:`UsageError` with one line naming what is wrong; connects nowhere.
    """
    from elastrun.rendezvous.registry import validate

    config.validate()
    try:
        validate(rendezvous_parameters(config))
    except RendezvousConfigError as exc:
        raise UsageError(str(exc)) from None


def make_starter(config: LaunchConfig, base_env: dict[str, str], own_process: bool = False):
    """The worker starter for ``config.start_method``: the warm pool, or exec (``spawn``, ``--no-python``)."""
    from elastrun.agent.workers.pool import select_starter

    return select_starter(config, base_env=base_env, own_process=own_process)


def run(config: LaunchConfig, own_process: bool = False) -> int:
    """Run this node's agent for ``config`` until the job ends; returns the process exit code.

    ``own_process``: this is the ``elastrun`` command's process, nobody else's; the warm pool may
    then fork its template from it (``elastrun.launch()`` runs the agent in a caller's process).
    """
    base_env = dict(os.environ)
    from elastrun.rendezvous.registry import create_handler

    log.configure(config.quiet, config.verbose)
    base_env[log.LEVEL_ENV] = log.level_name()  # elastrun.train in the workers speaks at the same level
    try:
        check(config)
    except UsageError as exc:
        _log.error(str(exc))
        return 2
    params = rendezvous_parameters(config)
    starter = make_starter(config, base_env, own_process)
    starter.prepare()
    # The store client logs every wait timeout at WARNING level; the agent waits with timeouts on
    # purpose.  Set after the template started, so that workers keep torch's default log level
    # (and read again where the template was forked from this process, which had imported torch).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if own_process:  # a caller's process (elastrun.launch) keeps the level its torch loaded with
        from elastrun.agent.workers.template_fork import reread_cpp_log_level

        reread_cpp_log_level()
    try:
        handler = create_handler(params)
    except RendezvousConfigError as exc:
        starter.close()
        _log.error(str(exc))
        return 2
    except RendezvousError as exc:
        starter.close()
        _log.error(str(exc))
        return 1
    except BaseException:
        starter.close()
        raise
    # torch.distributed now, before this node joins a round (already imported where the pool forked
    # its template from this process, or c10d did, for its store; else after the handler, so that a
    # bad token or endpoint is refused without waiting for the import): the agent of group
    # rank 0 starts the workers' TCPStore inside the round, and importing a CUDA build of torch there
    # holds the GIL for up to ~2 s at a stretch on a busy machine (torch 2.3.1's wheel), which starved
    # the etcd lease and heartbeat threads: peers took the closer for dead and formed a round without it.
    import_quickly("torch.distributed")

    from elastrun.agent.agent import LocalAgent
    from elastrun.shared import stackdump

    agent = LocalAgent(config, handler, starter, base_env=base_env)

    handler.on_warning = agent.report.rendezvous_warning
    stackdump.install()  # the agent's own stacks on request, as its workers' (a harness keeping evidence)
    return agent.run()


def launch(config: LaunchConfig, entrypoint: Callable[..., Any] | str, *args: Any) -> dict[int, Any]:
    """Run a job on this node from Python and return ``{rank: return value}`` of this node's workers.

    ``entrypoint`` is a script path (its return values are None) or a function importable by
    module and name, called as ``entrypoint(*args)`` in every worker.  Must be called from the
    main thread (the agent handles signals).  ``config`` is left as it was (the job runs a copy), and so
    are elastrun's log level and ``TORCH_CPP_LOG_LEVEL`` in the caller's process.
    Raises :class:`UsageError` (a ValueError) for a bad request, before anything starts, and
    :class:`LaunchError` when the job fails.
    """
    with log.kept_settings(), _kept_env("TORCH_CPP_LOG_LEVEL"):
        return _launch(config, entrypoint, *args)


@contextlib.contextmanager
def _kept_env(name: str) -> Iterator[None]:
    """Put ``os.environ[name]`` back as it was on leaving (:func:`run` sets it for the agent's own store client)."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _launch(config: LaunchConfig, entrypoint: Callable[..., Any] | str, *args: Any) -> dict[int, Any]:
    if isinstance(entrypoint, str):
        job = dataclasses.replace(config, entrypoint=entrypoint, args=[str(a) for a in args])
        check(job)
        code = run(job)
        if code != 0:
            raise LaunchError(f"job {config.run_id!r} failed with exit code {code}", code)
        return {r: None for r in range(config.nproc_per_node)}
    with tempfile.TemporaryDirectory(prefix="elastrun-launch-") as tmp:
        call_file = Path(tmp) / "call.pkl"
        job = dataclasses.replace(config, module=True, no_python=False, entrypoint="elastrun.worker.run_function",
                                  args=[str(call_file), tmp])
        check(job)
        with open(call_file, "wb") as fh:
            pickle.dump((entrypoint.__module__, entrypoint.__qualname__, args, _main_path()), fh)
        code = run(job)
        if code != 0:
            raise LaunchError(f"job {config.run_id!r} failed with exit code {code}", code)
        results = {}
        for path in sorted(Path(tmp).glob("result_*.pkl")):
            with open(path, "rb") as fh:
                results[int(path.stem.split("_")[1])] = pickle.load(fh)
        return results


def _main_path() -> str | None:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if path else None
