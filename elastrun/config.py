"""The launch configuration: everything one agent needs to know, already validated.

The command line (``elastrun.cli``) and the Python API (``elastrun.launcher``) both build a
:class:`LaunchConfig`; the agent only ever sees this object, never raw flags.  Keeping the
validated form in one dataclass means every entry point gets the same checks and defaults.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from elastrun.workers.bootstrap import exec_argv


class Std(enum.IntFlag):
    """Which standard streams of a worker go to a file (``--redirects``) or to file and console (``--tee``).

    The numeric values are torchrun's: 0 none, 1 stdout, 2 stderr, 3 both.
    """

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


#: Defaults that differ from torchrun's, with the reason, are documented in README.md.
DEFAULT_RDZV_PORT = 29400
DEFAULT_MASTER_PORT = 29500
DEFAULT_STOP_TIMEOUT = 20.0
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0
#: How long a worker of an ``elastrun.train.run`` script may take to leave its group (in-process re-form).
DEFAULT_REFORM_TIMEOUT = 5.0

#: Exit code of an agent whose job failed in a way a retry will not fix (a crash loop): do not requeue.
EXIT_NO_REQUEUE = 3


@dataclass
class LaunchConfig:
    """A validated launch request for one node's agent.

    Attributes mirror torchrun's flags.  ``entrypoint`` is what each worker runs: a script path,
    a module name (``module=True``) or a program (``no_python=True``); ``args`` are its arguments.
    ``redirects``/``tee`` map a local rank to the streams that go to a file; a rank that is not in
    the map uses ``Std.NONE``.
    """

    entrypoint: str
    args: list[str] = field(default_factory=list)
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    run_id: str = "none"
    role: str = "default"
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_configs: dict[str, str] = field(default_factory=dict)
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "fork"
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    log_dir: str | None = None
    redirects: dict[int, Std] = field(default_factory=dict)
    tee: dict[int, Std] = field(default_factory=dict)
    local_ranks_filter: set[int] | None = None
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    stop_timeout: float = DEFAULT_STOP_TIMEOUT
    exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT
    preload: list[str] = field(default_factory=list)
    event_log_stdout: bool = False
    metrics_port: int | None = None
    quiet: bool = False
    verbose: bool = False
    hang_timeout: float | None = None
    startup_timeout: float | None = None
    crash_loop_limit: int = 3
    reform_timeout: float = DEFAULT_REFORM_TIMEOUT

    def worker_argv(self, python: str) -> list[str]:
        """The command line that an exec'd worker runs (``python`` is the interpreter to use).

        A Python script or module runs through elastrun's worker bootstrap (``python -u -c ...``),
        which runs it as ``__main__`` exactly as ``python -u [-m] TARGET`` would and then leaves
        past the interpreter's teardown; ``--run-path`` is therefore what every Python worker gets.
        """
        if self.no_python:
            return [self.entrypoint, *self.args]
        return exec_argv(python, self.entrypoint, self.module, list(self.args))
