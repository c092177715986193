"""Errors that elastrun reports to the person who typed the command.

Kept in a module of their own, free of imports, so that the command line can raise and catch
them without loading the launcher (and torch).
"""

from __future__ import annotations


class UsageError(ValueError):
    """A flag, an environment variable or the entry point is wrong.

    The message is one line that says what is wrong and what is allowed, e.g.
    ``--nnodes=3:1: MIN (3) is greater than MAX (1); use N or MIN:MAX with 1 <= MIN <= MAX``.
    The command line prints it as ``elastrun: error: <message>`` and exits with status 2 before
    anything is started.  From Python (:func:`elastrun.launcher.launch`) it is a ValueError
    naming the LaunchConfig field.
    """
