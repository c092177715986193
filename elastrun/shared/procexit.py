"""Ending a process that has loaded torch: Python's own exit steps, then ``os._exit``.

After a script (a worker's) or the agent is done, what ``Py_Finalize`` does next — tearing down
every module, then the C++ static destructors — costs 0.6–0.9 s with torch loaded on two cores,
and is where torch's teardown races live (a hang or SIGABRT after the work is done).  Nothing
there is needed: :func:`python_shutdown` runs the steps a program can observe (non-daemon threads
joined, ``atexit`` handlers such as logging's flush, stdio flushed, C stdio included) and
:func:`leave` then ends the process with the exit code.

Used by the worker bootstrap (:mod:`elastrun.worker.bootstrap`) and by the ``elastrun``
command (:func:`elastrun.cli.command`); a library call such as :func:`elastrun.launch` returns
normally and leaves the caller's process alone.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import traceback
from typing import NoReturn


def python_shutdown() -> None:
    """What ``Py_Finalize`` does before it tears anything down: join threads, run ``atexit``, flush."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as at exit
    except Exception:
        traceback.print_exc()
    atexit._run_exitfuncs()
    flush()


def flush() -> None:
    """Flush Python's streams and C's stdio buffers (native code's ``printf``), which ``os._exit`` would drop."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def leave(code: int) -> NoReturn:
    """Run :func:`python_shutdown`, then end the process with ``code`` without the interpreter's teardown."""
    python_shutdown()
    os._exit(code)
