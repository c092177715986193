"""How ``elastrun.train`` speaks: Python warnings of its own category, quiet under the launch's ``-q``.

Its messages are warnings (a snapshot skipped, a checkpoint unreadable) raised inside the
user's training script, so they stay :mod:`warnings`: the script and its tests can filter and
catch them (``TrainWarning`` is a ``UserWarning``).  The launching agent tells its workers its
console level in ``ELASTRUN_LOG_LEVEL`` (:data:`elastrun.shared.log.LEVEL_ENV`); at ``-q`` (``ERROR``)
these warnings are not shown, as no other warning of elastrun is.
"""

from __future__ import annotations

import os
import warnings

from elastrun.shared.log import LEVEL_ENV


class TrainWarning(UserWarning):
    """A warning of ``elastrun.train``."""


def warn(message: str, stacklevel: int = 1) -> None:
    """``warnings.warn(message, TrainWarning)`` attributed ``stacklevel`` frames above the caller."""
    warnings.warn(message, TrainWarning, stacklevel=stacklevel + 1)


if os.environ.get(LEVEL_ENV) == "ERROR":
    warnings.filterwarnings("ignore", category=TrainWarning)
