"""The command line read and checked: argv and ``PET_`` variables turned into a :class:`LaunchConfig`.

The words are split by argparse (``allow_abbrev=False``, so a script argument is never taken for
an abbreviated launcher flag), on the table of :mod:`elastrun.cli.flags`.  What this module adds
on top: each value remembers where it came from, so that every error is one line naming the flag
or variable the bad value came from, an unknown flag gets a "did you mean", and start-up stays
cheap (no torch, nothing from the launcher).  Every check happens here, before anything starts,
so a mistake costs one line and exit status 2.

Everything after SCRIPT belongs to the script, even words that look like launcher flags.  A flag
on the command line wins over its ``PET_<NAME>`` variable, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from elastrun.cli.flags import BY_DEST, FLAGS, FORWARDED, NO_ENV, PROG, Flag, help_text
from elastrun.cli.values import (
    NPROC_ALLOWED,
    check_host,
    int_value,
    parse_endpoint,
    parse_nnodes,
    parse_nproc,
    parse_rdzv_conf,
    parse_std_spec,
)
from elastrun.config import ALLOWED, DEFAULT_MASTER_PORT, DEFAULT_RDZV_PORT, LaunchConfig
from elastrun.errors import UsageError
from elastrun.rendezvous import conf as rdzv_conf
from elastrun.shared import log

#: LaunchConfig fields named by another flag's dest.
_FIELD_FLAGS = {"min_nodes": "nnodes", "max_nodes": "nnodes", "run_id": "rdzv_id", "rdzv_configs": "rdzv_conf"}
#: Backends whose endpoint is a comma-separated list of etcd members.
ETCD_BACKENDS = ("etcd", "etcd-v3")
DEFAULT_ETCD_PORT = 2379
#: Backends whose endpoint syntax is checked here; a third-party backend checks its own.
CHECKED_BACKENDS = ("c10d", "static", *ETCD_BACKENDS)


class HelpRequested(Exception):
    """``-h``/``--help`` or ``--version`` was given; :func:`elastrun.cli.dispatch.main` prints ``text`` and exits 0."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


# --------------------------------------------------------------------------------------------
# Reading argv and the environment
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Value:
    """A raw flag value and where it came from (for error messages)."""

    raw: str | bool
    source: str  # the flag as typed ("--nnodes", "-r"), the variable ("PET_NNODES"), or "default"

    @property
    def given(self) -> bool:
        return self.source != "default"

    @property
    def from_cli(self) -> bool:
        return self.source.startswith("-")


class _Record(argparse.Action):
    """Stores a flag's value as a :class:`_Value` that remembers the spelling it was given with."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        raw = True if self.nargs == 0 else values
        setattr(namespace, self.dest, _Value(raw, option_string or self.option_strings[0]))


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes become :class:`UsageError` (one line) instead of usage and exit."""

    def error(self, message: str):  # noqa: ANN201 - never returns
        raise UsageError(f"{message}; see '{PROG} --help'")


def _build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag in FLAGS:
        parser.add_argument(
            *flag.spellings, dest=flag.dest, action=_Record, nargs=0 if flag.is_switch else None,
            default=argparse.SUPPRESS,
        )  # fmt: skip
    parser.add_argument("entry", nargs="?", default=None)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _tokenize(argv: Sequence[str]) -> tuple[dict[str, _Value], list[str]]:
    """Split argv into launcher flags and the entry point with its arguments.

    The first word that is not a flag or a flag's value (or the word after ``--``) is the entry
    point; everything after it is passed on untouched.  argparse accepts ``--flag VALUE``,
    ``--flag=VALUE``, ``-r VALUE``, ``-r3``, ``-r=3`` and bundled switches such as ``-qm``.
    """
    try:
        namespace, unknown = _build_parser().parse_known_args(list(argv))
    except argparse.ArgumentError as error:
        name = (error.argument_name or "").split("/")[0]
        if "expected one argument" in error.message:
            raise UsageError(f"{name} needs a value; give {name}=VALUE, see '{PROG} --help'") from None
        if "ignored explicit argument" in error.message:
            attached = error.message.split("'")[1] if "'" in error.message else ""
            if attached and len(name) == 2 and not attached.startswith("="):
                _unknown("-" + attached[0])  # a bundle of short switches such as -qx
            raise UsageError(f"{name} is a switch and takes no value; give {name} alone") from None
        raise UsageError(f"{name}: {error.message}") from None
    if unknown:
        _unknown(unknown[0].partition("=")[0])
    given = {dest: value for dest, value in vars(namespace).items() if isinstance(value, _Value)}
    rest = [namespace.entry, *namespace.rest] if namespace.entry is not None else []
    return given, rest


