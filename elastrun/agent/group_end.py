"""How a local worker group ended: what the agent's loop acts on (:class:`GroupEnd`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from elastrun.rendezvous.api import FailureRecord


class Outcome(enum.Enum):
    """How one worker group ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    MEMBERSHIP = "membership"
    ABORTED = "aborted"
    SIGNALED = "signaled"


@dataclass
class GroupEnd:
    outcome: Outcome
    failure: FailureRecord | None = None
    reason: str = ""
    detected_at: float = 0.0
    exit_code: int = 1
