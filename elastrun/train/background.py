"""One background job at a time, with errors handed back to the training thread."""

from __future__ import annotations

import threading
from collections.abc import Callable


class BackgroundJob:
    """Runs callables on a helper thread, one at a time.

    :meth:`wait` blocks until the running job is done and re-raises its exception, so a failing
    snapshot write (``/dev/shm`` full, a bad checkpoint directory) surfaces in the training loop
    instead of being lost on a thread.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, fn: Callable[[], None]) -> None:
        """Wait for the previous job, then start ``fn``."""
        self.wait()

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # handed to the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until idle (False if ``timeout`` expired first); re-raise a job's failure."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                return False
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"elastrun.train background job {self.name!r} failed: {err}") from err
        return True