def _unknown(name: str) -> None:
    """Raise the error for an unknown option, with the closest flag as a suggestion."""
    import difflib

    known = [spelling for flag in FLAGS for spelling in flag.spellings]

    def shared_prefix(other: str) -> int:
        return len(os.path.commonprefix([name, other]))

    # A long shared prefix ("--nprocs" / "--nproc-per-node") beats difflib's overall similarity.
    best = max(known, key=shared_prefix)
    close = [best] if shared_prefix(best) >= 6 else difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]}?" if close else f"see '{PROG} --help' for the flags"
    raise UsageError(f"unknown option {name}; {hint}")


def _env_bool(name: str, text: str) -> bool:
    value = rdzv_conf.parse_bool(text)
    if value is None:
        raise UsageError(f"{name}={text!r} is not a boolean; use {rdzv_conf.BOOL_HELP}")
    return value


class _Settings:
    """Every flag's raw value (command line, then ``PET_<NAME>``, then default) and typed readers.

    The readers raise :class:`UsageError` naming the flag or variable the value came from.  An
    environment variable that is empty counts as unset.
    """

    def __init__(self, given: dict[str, _Value], environ: Mapping[str, str]) -> None:
        self.values: dict[str, _Value] = {}
        for flag in FLAGS:
            value = given.get(flag.dest)
            if value is None and flag.dest not in NO_ENV:
                for env_name in flag.env_names:
                    text = environ.get(env_name, "").strip()
                    if text:
                        value = _Value(_env_bool(env_name, text) if flag.is_switch else text, env_name)
                        break
            if value is None:
                value = _Value(False if flag.is_switch else (flag.default or ""), "default")
            self.values[flag.dest] = value

    def given(self, dest: str) -> bool:
        return self.values[dest].given

    def from_cli(self, dest: str) -> bool:
        return self.values[dest].from_cli

    def on(self, dest: str) -> bool:
        return self.values[dest].raw is True

    def text(self, dest: str) -> str:
        raw = self.values[dest].raw
        return raw.strip() if isinstance(raw, str) else ""

    def label(self, dest: str) -> str:
        """How a message names the value: ``--nnodes=3:1``, ``-r 0:9``, ``PET_NNODES=3:1``."""
        value = self.values[dest]
        where = value.source if value.given else BY_DEST[dest].names[-1]
        if isinstance(value.raw, bool) or not value.raw:
            return where
        return f"{where} {value.raw}" if len(where) == 2 else f"{where}={value.raw}"

    def int(self, dest: str) -> int:
        """The value as an integer; its range is :meth:`LaunchConfig.validate`'s to check."""
        return int_value(self.label(dest), self.text(dest), None, None, ALLOWED[dest])

    def seconds(self, dest: str) -> float:
        try:
            return float(self.text(dest))
        except ValueError:
            raise UsageError(f"{self.label(dest)} is not a number of seconds; {ALLOWED[dest]}") from None

    def optional_seconds(self, dest: str) -> float | None:
        return self.seconds(dest) if self.text(dest) else None

    def field_label(self, config: LaunchConfig) -> Callable[[str], str]:
        """How :meth:`LaunchConfig.validate` names a field: the flag or variable as it was given."""

        def label(field: str) -> str:
            if field == "entrypoint":
                return f"-m {config.entrypoint}"
            flag = BY_DEST[_FIELD_FLAGS.get(field, field)]
            return "/".join(flag.names) if flag.is_switch else self.label(flag.dest)

        return label


# --------------------------------------------------------------------------------------------
# The whole command line, one concern at a time
# --------------------------------------------------------------------------------------------


def _entry(s: _Settings, rest: list[str]) -> dict[str, object]:
    """What each worker runs (its existence is checked by :func:`_check_entry_exists`)."""
    if not rest:
        raise UsageError(
            f"no training script given; usage: {PROG} [flags] SCRIPT [ARGS...], "
            "or -m MODULE, or --no-python PROGRAM"
        )
    return {
        "entrypoint": rest[0],
        "args": rest[1:],
        "module": s.on("module"),
        "no_python": s.on("no_python"),
        "run_path": s.on("run_path"),
    }


