"""The launcher's flags: torchrun's, each with both spellings, its ``PET_`` variable, default and help.

:data:`FLAGS` is the one table that the parser (:mod:`elastrun.cli.parsing`), the environment
reader and ``elastrun --help`` (:func:`help_text`) are built from: a flag added here is accepted
on the command line and from the environment, and documented, at once.  No torch, nothing from the
launcher: ``elastrun --help`` stays instant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastrun.config import (
    DEFAULT_EXIT_BARRIER_TIMEOUT,
    DEFAULT_MASTER_PORT,
    DEFAULT_RDZV_PORT,
    DEFAULT_STOP_TIMEOUT,
    FORWARDED_SIGNALS,
)
from elastrun.rendezvous import conf as rdzv_conf

PROG = "elastrun"
#: The signals the agent always forwards to its workers, by name.
FORWARDED = tuple(sig.name for sig in FORWARDED_SIGNALS)


@dataclass(frozen=True)
class Flag:
    """One launcher flag: its names, where its value lands and how ``--help`` documents it.

    ``metavar`` is None for a switch (a flag without a value).  ``default`` is the raw value used
    when neither the command line nor the environment sets the flag.
    """

    names: tuple[str, ...]
    dest: str
    metavar: str | None
    default: str | None
    help: str
    group: str = ""
    #: Environment variables read after ``PET_<DEST>``.
    extra_env: tuple[str, ...] = ()
    #: torchrun accepts it; elastrun does not act on it and warns when it is set.
    ignored: bool = False

    @property
    def is_switch(self) -> bool:
        return self.metavar is None

    @property
    def env_names(self) -> tuple[str, ...]:
        return (f"PET_{self.dest.upper()}", *self.extra_env)

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every accepted name: each long name with dashes and with underscores."""
        out = list(self.names)
        out += ["--" + n[2:].replace("-", "_") for n in self.names if n.startswith("--") and "-" in n[2:]]
        return tuple(out)


def _group(title: str, *flags: Flag) -> tuple[Flag, ...]:
    return tuple(dataclasses.replace(flag, group=title) for flag in flags)




