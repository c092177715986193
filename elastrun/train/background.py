"""One background job at a time, with errors handed back to the training thread."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable


class BackgroundJob:
    """Runs callables on one long-lived helper thread, one at a time.

    The thread is started on the first :meth:`submit` (and again in a forked child, where it
    does not exist) and then kept: starting a thread per job cost 1-2 ms of the training thread
    per step on a busy machine, waiting for the new thread to be scheduled.

    :meth:`wait` blocks until the running job is done and re-raises its exception, so a failing
    snapshot write (``/dev/shm`` full, a bad checkpoint directory) surfaces in the training loop
    instead of being lost on a thread.  :meth:`close` ends the thread once its job is done (a closed
    ``State`` leaves none behind: the GPU benchmark found one parked thread per ``State`` made).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._job: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._closing = False

    def busy(self) -> bool:
        with self._cond:
            return self._job is not None

    def submit(self, fn: Callable[[], None]) -> None:
        """Wait for the previous job, then run ``fn`` on the helper thread."""
        self.wait()
        with self._cond:
            self._job, self._closing = fn, False
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closing:
                    self._cond.wait()
                if self._job is None:
                    self._thread = None
                    return
                job = self._job
            try:
                job()
            except BaseException as e:  # handed to the training thread by wait()
                with self._cond:
                    self._error = e
            del job  # what the job holds (a snapshot's slot) is not kept until the next one
            with self._cond:
                self._job = None
                self._cond.notify_all()

    def close(self, timeout: float | None = None) -> bool:
        """:meth:`wait` (bounded by ``timeout``), then let the helper thread end; a later
        :meth:`submit` starts a new one.  False if the job was still running at the timeout."""
        idle = self.wait(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        return idle

    def wait(self, timeout: float | None = None) -> bool:
        """Block until idle (False if ``timeout`` expired first); re-raise a job's failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._pid and self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._job, self._thread, self._pid = None, None, 0
            while self._job is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            if self._error is not None:
                err, self._error = self._error, None
                raise RuntimeError(f"elastrun.train background job {self.name!r} failed: {err}") from err
        return True
