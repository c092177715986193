"""The job token: a shared secret that authenticates every value the agents of a job write.

Without a token anyone who reaches the rendezvous store can write its keys (docs/rendezvous-protocol.md,
"Threat model").  With ``--rdzv-conf token_file=PATH`` (or ``$ELASTRUN_JOB_TOKEN``) every agent
derives, with HKDF-SHA256 (RFC 5869, on the standard library's ``hmac``):

- a **job key** from the token and the run id;
- per *incarnation* of the job (a fresh random nonce chosen by whoever creates the job's state,
  published in the public marker ``/elastrun/<run_id>/auth`` with a check value), a **session key**;
- from the session key, a secret **namespace**: the job's keys live under
  ``/elastrun/<run_id>/<namespace>/``, which a client without the token cannot name;
- a MAC on every value: ``value#<tag>`` with ``tag`` = HMAC-SHA256(session key, key ‖ 0 ‖ value)
  truncated to 128 bits, base64url.  The MAC covers the full key (run id, namespace, round
  number, node id, slot), so a value cannot be replayed under another key, in another round, in
  another job or in an earlier run of the same job id (another nonce, another session key).

A value whose tag is missing or wrong is never acted on: :meth:`JobAuth.open` returns None and
reports it once per key through the handler's warning callback.  Counters updated with the store's
atomic ``add`` carry no MAC; the protocol uses them only as hints (see the protocol doc).

With no token, :data:`NO_AUTH` is used: values go to the store unchanged and nothing is derived.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Callable

from elastrun.rendezvous.api import RendezvousConfigError

#: Environment variable holding the token itself (e.g. from a Kubernetes Secret).
TOKEN_ENV = "ELASTRUN_JOB_TOKEN"
#: Tokens shorter than this many characters are accepted with a warning (guessable offline).
MIN_TOKEN_CHARS = 16
_SCHEME = "hmac-sha256"
_TAG_BYTES = 16
_SEP = "#"


class JobTokenRejected(RendezvousConfigError):
    """This node's token (or its lack of one) does not match the job's: it cannot join (exit 2)."""


def hkdf_sha256(secret: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF (RFC 5869) with SHA-256: extract a pseudo-random key from ``secret``, expand it to ``length``."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def load_token(token_file: str | None, warn: Callable[[str], None] | None = None) -> bytes | None:
    """The job token from ``token_file`` or ``$ELASTRUN_JOB_TOKEN`` (the file wins); None when neither is set.

    Raises :class:`RendezvousConfigError` (one line saying what to do) for a file that is missing,
    unreadable or empty.  A file that others can read, or a short token, is a warning.
    """
    warn = warn or (lambda _msg: None)
    if token_file:
        try:
            info = os.stat(token_file)
        except FileNotFoundError:
            raise RendezvousConfigError(
                f"--rdzv-conf token_file={token_file!r}: no such file; create it on every node "
                "(e.g. `openssl rand -hex 32 > FILE; chmod 600 FILE`)"
            ) from None
        except OSError as exc:
            raise RendezvousConfigError(f"--rdzv-conf token_file={token_file!r}: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode):
            raise RendezvousConfigError(f"--rdzv-conf token_file={token_file!r} is not a regular file")
        try:
            with open(token_file, "rb") as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise RendezvousConfigError(
                f"--rdzv-conf token_file={token_file!r} cannot be read ({exc.strerror}); "
                "make it readable by the user running elastrun"
            ) from None
        if not token:
            raise RendezvousConfigError(
                f"--rdzv-conf token_file={token_file!r} is empty; put a secret in it (e.g. `openssl rand -hex 32`)"
            )
        if info.st_mode & (stat.S_IRWXO | stat.S_IRWXG):
            warn(f"job token file {token_file} can be read by other users; run `chmod 600 {token_file}`")
    else:
        raw = os.environ.get(TOKEN_ENV, "").strip()
        if not raw:
            return None
        token = raw.encode()
    if len(token) < MIN_TOKEN_CHARS:
        warn(f"the job token is short ({len(token)} characters) and could be guessed; use `openssl rand -hex 32`")
    return token


class JobAuth:
    """Seals and opens the values of one job incarnation (see the module docstring)."""

    enabled = True

    def __init__(self, job_key: bytes, run_id: str, nonce: str) -> None:
        self.run_id = run_id
        self.nonce = nonce
        self._session = hkdf_sha256(job_key, nonce.encode(), b"elastrun session")
        self.namespace = hmac.new(self._session, b"namespace", hashlib.sha256).hexdigest()[:16]
        self.prefix = f"/elastrun/{run_id}/{self.namespace}/"
        self.on_forged: Callable[[str, str], None] = lambda key, why: None
        self._reported: set[str] = set()
        #: Values rejected so far (all keys), for tests and benchmarks.
        self.rejected = 0

    def _tag(self, key: str, value: bytes) -> str:
        mac = hmac.new(self._session, key.encode() + b"\0" + value, hashlib.sha256).digest()[:_TAG_BYTES]
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def seal(self, key: str, value: str | bytes) -> str:
        """``value`` with its tag appended, ready to be written under ``key``."""
        text = value.decode() if isinstance(value, bytes) else value
        return f"{text}{_SEP}{self._tag(key, text.encode())}"

    def open(self, key: str, raw: bytes | str | None) -> str | None:
        """The value written under ``key`` if its tag is right; None (reported once) if it is absent or forged."""
        if raw is None:
            return None
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        value, sep, tag = text.rpartition(_SEP)
        if not sep:
            self._forged(key, "value has no authentication tag")
            return None
        if not hmac.compare_digest(tag, self._tag(key, value.encode())):
            self._forged(key, "authentication tag does not match (forged, replayed or written with another token)")
            return None
        return value

    def seal_line(self, key: str, line: str) -> str:
        """One line of an appended list (each line is sealed on its own, ending in a newline)."""
        return self.seal(key, line) + "\n"

    def open_lines(self, key: str, raw: bytes | str | None) -> list[str]:
        """The authentic lines of an appended list under ``key``, in order; forged lines dropped."""
        if raw is None:
            return []
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        lines = []
        for line in text.split("\n"):
            if line:
                value = self.open(key, line)
                if value is not None:
                    lines.append(value)
        return lines

    def _forged(self, key: str, why: str) -> None:
        self.rejected += 1
        if key not in self._reported:
            self._reported.add(key)
            self.on_forged(key, why)


class NoAuth:
    """The no-token case: values go to the store as they are and every value read is accepted."""

    enabled = False
    namespace = ""
    rejected = 0

    def __init__(self, run_id: str) -> None:
        self.prefix = f"/elastrun/{run_id}/"
        self.on_forged: Callable[[str, str], None] = lambda key, why: None

    def seal(self, key: str, value: str | bytes) -> str | bytes:
        return value

    def open(self, key: str, raw: bytes | str | None) -> str | None:
        if raw is None:
            return None
        return raw.decode() if isinstance(raw, bytes) else raw

    def seal_line(self, key: str, line: str) -> str:
        return line + "\n"

    def open_lines(self, key: str, raw: bytes | str | None) -> list[str]:
        if raw is None:
            return []
        text = raw.decode() if isinstance(raw, bytes) else raw
        return [line for line in text.split("\n") if line]


class JobToken:
    """A loaded token (or none) for one run id: makes and checks the job's public ``auth`` marker."""

    def __init__(self, token: bytes | None, run_id: str) -> None:
        self.run_id = run_id
        self._job_key = None if token is None else hkdf_sha256(token, b"elastrun job token v1", run_id.encode())

    @property
    def enabled(self) -> bool:
        return self._job_key is not None

    def marker_key(self) -> str:
        """The public key holding the job's auth marker (outside the secret namespace)."""
        return f"/elastrun/{self.run_id}/auth"

    def _check(self, nonce: str) -> str:
        assert self._job_key is not None
        return hmac.new(self._job_key, b"check" + nonce.encode(), hashlib.sha256).hexdigest()[:32]

    def new_marker(self) -> str:
        """A marker for a new incarnation of the job: ``none``, or ``hmac-sha256:<nonce>:<check>``."""
        if self._job_key is None:
            return "none"
        nonce = secrets.token_hex(16)
        return f"{_SCHEME}:{nonce}:{self._check(nonce)}"

    def accept(self, marker: str | bytes, where: str) -> JobAuth | NoAuth:
        """The sealer for the job whose marker is ``marker``; :class:`JobTokenRejected` if it does not match."""
        text = marker.decode(errors="replace") if isinstance(marker, bytes) else marker
        if text == "none":
            if self._job_key is not None:
                raise JobTokenRejected(
                    f"job token rejected: job {self.run_id!r} at {where} runs without a job token; "
                    "remove token_file / ELASTRUN_JOB_TOKEN from this node, or restart the job with one"
                )
            return NoAuth(self.run_id)
        scheme, _, rest = text.partition(":")
        nonce, _, check = rest.partition(":")
        if self._job_key is None:
            raise JobTokenRejected(
                f"job token rejected: job {self.run_id!r} at {where} requires a job token; "
                "give --rdzv-conf token_file=PATH or set ELASTRUN_JOB_TOKEN"
            )
        if scheme != _SCHEME or not nonce or not hmac.compare_digest(check, self._check(nonce)):
            raise JobTokenRejected(
                f"job token rejected: this node's token does not match job {self.run_id!r} at {where}; "
                "give every node the same token (token_file / ELASTRUN_JOB_TOKEN)"
            )
        return JobAuth(self._job_key, self.run_id, nonce)
