"""Linux ``prctl(2)`` for the two things elastrun asks of it: a parent-death signal, a child subreaper.

One ctypes binding for the agent (the pool adopts its orphaned workers) and the template (its
forked workers die with it).  The exec path's shim (:mod:`elastrun.agent.workers.spawn`) makes the same
call in a bare ``python -S`` interpreter that cannot import elastrun, so it spells it out there.
"""

from __future__ import annotations

import ctypes
import os

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int | ctypes._Pointer, what: str) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({what}): {os.strerror(err)}")


def set_parent_death_signal(sig: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits."""
    _prctl(PR_SET_PDEATHSIG, int(sig), "PR_SET_PDEATHSIG")


def child_subreaper() -> bool:
    """Whether this process adopts its orphaned descendants."""
    flag = ctypes.c_int(0)
    _prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), "PR_GET_CHILD_SUBREAPER")
    return bool(flag.value)


def set_child_subreaper(on: bool) -> None:
    """Make this process adopt (or stop adopting) its orphaned descendants."""
    _prctl(PR_SET_CHILD_SUBREAPER, int(on), "PR_SET_CHILD_SUBREAPER")