def _check_entry_exists(config: LaunchConfig) -> None:
    """A missing script or program is an error here, not in a worker."""
    entry = config.entrypoint
    if config.module:
        return
    if config.no_python:
        import shutil

        if shutil.which(entry) is None:
            raise UsageError(
                f"--no-python {entry}: no such executable program; give a program in PATH or a path"
            )
    elif not (os.path.isfile(entry) or os.path.isfile(os.path.join(entry, "__main__.py"))):
        raise UsageError(
            f"script {entry!r} not found (in {os.getcwd()}); "
            "give a Python file, -m MODULE or --no-python PROGRAM"
        )


def _rendezvous(s: _Settings, min_nodes: int, max_nodes: int, warnings: list[str]) -> dict[str, object]:
    """Backend, endpoint, run id and the static backend's settings; applies --standalone."""
    backend, endpoint, run_id = s.text("rdzv_backend"), s.text("rdzv_endpoint"), s.text("rdzv_id") or "none"
    standalone = s.on("standalone")
    if standalone:
        explicit = [("rdzv_backend", "c10d"), ("rdzv_endpoint", ""), ("rdzv_id", "none")]
        ignored = [s.label(dest) for dest, same in explicit if s.from_cli(dest) and s.text(dest) != same]
        if ignored:
            warnings.append(f"--standalone ignores {', '.join(ignored)}")
        import uuid

        backend, endpoint, run_id = "c10d", "localhost:0", str(uuid.uuid4())

    if backend not in ("c10d", "static"):
        from elastrun.rendezvous.registry import known_backends

        known = known_backends()
        if backend not in known:
            raise UsageError(
                f"{s.label('rdzv_backend')} is not a known rendezvous backend; known: {', '.join(known)}"
            )
    static = backend == "static"

    where = s.label("rdzv_endpoint")
    if backend in ETCD_BACKENDS:
        if not endpoint:
            raise UsageError(f"--rdzv-backend={backend} needs --rdzv-endpoint=HOST[:PORT],HOST[:PORT],...")
        endpoint = ",".join(
            parse_endpoint(where, member, DEFAULT_ETCD_PORT) for member in endpoint.split(",")
        )
    elif backend in CHECKED_BACKENDS and endpoint:
        if "," in endpoint:
            raise UsageError(f"{where}: only the etcd backends take several endpoints; give one HOST[:PORT]")
        endpoint = parse_endpoint(where, endpoint, DEFAULT_RDZV_PORT)
    elif backend == "c10d":
        endpoint = f"localhost:{DEFAULT_RDZV_PORT}"

    master_addr = check_host(s.label("master_addr"), s.text("master_addr"))
    master_port: int | None = None
    if s.given("master_port"):
        master_port = s.int("master_port")
    elif static and (s.given("rdzv_backend") or max_nodes > 1):
        master_port = DEFAULT_MASTER_PORT
    if not static:
        stray = [s.label(dest) for dest in ("node_rank", "master_addr", "master_port") if s.from_cli(dest)]
        if stray:
            warnings.append(f"{', '.join(stray)}: only used by the static backend; ignored with {backend}")
        master_port = None
    local_addr = check_host(s.label("local_addr"), s.text("local_addr")) if s.text("local_addr") else None
    return {
        "rdzv_backend": backend,
        "rdzv_endpoint": endpoint,
        "run_id": run_id,
        "standalone": standalone,
        "rdzv_configs": parse_rdzv_conf(s.label("rdzv_conf"), s.text("rdzv_conf")),
        "node_rank": s.int("node_rank"),
        "master_addr": master_addr,
        "master_port": master_port,
        "local_addr": local_addr,
    }


def _logs(s: _Settings, nproc: int, warnings: list[str]) -> dict[str, object]:
    """Log directory (checked, never created here), redirects, tee and the console filter."""
    log_dir = s.text("log_dir") or None
    if log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise UsageError(f"{s.label('log_dir')} exists and is not a directory; give a directory path")
    specs = {dest: parse_std_spec(s.label(dest), s.text(dest)) for dest in ("redirects", "tee")}
    for dest, spec in specs.items():
        beyond = sorted(rank for rank in spec if rank >= nproc)
        if beyond:
            warnings.append(f"{s.label(dest)} names local ranks {beyond}, but a node runs {nproc} workers")
    ranks: set[int] | None = None
    if s.text("local_ranks_filter"):
        if not re.fullmatch(r"\d+(,\d+)*", s.text("local_ranks_filter")):
            raise UsageError(f"{s.label('local_ranks_filter')} is not a list of local ranks; use e.g. 0,2")
        ranks = {int(rank) for rank in s.text("local_ranks_filter").split(",")}
    return {"log_dir": log_dir, **specs, "local_ranks_filter": ranks}


