"""How every Python worker runs its script and leaves: the Python-level exit, then ``os._exit``.

A worker's job is done when its script returns (or calls ``sys.exit``).  What a plain ``python
script.py`` does after that — ``Py_Finalize`` tearing down modules, then the C++ static
destructors — is where torch's process-group teardown races live: ``~ProcessGroupGloo`` joins
gloo's thread while holding the GIL that thread needs (a hang), or a ``std::thread`` is destroyed
while still joinable ("terminate called without an active exception", SIGABRT).  A job whose
every script finished could then hang or fail (pytorch#56297; measured in docs/benchmarks.md).

So both starters run the user's code through :func:`run_target` (the exec'd worker through the
``-c`` program of :func:`elastrun.shared.protocol.exec_argv`, the warm pool's forked worker directly), which:

1. runs the script or module as ``__main__``, as ``python [-m] TARGET ARGS`` would, with
   :mod:`elastrun.worker.pg_guard` keeping destroyed process groups alive until the exit (the
   same race, met inside the script when ``destroy_process_group()`` precedes freeing the model);
2. turns the way it ended into the exit code ``python`` would give (``SystemExit`` codes, an
   uncaught exception: traceback, error file, 1);
3. reports that code to the agent (:func:`elastrun.worker.heartbeat.report_exit`): from now on
   the agent treats a signal death or a hang of this process as a teardown fault, not a failure;
4. runs the Python-level shutdown — non-daemon threads joined, ``atexit`` handlers, stdio
   flushed — as the interpreter would;
5. leaves with ``os._exit(code)``, skipping interpreter finalisation and the C++ destructors.

A ``KeyboardInterrupt`` is not an exit code: after the same shutdown the worker dies by SIGINT,
as ``python`` does, and no exit is reported.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback

from elastrun.shared import stackdump
from elastrun.shared.procexit import python_shutdown
from elastrun.worker import pg_guard
from elastrun.worker.errorfile import write_error_file
from elastrun.worker.heartbeat import report_exit


def exec_main() -> None:
    """Entry point of an exec'd worker (argv after ``-c``: ``[-m] TARGET ARGS...``)."""
    argv = sys.argv[1:]
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        print("elastrun bootstrap: no script or module to run", file=sys.stderr)
        os._exit(2)
    target, args = argv[0], argv[1:]
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(target))
    sys.argv = ["-m" if module else target, *args]
    run_target(target, module, os.environ.get("TORCHELASTIC_ERROR_FILE"))


def run_target(target: str, module: bool, error_file: str | None) -> None:
    """Run ``target`` as ``__main__``, then leave as described in the module docstring.  Never returns."""
    pg_guard.install()
    stackdump.install()  # every thread's stack to stderr on request, the worker living on
    interrupted: KeyboardInterrupt | None = None
    try:
        code = _run(target, module, error_file)
    except KeyboardInterrupt as exc:
        interrupted = exc
        code = 130
    if interrupted is None:
        report_exit(code)
    else:
        traceback.print_exception(interrupted)  # printed before the exit steps, as by the interpreter
    python_shutdown()
    if interrupted is not None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _run(target: str, module: bool, error_file: str | None) -> int:
    """Run the user's code; the exit code ``python`` would give for how it ended."""
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # what the interpreter would print before exiting with 1
        tb = exc.__traceback__
        ours = (_run.__code__.co_filename, runpy.run_path.__code__.co_filename)
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        exc.with_traceback(tb)
        _write_error_file(exc, error_file)
        try:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        except Exception:
            traceback.print_exception(exc)
        return 1
    return 0


def _exit_code(exc: SystemExit) -> int:
    """``SystemExit``'s code as the interpreter maps it: None → 0, an int as is, anything else printed → 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def _write_error_file(exc: BaseException, path: str | None) -> None:
    try:
        write_error_file(exc, path)
    except Exception:
        traceback.print_exc()
