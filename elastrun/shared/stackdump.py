"""Python stacks on request, without stopping the process: one signal both sides of a worker agree on.

A hung worker's stacks come from SIGABRT (faulthandler), which ends it.  Several moments want the
stacks of processes that must live on: a stalled group that is about to be re-formed in process
(its workers keep their process), and a test harness keeping the evidence of a failed run before it
kills anything.  So every Python worker (:mod:`elastrun.worker.bootstrap`) and every agent install
:func:`install`: on :data:`DUMP_SIGNAL` faulthandler writes every thread's Python stack to the
process's stderr (its log) from the signal handler itself, in C, so a thread blocked in a
collective, or one holding the interpreter lock, does not keep it from being written.

:func:`request` sends the signal only to a process that catches it (``SigCgt`` in
``/proc/<pid>/status``): a real-time signal's default action ends a process, and a worker in its
first milliseconds (a fork of the pool's template, a ``--no-python`` program) has no handler yet.

Example::

    from elastrun.shared import stackdump

    stackdump.install()                  # in the process to be asked
    stackdump.request(pid)               # from anywhere: True when the stacks are being written
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

#: The signal that asks for a stack dump (a real-time one: no meaning for user code; ``SIGRTMIN + 3``
#: is the re-form's interrupt, :mod:`elastrun.train.reform`).
DUMP_SIGNAL = signal.SIGRTMIN + 4


def install() -> None:
    """Write every thread's Python stack to stderr whenever this process receives :data:`DUMP_SIGNAL`.

    Idempotent; a process without a usable stderr (no descriptor) is left as it is.
    """
    try:
        faulthandler.register(DUMP_SIGNAL, file=sys.__stderr__ or sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError, OSError):
        pass


def catches(pid: int, sig: int = DUMP_SIGNAL) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` now (False when unknown or gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def request(pid: int) -> bool:
    """Ask ``pid`` for its stacks (:data:`DUMP_SIGNAL`) if it catches the signal; True when asked.

    A stopped process writes them once it is continued.  Nothing is waited for: faulthandler writes
    within milliseconds of the signal's delivery.
    """
    if not catches(pid):
        return False
    try:
        os.kill(pid, DUMP_SIGNAL)
    except OSError:
        return False
    return True