# fmt: off
FLAGS: tuple[Flag, ...] = (
    *_group("Nodes and workers",
        Flag(("--nnodes",), "nnodes", "N|MIN:MAX", "1:1",
             "Number of nodes: N, or MIN:MAX for an elastic job."),
        Flag(("--nproc-per-node",), "nproc_per_node", "N|auto|cpu|gpu", "1",
             "Workers per node: a positive integer, gpu (one per visible GPU), cpu (one per usable CPU) "
             "or auto (gpu when the installed torch can use a GPU here, else cpu)."),
    ),
    *_group("Rendezvous",
        Flag(("--rdzv-backend",), "rdzv_backend", "NAME", "static",
             "Rendezvous backend: c10d, static, etcd, etcd-v3 or one a package registers."),
        Flag(("--rdzv-endpoint",), "rdzv_endpoint", "HOST[:PORT]", "",
             f"Rendezvous endpoint; the port is {DEFAULT_RDZV_PORT} when left out, IPv6 is written "
             f"[ADDR]:PORT, the etcd backends take members H1:2379,H2:2379. c10d with no endpoint "
             f"uses localhost:{DEFAULT_RDZV_PORT}."),
        Flag(("--rdzv-id",), "rdzv_id", "ID", "none", "Job id, the same on every node of a job."),
        Flag(("--rdzv-conf",), "rdzv_conf", "K=V,...", "",
             "Backend settings, e.g. join_timeout=600,last_call_timeout=1."),
        Flag(("--standalone",), "standalone", None, None,
             "One-node job with its own c10d rendezvous on a free local port and a random run id; "
             "--rdzv-backend/--rdzv-endpoint/--rdzv-id given with it are ignored (with a warning)."),
    ),
    *_group("Workers, restarts and signals",
        Flag(("--max-restarts",), "max_restarts", "N", "0",
             "Worker-group restarts allowed for the whole job (torchrun counts them per node); a "
             "node joining or leaving does not spend one."),
        Flag(("--monitor-interval",), "monitor_interval", "SECONDS", "0.1",
             "How often the workers' state is checked."),
        Flag(("--start-method",), "start_method", "METHOD", "fork",
             "How workers are started: fork or forkserver fork them from the warm pool (a template "
             "process that imported torch once); spawn execs a fresh interpreter for each."),
        Flag(("--role",), "role", "NAME", "default", "Role name of this node's workers (ROLE_NAME)."),
        Flag(("--stop-timeout", "--shutdown-timeout"), "stop_timeout", "SECONDS", f"{DEFAULT_STOP_TIMEOUT:g}",
             "Grace period between forwarding a signal to the workers and SIGKILL (torchrun: 30).",
             extra_env=("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")),
        Flag(("--exit-barrier-timeout",), "exit_barrier_timeout", "SECONDS",
             f"{DEFAULT_EXIT_BARRIER_TIMEOUT:g}", "How long a node that finished waits for the others."),
    ),
    *_group("What the workers run",
        Flag(("-m", "--module"), "module", None, None, "SCRIPT is a module name, run like 'python -m'."),
        Flag(("--no-python",), "no_python", None, None, "SCRIPT is a program, run without 'python'."),
        Flag(("--run-path",), "run_path", None, None,
             "Run SCRIPT with runpy.run_path inside the worker's interpreter (what every Python "
             "worker does under elastrun; accepted for torchrun compatibility)."),
    ),
    *_group("Logs",
        Flag(("--log-dir",), "log_dir", "DIR", None,
             "Directory for per-attempt, per-rank log files (default: a temporary directory)."),
        Flag(("-r", "--redirects"), "redirects", "SPEC", "0",
             "Worker streams that go to log files only: 0 none, 1 stdout, 2 stderr, 3 both, for every "
             "local rank, or per rank as LOCAL_RANK:VALUE,... (e.g. 0:1,1:2)."),
        Flag(("-t", "--tee"), "tee", "SPEC", "0",
             "Worker streams that go to log files and the console (syntax of --redirects)."),
        Flag(("--local-ranks-filter",), "local_ranks_filter", "R,R,...", None,
             "Show only these local ranks on the console, e.g. 0,2 (log files keep all)."),
    ),
    *_group("Static rendezvous",
        Flag(("--node-rank",), "node_rank", "N", "0", "This node's rank, in [0, nnodes) (static only)."),
        Flag(("--master-addr",), "master_addr", "HOST", "127.0.0.1",
             "Address of the node of rank 0 (static only)."),
        Flag(("--master-port",), "master_port", "PORT", None,
             f"Port of the node of rank 0 (static only). Default {DEFAULT_MASTER_PORT}, except for a "
             "one-node job with no --rdzv-backend: there the agent binds a free port and holds it, so "
             f"jobs sharing a host never collide on {DEFAULT_MASTER_PORT}."),
        Flag(("--local-addr",), "local_addr", "HOST", None,
             "Address other nodes use to reach this one (default: looked up from the host name)."),
    ),
    *_group("elastrun only",
        Flag(("--preload",), "preload", "MOD,...", None,
             "Modules the warm worker pool imports ahead of time, e.g. torch,numpy."),
        Flag(("--event-log-stdout",), "event_log_stdout", None, None,
             "Also print the JSON-lines event log on stdout."),
        Flag(("--metrics-port",), "metrics_port", "PORT", None, "Serve metrics on this port (default: off)."),
        Flag(("--hang-timeout",), "hang_timeout", "SECONDS", None,
             "A worker that sends progress heartbeats (elastrun.heartbeat, elastrun.train's commit) and then "
             "stays silent this long is dumped and restarted (default: learned, 10 x its slowest step, "
             "at least 30 s)."),
        Flag(("--startup-timeout",), "startup_timeout", "SECONDS", None,
             "A worker that has not sent its first heartbeat this long after its start (or its re-form) is "
             "dumped and restarted (default: learned once a worker of the node has sent one: 5 x the slowest "
             "start to a first heartbeat, at least 30 s or --hang-timeout; off for scripts that never send one)."),
        Flag(("--crash-loop-limit",), "crash_loop_limit", "N", "3",
             "Stop the job, with exit code 3 (do not requeue), after N failed attempts in a row in which "
             "no worker made progress; 0 turns the check off."),
        Flag(("--reform-timeout",), "reform_timeout", "SECONDS", "5",
             "Workers of an elastrun.train.run script keep their process across restarts and resizes: "
             "one that has not left its process group this long after being asked is killed and "
             "restarted instead; 0 turns in-process re-forms off."),
        Flag(("-q", "--quiet"), "quiet", None, None, "Print only errors and the failure summary."),
        Flag(("-v", "--verbose"), "verbose", None, None, "Print the agent's debug messages."),
        Flag(("-h", "--help"), "help", None, None, "Show this help and exit."),
        Flag(("--version",), "version", None, None, "Show elastrun's version and exit."),
    ),
    *_group("torchrun flags accepted and ignored (a warning says so when one is set)",
        Flag(("--signals-to-handle",), "signals_to_handle", "SIG,...", ",".join(FORWARDED),
             "elastrun always forwards all of these.", ignored=True),
        Flag(("--event-log-handler",), "event_log_handler", "NAME", "null",
             "See --event-log-stdout.", ignored=True),
        Flag(("--logs-specs",), "logs_specs", "NAME", None, "", ignored=True),
        Flag(("--numa-binding",), "numa_binding", "MODE", None, "", ignored=True),
        Flag(("--duplicate-stdout-filters",), "duplicate_stdout_filters", "WORD,...", None, "", ignored=True),
        Flag(("--duplicate-stderr-filters",), "duplicate_stderr_filters", "WORD,...", None, "", ignored=True),
        Flag(("--virtual-local-rank",), "virtual_local_rank", None, None, "", ignored=True),
    ),
)
# fmt: on

