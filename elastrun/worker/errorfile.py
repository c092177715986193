"""Worker error files: torch's ``@record`` format, written by ``elastrun.record``, read by the agent.

torch's ``torch.distributed.elastic.multiprocessing.errors.record`` writes, when the decorated
function raises, a JSON file at ``$TORCHELASTIC_ERROR_FILE``::

    {"message": {"message": "ValueError: ...", "extraInfo": {"py_callstack": "Traceback ...",
                 "timestamp": "1700000000"}}}

``elastrun.record`` writes the same shape, so either decorator works under elastrun and torchrun,
and the agent reads the traceback back for its root-cause summary
(:func:`elastrun.agent.workers.reports.read_error_file`).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def write_error_file(exc: BaseException, path: str | None = None) -> None:
    """Write ``exc`` with its traceback to the worker's error file (no-op when there is none).

    The first error wins: an existing file is left alone, as torch does, so that the root cause
    is not overwritten by a later, consequential error.
    """
    path = path or os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError as err:
        print(f"elastrun: could not write error file {path}: {err}", file=sys.stderr)


def record(fn: F) -> F:
    """Decorate a worker's main function so that an uncaught exception lands in its error file.

    Example::

        import elastrun

        @elastrun.record
        def main():
            ...

        if __name__ == "__main__":
            main()
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                write_error_file(exc)
            raise
        except BaseException as exc:
            write_error_file(exc)
            raise

    return wrapper  # type: ignore[return-value]