def _extras(s: _Settings, warnings: list[str]) -> dict[str, object]:
    """Timeouts, elastrun's own flags, and warnings for torchrun flags that have no effect here."""
    for flag in FLAGS:
        if flag.ignored and s.given(flag.dest):
            warnings.extend(_ignored_warning(s, flag))
    return {
        "max_restarts": s.int("max_restarts"),
        "monitor_interval": s.seconds("monitor_interval"),
        "stop_timeout": s.seconds("stop_timeout"),
        "exit_barrier_timeout": s.seconds("exit_barrier_timeout"),
        "hang_timeout": s.optional_seconds("hang_timeout"),
        "crash_loop_limit": s.int("crash_loop_limit"),
        "startup_timeout": s.optional_seconds("startup_timeout"),
        "reform_timeout": s.seconds("reform_timeout"),
        "preload": [name.strip() for name in s.text("preload").split(",") if name.strip()],
        "event_log_stdout": s.on("event_log_stdout"),
        "metrics_port": s.int("metrics_port") if s.text("metrics_port") else None,
        "quiet": s.on("quiet"),
        "verbose": s.on("verbose"),
    }


def _ignored_warning(s: _Settings, flag: Flag) -> list[str]:
    if flag.dest == "signals_to_handle":
        import signal

        names = [name.strip().upper() for name in s.text(flag.dest).split(",") if name.strip()]
        for name in names:
            if not isinstance(getattr(signal, name, None), signal.Signals):
                raise UsageError(f"{s.label(flag.dest)}: unknown signal {name}; use names such as SIGTERM")
        if set(names) <= set(FORWARDED):
            return []
        return [f"{s.label(flag.dest)}: elastrun forwards {','.join(FORWARDED)}, no other signal"]
    if s.values[flag.dest].raw in (False, flag.default):
        return []
    return [f"{s.label(flag.dest)} is accepted for torchrun compatibility and ignored by elastrun"]


def parse_with_warnings(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[LaunchConfig, list[str]]:
    """Read argv and ``environ`` into a checked :class:`LaunchConfig`, plus warning lines.

    Raises :class:`UsageError` on any mistake and :class:`HelpRequested` for ``--help``/``--version``.
    Nothing is created or started: the only side effects are reads (files, devices, PATH).
    """
    given, rest = _tokenize(argv)
    if "help" in given:
        raise HelpRequested(help_text())
    if "version" in given:
        from elastrun import __version__

        raise HelpRequested(f"{PROG} {__version__}")
    s = _Settings(given, environ)
    warnings: list[str] = []
    entry = _entry(s, rest)
    min_nodes, max_nodes = parse_nnodes(s.label("nnodes"), s.text("nnodes"))
    nproc = parse_nproc(s.label("nproc_per_node"), s.text("nproc_per_node"), environ)
    config = LaunchConfig(
        **entry,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        **_rendezvous(s, min_nodes, max_nodes, warnings),
        **_logs(s, nproc, warnings),
        **_extras(s, warnings),
        role=s.text("role"),
        start_method=s.text("start_method"),
    )
    config.validate(s.field_label(config), {"nproc_per_node": NPROC_ALLOWED})
    _check_entry_exists(config)
    return config, warnings


def parse(argv: list[str], environ: Mapping[str, str]) -> LaunchConfig:
    """Read argv (without the program name) and ``environ`` into a checked :class:`LaunchConfig`.

    Sets elastrun's console messages to ``--quiet``/``--verbose`` (:func:`elastrun.shared.log.configure`)
    and reports warnings (settings accepted but without effect) there, one line each.  Raises
    :class:`UsageError` for any mistake.
    """
    config, warnings = parse_with_warnings(argv, environ)
    log.configure(config.quiet, config.verbose)
    for line in warnings:
        log.get("cli").warning(line)
    return config
