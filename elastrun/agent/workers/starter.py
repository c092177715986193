"""The contract between the agent and the code that starts worker processes.

The agent describes each worker with a :class:`WorkerLaunch` and hands the list to a
:class:`WorkerStarter`, which returns one :class:`WorkerHandle` per worker.  Two starters exist:
``ExecStarter`` (a fresh interpreter per worker, like torchrun) and the warm pool's forking
starter.  Whatever the starter, a handle behaves like a child process of the agent: it has a PID
that leads its own process group, it can be waited on without blocking (``fileno`` is a pidfd
that becomes readable when the process exits), and it reports an exit code or a signal.

Example::

    starter = ExecStarter()
    handles = [starter.start(launch) for launch in launches]
    while not all(h.poll() is not None for h in handles):
        wait_for_any(handles, timeout=0.1)
"""

from __future__ import annotations

import abc
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from elastrun.agent.workers.cutoff import cut_tcp_connections
from elastrun.agent.workers.logs import tail_text
from elastrun.shared import priority, stackdump
from elastrun.shared.procstat import stat_fields


@dataclass
class WorkerLaunch:
    """Everything needed to start one worker process."""

    local_rank: int
    rank: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    #: Files that receive the worker's stdout / stderr (None: inherit the agent's stream).
    stdout_path: Path | None = None
    stderr_path: Path | None = None
    #: Also copy the redirected streams to the agent's console, prefixed.
    tee_stdout: bool = False
    tee_stderr: bool = False
    #: Prefix of every console line, e.g. ``"[node0 rank3]: "``.
    console_prefix: str = ""
    #: False to hide this rank's console output (``--local-ranks-filter``); files are still written.
    show_on_console: bool = True
    error_file: Path | None = None
    #: Python entry point parts, for starters that run Python code in-process instead of exec.
    python_target: str | None = None
    python_module: bool = False
    python_args: list[str] = field(default_factory=list)


@dataclass
class ExitStatus:
    """How a worker ended: ``exitcode`` for a normal exit, ``signal`` (number) when killed."""

    exitcode: int | None
    signal: int | None
    timestamp: float

    @property
    def succeeded(self) -> bool:
        return self.exitcode == 0

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def describe(self) -> str:
        if self.signal is not None:
            return f"killed by {self.signal_name}"
        return f"exit code {self.exitcode}"