BY_DEST: dict[str, Flag] = {flag.dest: flag for flag in FLAGS}
NO_ENV = ("help", "version")


def help_text() -> str:
    """``elastrun --help``: usage, then every flag with its default and environment variable."""
    import textwrap

    lines = [
        f"usage: {PROG} [flags] SCRIPT [ARGS...]",
        f"       {PROG} [flags] -m MODULE [ARGS...]",
        f"       {PROG} [flags] --no-python PROGRAM [ARGS...]",
        f"       {PROG} status|timeline|goodput ...",
        "",
        "Elastic, fault-tolerant launcher for PyTorch distributed training; a drop-in for torchrun.",
        "Everything after SCRIPT goes to the script. Each --flag-name also has the spelling",
        "--flag_name, and can be set by the environment variable shown (the command line wins;",
        f"boolean variables take {rdzv_conf.BOOL_HELP}).",
    ]
    group = ""
    for flag in FLAGS:
        if flag.group != group:
            group = flag.group
            lines += ["", f"{group}:"]
        lines.append("  " + ", ".join(flag.names) + (f" {flag.metavar}" if flag.metavar else ""))
        notes = [flag.help] if flag.help else []
        if flag.default:
            notes.append(f"Default: {flag.default}.")
        if flag.dest not in NO_ENV:
            notes.append("Env: " + ", ".join(flag.env_names) + ".")
        lines += textwrap.wrap(" ".join(notes), width=96, initial_indent=" " * 8, subsequent_indent=" " * 8)
    lines += [
        "",
        "Where elastrun's defaults differ from torchrun's: --master-port (a free port held by the agent",
        "for a one-node job with no --rdzv-backend, instead of 29500, so jobs sharing a host never",
        "collide), --stop-timeout 20 s (torchrun 30 s), and --max-restarts is a budget for the whole",
        "job rather than for each node.",
    ]
    return "\n".join(lines)
