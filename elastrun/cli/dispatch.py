"""The ``elastrun`` command: a launch, or an observation tool (``status``, ``timeline``, ``goodput``).

:func:`main` hands a first word that names a tool to :mod:`elastrun.observe.cli`, and anything else
to :func:`elastrun.cli.parsing.parse` and then :func:`elastrun.launcher.run`.  :func:`command` is the
executable: :func:`main`, then a quick exit, and a closed pipe ends it as it ends any Unix tool.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from elastrun.cli.flags import PROG
from elastrun.cli.parsing import HelpRequested, parse
from elastrun.errors import UsageError
from elastrun.shared import log
from elastrun.shared.procexit import leave

#: First words that select an observation tool instead of a launch.
SUBCOMMANDS = ("status", "timeline", "goodput")


def _run_subcommand(argv: list[str]) -> int:
    """``elastrun status|timeline|goodput ...``: hand argv, subcommand first, to elastrun.observe.cli."""
    try:
        from elastrun.observe.cli import main as observe_main
    except ImportError as exc:
        log.get("cli").error(f"'{PROG} {argv[0]}' is not available in this installation ({exc})")
        return 2
    return observe_main(argv)


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """The ``elastrun`` command: parse, then launch; exit status 2 (one line on stderr) on a usage error.

    ``own_process``: the process is the command's own (:func:`command`), not a Python caller's; see
    :func:`elastrun.launcher.run`.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in SUBCOMMANDS:
        code = _run_subcommand(args)
        sys.stdout.flush()  # here, so that a closed pipe is seen (and ends the command) like a failed write
        return code
    try:
        config = parse(args, os.environ)
    except HelpRequested as request:
        print(request.text)
        sys.stdout.flush()
        return 0
    except UsageError as error:
        log.get("cli").error(" ".join(str(error).split()) or "invalid command line")
        return 2
    from elastrun.launcher import run

    return run(config, own_process=own_process)


def command() -> NoReturn:
    """The ``elastrun`` executable and ``python -m elastrun``: :func:`main`, then a quick exit.

    The process ends without the interpreter's teardown (:func:`elastrun.shared.procexit.leave`, after
    Python's own exit steps): with torch loaded that teardown takes 0.6-0.9 s at the end of every
    job and does nothing the agent needs.  :func:`main` itself returns, for callers in Python.
    """
    try:
        code = main(own_process=True)
    except BrokenPipeError:
        end_on_closed_pipe()
    leave(code)


def end_on_closed_pipe() -> NoReturn:
    """End the command as a Unix tool does when the reader of its output went away (``| head``).

    Nothing more is written (stdout now points at /dev/null, so no flush can fail again) and the
    process dies by SIGPIPE, as ``cat`` or ``yes`` do: the shell sees status 141, with no traceback.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(128 + signal.SIGPIPE)  # not reached: the default action of SIGPIPE ends the process
