"""Workers' step records: when each step ran, when it was committed, when state was restored.

Runs in: each worker (writes them); the agent (stall reports) and the CLI (``elastrun goodput``/``timeline``) read them.

``elastrun.train`` writes them (``State.commit()``, ``restore()``, ``checkpoint()``/``flush()``)
so that goodput can tell kept steps from redone ones (:mod:`elastrun.observe.goodput`).  One
file per worker process, ``steps-<pid>.bin``, beside the process's error file in its attempt
directory under ``--log-dir`` (``attempt_<g>/rank_<r>/``; ``ELASTRUN_STEP_LOG`` names another
path).  Outside an elastrun agent nothing is written.

Cost: the file is memory-mapped and each record is one ``struct.pack_into`` into the mapping
(about a microsecond, no system call); the mapping grows by a system call every 21,845 records.
A record is in the kernel's page cache as soon as it is written, so a worker killed by SIGKILL
loses none.  The kind byte is written last, so a reader of a live file never sees half a record.

Layout: a 256-byte header (``ELSTEP1\\n`` and one JSON object: pid, node, created), then 48-byte
records, little-endian: kind ``u8`` (:data:`STEP`, :data:`RESTORE`, :data:`BLOCKED`), source
``u8`` (restore source, :data:`SOURCES`), 2 pad bytes, round ``i32``, rank ``i32``, world
``i32``, step ``i64``, t0 t1 t2 ``f64`` (Unix times).  A record of kind 0 ends the file.

- ``STEP``: step ``step`` (the count after the commit) ran from t0 (the previous commit's or
  restore's return, or the State's creation) to t1 (``commit()`` called); commit returned at t2.
- ``RESTORE``: ``restore()`` ran from t0 to t1 and left the state at ``step`` from ``source``.
- ``BLOCKED``: ``checkpoint()`` or ``flush()`` blocked from t0 to t1.
- ``SPACING``: from t2 on, memory snapshots are taken every ``step`` commits (chosen from their measured
  cost on a GPU: ``elastrun/train/spacing.py``); a step's device time is t0 seconds, a snapshot costs
  t1 seconds.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from elastrun.shared.procstat import stat_fields

MAGIC = b"ELSTEP1\n"
HEADER_SIZE = 256
RECORD = struct.Struct("<BBxxiiiqddd")
_BODY = struct.Struct("<Bxxiiiqddd")  # everything after the kind byte, written first
#: Records the mapping grows by (about 1 MiB).
GROW = 21845
#: Environment variable naming the file explicitly (else: beside TORCHELASTIC_ERROR_FILE).
PATH_ENV = "ELASTRUN_STEP_LOG"

STEP, RESTORE, BLOCKED, SPACING = 1, 2, 3, 4
#: Restore sources by code; 0 is a fresh start (nothing restored).
SOURCES = {0: None, 1: "memory", 2: "peer", 3: "disk", 4: "live"}
_SOURCE_CODES = {v: k for k, v in SOURCES.items()}


class Record(NamedTuple):
    """One decoded record (see the module docstring); a tuple, as a long job has hundreds of thousands."""

    kind: int
    source: str | None
    round: int
    rank: int
    world: int
    step: int
    t0: float
    t1: float
    t2: float

    @property
    def end(self) -> float:
        """When the recorded call returned."""
        return self.t2 if self.kind in (STEP, SPACING) else self.t1


@dataclass
class ProcessLog:
    """The records of one worker process."""

    pid: int
    node: str
    created: float
    records: list[Record]
    path: Path | None = None


def process_created() -> float:
    """This process's creation time (Unix time, 10 ms resolution), from /proc; now if unreadable."""
    try:
        ticks = int(stat_fields("self")[19])
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError):
        return time.time()


def default_path() -> Path | None:
    """Where this worker writes, or None outside an elastrun agent."""
    explicit = os.environ.get(PATH_ENV)
    if explicit:
        return Path(explicit)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not os.environ.get("ELASTRUN_NODE_ID") or not error_file:
        return None
    return Path(error_file).parent / f"steps-{os.getpid()}.bin"


