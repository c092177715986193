"""The ``elastrun`` command line: torchrun's flags, read and checked, turned into a LaunchConfig.

Usage is torchrun's, so that switching is a one-word change::

    elastrun [launcher flags] SCRIPT [script args]
    elastrun [launcher flags] -m MODULE [module args]
    elastrun [launcher flags] --no-python PROGRAM [program args]
    elastrun status|timeline|goodput ...    (observation tools, see elastrun.observe)

Everything after SCRIPT belongs to the script, even words that look like launcher flags.  Every
flag has both spellings (``--nproc-per-node`` and ``--nproc_per_node``) and can also come from a
``PET_<NAME>`` environment variable (what Kubeflow's PyTorchJob sets); a flag on the command line
wins over the variable, which wins over the default.

The package's parts: :mod:`~elastrun.cli.flags` (the table of flags and ``--help``),
:mod:`~elastrun.cli.parsing` (argv and the environment read and checked into a
:class:`~elastrun.config.LaunchConfig`) and :mod:`~elastrun.cli.dispatch` (the command itself: a
launch or an observation tool, and how the process ends).
"""

from elastrun.cli.dispatch import SUBCOMMANDS, command, end_on_closed_pipe, main
from elastrun.cli.flags import FLAGS, PROG, Flag, help_text
from elastrun.cli.parsing import HelpRequested, parse, parse_with_warnings

__all__ = ["FLAGS", "PROG", "SUBCOMMANDS", "Flag", "HelpRequested", "command", "end_on_closed_pipe", "help_text",
           "main", "parse", "parse_with_warnings"]