class WorkerHandle(abc.ABC):
    """A started worker.  All methods are non-blocking except :meth:`wait`."""

    pid: int
    launch: WorkerLaunch
    #: How the worker was started, for the event log ("exec", "fork-pool").
    start_method: str = ""

    @abc.abstractmethod
    def poll(self) -> ExitStatus | None:
        """The exit status if the worker has ended (reaping it), else None."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """A descriptor that becomes readable when the worker exits (for ``select``)."""

    @abc.abstractmethod
    def send_signal(self, sig: int) -> None:
        """Deliver ``sig`` to the worker's whole process group; no error if it is already gone."""

    def wait(self, timeout: float | None = None) -> ExitStatus | None:
        """Block until the worker ends or ``timeout`` passes."""
        import select
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.poll()
            if status is not None:
                return status
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if remaining == 0.0:
                return None
            select.select([self.fileno()], [], [], remaining if remaining is not None else 1.0)

    def frozen(self) -> bool:
        """Whether the worker's process is stopped (SIGSTOP, a debugger) or in uninterruptible sleep
        (stuck in the kernel, e.g. on a dead file system) now.  Such a worker cannot merely be
        waiting on a peer: a silent worker in this state is hung itself.  False when unknown."""
        fields = stat_fields(self.pid)
        return bool(fields) and fields[0] in (b"T", b"t", b"D")

    def dying(self) -> bool:
        """Whether the worker's process is on its way out though not yet reaped: a SIGKILL pending, or the
        kernel tearing it down (:func:`process_dying`).  On a loaded host that can last a second or more after
        the kill (seen: 1.2 s on two busy cores), and such a process runs none of its script: the agent does not
        count it as seen running (``worker_exit``'s ``alive_at``, which places a crash in time).  False when
        unknown."""
        return process_dying(self.pid)

    def killed(self) -> bool:
        """Whether the worker's process is being ended by a SIGKILL, though not yet reaped
        (:func:`process_killed`): its script will run no further, and its status will say SIGKILL.  The
        agent need not wait for the reaping to act on that death (:func:`devices_on_host`).  False when
        unknown."""
        return process_killed(self.pid)

    def cut_off(self) -> int:
        """Shut down the worker's TCP connections from outside (:mod:`~elastrun.agent.workers.cutoff`):
        before a stopped worker is let run again, for its dump.  How many; 0 where not allowed."""
        return cut_tcp_connections(self.pid)

    def hasten(self) -> int:
        """Let the worker's low-priority threads run their exit now (:func:`hasten_exit`): call it once the
        worker is killed or seen on its way out.  How many threads were raised."""
        return hasten_exit(self.pid)

    def dump_stacks(self) -> bool:
        """Ask the worker for every thread's Python stack, written to its stderr, without ending it
        (:mod:`elastrun.shared.stackdump`); False when it cannot be asked (no handler yet, not Python, gone)."""
        return stackdump.request(self.pid)

    def set_console_prefix(self, prefix: str) -> None:
        """Prefix the worker's later console lines with ``prefix`` (a worker kept across a re-form
        gets a new rank); a no-op for a worker whose output does not pass through the agent."""

    def console_held(self) -> bool:
        """Whether the worker's console output is held back now: a traceback it printed as it died,
        awaiting the agent's judgement (:mod:`elastrun.agent.workers.logs`).  False for a worker whose
        output does not pass through the agent."""
        return False

    def release_console(self) -> None:
        """Print the held console output (the worker's own failure, or no judgement)."""

    def drop_console(self) -> None:
        """Leave the held console output out, and whatever else this ended worker still writes there:
        it is in its log and error files, and the agent says in one line why it stopped."""

    def stderr_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines the worker wrote to stderr ("" if none are known).

        For an ended worker, call it after :meth:`close`, which waits until its output is all read.
        """
        return tail_text(None, self.launch.stderr_path, lines)

    def close(self) -> None:
        """Release descriptors and log pumps.  Only after the worker has been reaped."""


class WorkerStarter(abc.ABC):
    """Starts workers.  Lives as long as the agent; ``close`` ends any helper processes."""

    #: Short name shown in logs ("exec", "fork-pool").
    name: str = ""

    @abc.abstractmethod
    def start(self, launch: WorkerLaunch) -> WorkerHandle:
        """Start one worker; raise ``OSError`` if it cannot be started."""

    def prepare(self) -> None:
        """Optional warm-up before the first start (e.g. begin importing torch in a template)."""

    def ready_fileno(self) -> int | None:
        """A descriptor that turns readable once :meth:`start` no longer waits for :meth:`prepare`'s
        warm-up (the template's imports done, or failed); None when nothing is pending.  Reading it
        is the starter's business: a caller only waits on it."""
        return None

    def close(self) -> None:
        """Stop helper processes; called once when the agent exits."""


#: ``PF_EXITING`` in ``/proc/PID/stat``'s flags: set once the kernel began ending the process, kept in a zombie.
_PF_EXITING = 0x4
#: SIGKILL's bit in ``/proc/PID/stat``'s pending signals: the kernel adds a fatal SIGKILL to every thread's own set.
_SIGKILL_BIT = 1 << (9 - 1)
#: Where the flags, the pending signals and the main thread's exit status (in ``waitpid``'s form, Linux 3.5 on)
#: are among the fields after the command name (fields 9, 31 and 52).
_FLAGS, _PENDING, _EXIT_CODE = 6, 28, 49
#: Indexes of the nice value and the scheduling policy among those fields (``proc(5)``'s fields 19 and 41).
_NICE, _POLICY = 16, 38
#: ``SCHED_BATCH`` and ``SCHED_IDLE``'s numbers (``sched.h``).
_LOW_POLICY_NAMES = {3: "batch", 5: "idle"}
#: Device files through which a process drives a GPU (NVIDIA's, AMD's): a host that has none runs no GPU worker.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")


def process_dying(pid: int) -> bool:
    """Whether process ``pid`` exits now (``PF_EXITING``) or a SIGKILL waits for its main thread; False when
    unknown.  One read of ``/proc/PID/stat`` (about 20 µs): the agent asks it of every running worker at each look."""
    return on_its_way_out(stat_fields(pid))


def on_its_way_out(fields: list[bytes]) -> bool:
    """From the fields of a process's ``/proc/PID/stat`` after its command name (:func:`stat_fields`): whether
    its flags say it exits, or its main thread's pending signals hold a SIGKILL.  False on fields it cannot read."""
    try:
        return bool(int(fields[_FLAGS]) & _PF_EXITING or int(fields[_PENDING]) & _SIGKILL_BIT)
    except (IndexError, ValueError):
        return False


def process_killed(pid: int) -> bool:
    """Whether process ``pid`` is being ended by a SIGKILL and not yet reaped; False when unknown.  One read of
    ``/proc/PID/stat``."""
    return killed_outright(stat_fields(pid))


def killed_outright(fields: list[bytes]) -> bool:
    """From the fields of a process's ``/proc/PID/stat`` after its command name: whether a SIGKILL is pending
    for its main thread, or its main thread has ended with SIGKILL as its status (``PF_EXITING``, the other threads
    still running their exit: a thread below normal priority on busy cores can take a minute).  Either way the
    process runs no more of its code.  A main thread ended otherwise (``pthread_exit``, an exit code) does not
    count: the process may still run, or its status is not known yet.  False on fields it cannot read."""
    try:
        if int(fields[_PENDING]) & _SIGKILL_BIT:
            return True
        return bool(int(fields[_FLAGS]) & _PF_EXITING) and int(fields[_EXIT_CODE]) & 0x7F == signal.SIGKILL
    except (IndexError, ValueError):
        return False


def devices_on_host() -> bool:
    """Whether this host has a GPU's device files.  A killed GPU worker still holds the card's memory until the
    kernel has released its context, which comes last, just before the reaping (about 1 s for 12 GB of
    page-locked memory on an H100, docs/benchmarks.md): its replacement could not have that memory yet.  So
    on such a host the agent waits for the reaping; elsewhere it acts on :meth:`WorkerHandle.killed`."""
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def thread_states(pid: int) -> str:
    """What each thread of process ``pid`` does in the kernel now, in one line: the main thread, then the
    others counted by state and wait channel (``proc(5)``), those below normal priority marked, e.g.
    ``main S futex_do_wait; others: 2 x S futex_do_wait, 1 x S do_epoll_wait, 1 x R (idle)``.

    Said where a worker did not answer its agent's pause: a main thread on a futex while a low-priority
    thread is runnable points at a starved holder of the interpreter lock; one reading a socket, at a
    collective still waiting on its peers.  Python's own stacks (:meth:`WorkerHandle.dump_stacks`) cannot
    tell these apart.  "" when the process is gone or unreadable."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except (OSError, ValueError):
        return ""
    main = ""
    others: dict[str, int] = {}
    for tid in tids:
        try:
            fields = stat_fields(pid, tid)
            with open(f"/proc/{pid}/task/{tid}/wchan", encoding="ascii", errors="replace") as fh:
                wchan = fh.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if not fields:
            continue
        label = fields[0].decode() + (f" {wchan}" if wchan not in ("", "0") else "")  # "0": running, or hidden
        try:
            low = _LOW_POLICY_NAMES.get(int(fields[_POLICY])) or (f"nice {int(fields[_NICE])}"
                                                                  if int(fields[_NICE]) > 0 else "")
        except (IndexError, ValueError):
            low = ""
        label += f" ({low})" if low else ""
        if tid == pid:
            main = label
        else:
            others[label] = others.get(label, 0) + 1
    if not main and not others:
        return ""
    rest = ", ".join(f"{n} x {label}" for label, n in sorted(others.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"main {main or 'gone'}" + (f"; others: {rest}" if rest else "")


def hasten_exit(pid: int) -> int:
    """Put each thread of process ``pid`` that runs below normal priority (``SCHED_IDLE``, ``SCHED_BATCH``, a
    positive nice value) back at normal priority; how many were raised.  Best effort: nothing when the
    process is gone or the caller may not (raising a priority takes root, ``CAP_SYS_NICE`` or ``RLIMIT_NICE``).

    A killed process ends only once each of its threads has run its exit.  A worker's snapshot copier runs
    at ``SCHED_IDLE`` (:mod:`elastrun.train.copier`), and on a host whose cores are all busy such a thread
    waits seconds for one (measured on two loaded cores: 1.7 to 22.8 s from the SIGKILL to the reaping, 1 to
    20 ms once raised; docs/benchmarks.md, "An agent's death on a busy host").  Meanwhile the process keeps
    its sockets, so its peers see no death, and it is not reaped, so its agent sees none either: it once
    judged the peer that waited on the killed rank hung instead.  Raised, the thread ends at once.
    """
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return 0
    return sum(1 for tid in tids if priority.is_low(tid) and priority.restore(tid))
