"""A process's or a thread's ``/proc/.../stat`` line, read and split once for both sides.

The agent reads its workers' (are they dying, stopped, what do their threads wait on:
:mod:`elastrun.agent.workers.starter`); a worker reads its own (its creation time for the step log,
its training thread's state and CPU time: :mod:`elastrun.train.stuck`).  The command name comes
second and may hold spaces and parentheses, so the fields are those after its last ``)``: the state
is field 0, ``proc(5)``'s field N is index N - 3.
"""

from __future__ import annotations


def parse_stat(stat: bytes) -> list[bytes]:
    """A ``/proc/PID/stat`` line's fields after the command name, or [] if it has none."""
    _, paren, rest = stat.rpartition(b")")
    return rest.split() if paren else []


def stat_fields(pid: int | str, tid: int | None = None) -> list[bytes]:
    """The fields of ``/proc/PID/stat`` (of thread ``tid``'s ``/proc/PID/task/TID/stat`` if given) after the
    command name, the state first; [] when unreadable."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path, "rb") as fh:
            return parse_stat(fh.read())
    except OSError:
        return []
