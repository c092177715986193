"""The launch configuration: everything one agent needs to know, already validated.

The command line (``elastrun.cli``) and the Python API (``elastrun.launcher``) both build a
:class:`LaunchConfig`; the agent only ever sees this object, never raw flags.  Keeping the
validated form in one dataclass means every entry point gets the same checks and defaults.
"""

from __future__ import annotations

import enum
import math
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from elastrun.errors import UsageError
from elastrun.shared.protocol import exec_argv


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

#: Signals the agent forwards to its workers before stopping (torchrun's --signals-to-handle).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
START_METHODS = ("spawn", "fork", "forkserver")
_NO_TIMEOUT = "use seconds > 0, or leave the flag out to turn the check off"

#: What each checked field allows, as an error message says it (the command line words some of
#: them its own way, e.g. ``--nproc-per-node`` also takes auto, cpu or gpu).
ALLOWED: dict[str, str] = {
    "min_nodes": "use N or MIN:MAX with 1 <= MIN <= MAX, e.g. --nnodes=2 or --nnodes=1:4",
    "nproc_per_node": "use a positive integer",
    "max_restarts": "use an integer >= 0",
    "crash_loop_limit": "use an integer >= 0",
    "node_rank": "use an integer >= 0",
    "master_port": "use a port in 1-65535, or leave it out for a free one",
    "metrics_port": "use a port in 1-65535",
    "monitor_interval": "use seconds > 0, e.g. 0.1",
    "stop_timeout": "use seconds >= 0",
    "exit_barrier_timeout": "use seconds >= 0",
    "reform_timeout": "use seconds >= 0 (0 turns in-process re-forms off)",
    "hang_timeout": _NO_TIMEOUT,
    "startup_timeout": _NO_TIMEOUT,
}


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

    def validate(self, label: Callable[[str], str] | None = None, allowed: Mapping[str, str] | None = None) -> None:
        """Check every field against the others; raise :class:`UsageError` (one line) on the first mistake.

        The command line and :func:`elastrun.launcher.launch` both call this, so that a request is
        held to the same rules whichever way it was built.  ``label(field)`` says how a message
        names a field (the command line: the flag or ``PET_*`` variable and its value as typed;
        by default ``field=value``); ``allowed`` rewords :data:`ALLOWED` for some fields.  Only
        reads the fields: whether the entry point exists is the caller's to check.
        """
        name = label or self._label
        hints = {**ALLOWED, **(allowed or {})}

        def check(ok: bool, field: str, problem: str = " is out of range") -> None:
            if not ok:
                raise UsageError(f"{name(field)}{problem}; {hints[field]}")

        lo, hi = self.min_nodes, self.max_nodes
        check(lo >= 1, "min_nodes", ": a job needs at least 1 node")
        check(lo <= hi, "min_nodes", f": MIN ({lo}) is greater than MAX ({hi})")
        if self.standalone and (lo, hi) != (1, 1):
            raise UsageError(f"{name('standalone')} runs one node, but {name('min_nodes')}; drop one of the two")
        check(self.nproc_per_node >= 1, "nproc_per_node")
        static = self.rdzv_backend == "static"
        if static and lo != hi:
            raise UsageError(
                f"{name('min_nodes')}: the static backend needs a fixed node count; use --nnodes=N or an "
                "elastic backend such as --rdzv-backend=c10d"
            )
        if static:
            hints["node_rank"] = f"use an integer in [0, {hi})"
        check(self.node_rank >= 0 and (not static or self.node_rank < hi), "node_rank")
        for port in ("master_port", "metrics_port"):
            check(getattr(self, port) is None or 1 <= getattr(self, port) <= 65535, port)
        for count in ("max_restarts", "crash_loop_limit"):
            check(getattr(self, count) >= 0, count)
        check(0 < self.monitor_interval < math.inf, "monitor_interval")
        for seconds in ("stop_timeout", "exit_barrier_timeout", "reform_timeout"):
            check(0 <= getattr(self, seconds) < math.inf, seconds)
        for seconds in ("hang_timeout", "startup_timeout"):
            check(getattr(self, seconds) is None or 0 < getattr(self, seconds) < math.inf, seconds)
        if self.start_method not in START_METHODS:
            raise UsageError(f"{name('start_method')} is not a start method; use one of {', '.join(START_METHODS)}")
        if not self.role:
            raise UsageError(f"{name('role')} must not be empty; give a name such as trainer")
        self._validate_entry(name)
        for module in self.preload:
            if not _is_module_name(module):
                raise UsageError(f"{name('preload')}: {module!r} is not a module name; use e.g. torch,numpy")
        if self.quiet and self.verbose:
            raise UsageError(f"{name('quiet')} and {name('verbose')} exclude each other; use one of them")

    def _validate_entry(self, name: Callable[[str], str]) -> None:
        if self.module and self.no_python:
            raise UsageError(f"{name('module')} and {name('no_python')} exclude each other; use one of them")
        if self.run_path and (self.module or self.no_python):
            raise UsageError(f"{name('run_path')} runs a script file; drop {name('module')} and {name('no_python')}")
        if self.module and not _is_module_name(self.entrypoint):
            raise UsageError(f"{name('entrypoint')}: not a module name; give a dotted name such as pkg.train")

    def _label(self, field_name: str) -> str:
        value = getattr(self, field_name)
        return field_name if isinstance(value, bool) else f"{field_name}={value!r}"

    def worker_argv(self, python: str) -> list[str]:
        """The command line that an exec'd worker runs (``python`` is the interpreter to use).

        A Python script or module runs through elastrun's worker bootstrap (``python -u -c ...``),
        which runs it as ``__main__`` exactly as ``python -u [-m] TARGET`` would and then leaves
        past the interpreter's teardown; ``--run-path`` is therefore what every Python worker gets.
        """
        if self.no_python:
            return [self.entrypoint, *self.args]
        return exec_argv(python, self.entrypoint, self.module, list(self.args))


def _is_module_name(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))
