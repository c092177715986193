"""elastrun: an elastic, fault-tolerant launcher for PyTorch distributed training.

Importing this package is cheap (no torch import); the launcher, the agent and the training
library live in sub-packages and are imported when used.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "record", "heartbeat"]


def __getattr__(name: str):
    # Lazy attributes keep ``import elastrun`` free of torch and of the agent's modules.
    if name == "record":
        from elastrun.worker.errorfile import record

        return record
    if name == "heartbeat":
        from elastrun.worker.heartbeat import heartbeat

        return heartbeat
    raise AttributeError(f"module 'elastrun' has no attribute {name!r}")