class StepLog:
    """The writer: one per process (:func:`writer`).  Every method is cheap and never raises."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._count = 0
        self._capacity = 0
        self._since = time.time()
        self._round = self._rank = self._world = 0
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            header = json.dumps({"pid": os.getpid(), "node": os.environ.get("ELASTRUN_NODE_ID", ""),
                                 "created": round(process_created(), 3)}).encode()
            os.write(self._fd, (MAGIC + header + b"\n").ljust(HEADER_SIZE, b" "))
            self._grow()
        except (OSError, ValueError):
            self.close()
        self._where()

    @property
    def active(self) -> bool:
        return self._map is not None

    def _grow(self) -> None:
        if self._map is not None:
            self._map.close()
        self._capacity += GROW
        size = HEADER_SIZE + self._capacity * RECORD.size
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)

    def _where(self) -> None:
        """Take the round, rank and world size from the environment (they change at a re-form)."""
        env = os.environ
        try:
            self._round = int(env.get("ELASTRUN_ROUND", "0"))
            self._rank = int(env.get("RANK", "0"))
            self._world = int(env.get("WORLD_SIZE", "1"))
        except ValueError:
            pass

    def _put(self, kind: int, source: int, step: int, t0: float, t1: float, t2: float) -> None:
        if self._map is None:
            return
        try:
            if self._count >= self._capacity:
                self._grow()
            offset = HEADER_SIZE + self._count * RECORD.size
            _BODY.pack_into(self._map, offset + 1, source, self._round, self._rank, self._world, step, t0, t1, t2)
            self._map[offset] = kind
            self._count += 1
        except (OSError, ValueError):
            self.close()

    def step(self, step: int, entered: float) -> None:
        """``commit()`` was called at ``entered`` and returned now with ``step`` committed."""
        now = time.time()
        self._put(STEP, 0, step, self._since, entered, now)
        self._since = now

    def restored(self, began: float, step: int, source: str | None) -> None:
        """``restore()`` ran from ``began`` until now and left the state at ``step``."""
        self._where()
        now = time.time()
        self._put(RESTORE, _SOURCE_CODES.get(source, 0), step, began, now, now)
        self._since = now

    def blocked(self, began: float) -> None:
        """``checkpoint()`` or ``flush()`` blocked the training thread from ``began`` until now."""
        now = time.time()
        self._put(BLOCKED, 0, 0, began, now, now)
        self._since = now

    def spacing(self, every: int, meter: Any) -> None:
        """Snapshots are now taken every ``every`` commits (``meter``: a ``spacing.Meter``, its figures)."""
        step_s = float(getattr(meter, "step_s", 0.0) or 0.0)
        cost_s = float(getattr(meter, "cost_s", 0.0) or 0.0)
        self._put(SPACING, 0, every, step_s, cost_s, time.time())

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except (OSError, ValueError, BufferError):
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_writer: StepLog | None = None
_writer_pid = -1


def writer() -> StepLog:
    """This process's writer, opened on first use (a forked child opens its own)."""
    global _writer, _writer_pid
    if _writer is None or _writer_pid != os.getpid():
        _writer = StepLog(default_path())
        _writer_pid = os.getpid()
    return _writer


# ------------------------------------------------------------------------------------------- reading
def read(path: Path) -> ProcessLog | None:
    """Decode one file (None when it is not a step log); stops at the first empty record."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data.startswith(MAGIC) or len(data) < HEADER_SIZE:
        return None
    try:
        header = json.loads(data[len(MAGIC):HEADER_SIZE].split(b"\n", 1)[0])
    except ValueError:
        return None
    records = []
    body = memoryview(data)[HEADER_SIZE:]
    body = body[:len(body) - len(body) % RECORD.size]
    for kind, source, rnd, rank, world, step, t0, t1, t2 in RECORD.iter_unpack(body):
        if kind == 0:
            break
        records.append(Record(kind, SOURCES.get(source), rnd, rank, world, step, t0, t1, t2))
    return ProcessLog(int(header.get("pid", 0)), str(header.get("node", "")), float(header.get("created", 0.0)),
                      records, path)


def last(path: Path) -> Record | None:
    """The newest record of one file, read without decoding the others (None: none, or no step log).

    Records are written in order and the file is grown with zeros, so the filled ones are a prefix:
    a binary search on the kind byte finds the last.  For a live worker's file (the agent's report
    of a stalled worker).
    """
    try:
        with open(path, "rb") as fh:
            if fh.read(len(MAGIC)) != MAGIC:
                return None
            size = os.fstat(fh.fileno()).st_size
            lo, hi = 0, max(0, (size - HEADER_SIZE) // RECORD.size)  # the first empty record is in [lo, hi]

            def kind(i: int) -> int:
                fh.seek(HEADER_SIZE + i * RECORD.size)
                return fh.read(1)[0]

            while lo < hi:
                mid = (lo + hi) // 2
                if kind(mid):
                    lo = mid + 1
                else:
                    hi = mid
            if lo == 0:
                return None
            fh.seek(HEADER_SIZE + (lo - 1) * RECORD.size)
            k, source, rnd, rank, world, step, t0, t1, t2 = RECORD.unpack(fh.read(RECORD.size))
    except (OSError, IndexError, struct.error):
        return None
    return Record(k, SOURCES.get(source), rnd, rank, world, step, t0, t1, t2)


def read_dirs(dirs: list[Path] | list[str]) -> dict[int, ProcessLog]:
    """Every step log under ``dirs`` (searched recursively), by process id."""
    out: dict[int, ProcessLog] = {}
    for d in dirs:
        base = Path(d)
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("steps-*.bin")):
            got = read(path)
            if got is not None:
                out[got.pid] = got
    return out
