"""Journal records (SPEC §5): how each request went, one JSON line each.

Every request to a completion route gets exactly one :class:`TerminalRecord`
(``terminal`` not null), and it is the last record for its ``rid``. An
admitted request first gets a :class:`ProgressRecord` (``terminal: null``),
so that after a crash ``narwhal journal --unfinished`` can list the requests
that were in flight. Times are Unix epoch seconds (floats) derived from the
``now`` the adapter passes in plus the wall-clock offset it measured at
start-up; durations are milliseconds. Secrets never appear: records are
built only from fields listed here.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import attrs

from . import wire

__all__ = [
    "Terminal",
    "TERMINALS",
    "KvOutcome",
    "LegOutcome",
    "KvRecord",
    "LegRecord",
    "ErrorRecord",
    "ProgressRecord",
    "TerminalRecord",
    "encode",
]

Terminal = Literal["completed", "invalid", "denied", "rejected", "failed", "cancelled"]
TERMINALS: Final = ("completed", "invalid", "denied", "rejected", "failed", "cancelled")
KvOutcome = Literal["pulled", "released", "held_until_lease"]
#: How a leg ended: ``ok`` (2xx), ``refused`` (engine 4xx), ``http_error``
#: (5xx), ``connect_failed``, ``dropped``, ``timeout``, ``bad_kv`` (prefill
#: answer without usable KV params), ``bad_response`` (not HTTP or not JSON),
#: ``cancelled`` (Narwhal stopped it: client gone, deadline, shutdown),
#: ``local_error`` (Narwhal could not open the connection: out of file
#: descriptors, memory or local ports; not charged to the engine).
LegOutcome = Literal[
    "ok", "refused", "http_error", "connect_failed", "dropped", "timeout",
    "bad_kv", "bad_response", "cancelled", "local_error",
]


#: Records are plain slotted attrs classes, not frozen ones: each is built
#: once per leg or request and encoded at once, and a frozen class's
#: ``__init__`` (``object.__setattr__`` per field) made building a terminal
#: record cost twice as much. Treat them as values all the same.
@attrs.define(kw_only=True)
class KvRecord:
    """What became of the KV blocks a prefill leg left on its engine (SPEC §3)."""

    #: ``pulled``, ``released`` or ``held_until_lease``.
    outcome: KvOutcome
    #: The engine's key for the blocks (``remote_request_id``).
    owner: str
    #: The prefill engine holding the blocks.
    engine: str
    #: How the outcome came about: ``decode`` (pulled by a decode leg),
    #: ``abort_endpoint``, ``decode_abort`` or ``lease``.
    method: str
    #: Why a release did not happen, when it failed.
    error: str | None = None
    #: For ``decode_abort``: the backend ID of the dropped decode request that
    #: carried the release (it uses up one decode attempt number).
    release_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return {
            "outcome": self.outcome, "owner": self.owner, "engine": self.engine,
            "method": self.method, "error": self.error, "release_id": self.release_id,
        }


@attrs.define(kw_only=True)
class LegRecord:
    """One engine attempt of one phase."""

    #: ``prefill`` or ``decode``.
    phase: str
    #: 1-based attempt number within the phase.
    attempt: int
    #: The leg's backend ID, sent as its ``X-Request-Id``.
    backend_id: str
    #: The engine's base URL.
    engine: str
    #: The engine's HTTP status, if it answered.
    status: int | None
    #: How the leg ended (:data:`LegOutcome`).
    outcome: LegOutcome
    #: When the leg started (epoch seconds).
    started: float
    #: How long it lasted.
    duration_ms: float
    #: For a prefill leg that returned KV params: what became of the KV.
    kv: KvRecord | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return {
            "phase": self.phase, "attempt": self.attempt, "backend_id": self.backend_id,
            "engine": self.engine, "status": self.status, "outcome": self.outcome,
            "started": self.started, "duration_ms": self.duration_ms,
            "kv": None if self.kv is None else self.kv.to_json(),
        }


@attrs.define(kw_only=True)
class ErrorRecord:
    """The error a request ended with, as sent to the client."""

    #: OpenAI error ``type``.
    type: str
    #: Machine-readable code (``model_not_found``, ``engine_timeout``...).
    code: str | None
    #: The offending request field, if any.
    param: str | None
    #: The message the client saw.
    message: str
    #: The phase of the leg that failed, if a leg failed.
    leg: str | None = None
    #: The engine of the leg that failed, if a leg failed.
    engine: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return {
            "type": self.type, "code": self.code, "param": self.param,
            "message": self.message, "leg": self.leg, "engine": self.engine,
        }


@attrs.define(kw_only=True)
class ProgressRecord:
    """A request is under way (``terminal: null``); written at least once per admitted request."""

    #: When the record was made (epoch seconds).
    ts: float
    #: Router request ID.
    rid: str
    #: What happened: ``admitted``.
    event: str
    #: Completion route.
    route: str
    #: Trusted client ID.
    client: str
    #: Sanitised client ``x-request-id``.
    client_rid: str | None
    #: ``pd`` or ``single`` (no prefill engines configured).
    mode: str
    #: Whether the client asked for a stream.
    stream: bool

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return {
            "ts": self.ts, "rid": self.rid, "terminal": None, "event": self.event,
            "route": self.route, "client": self.client, "client_rid": self.client_rid,
            "mode": self.mode, "stream": self.stream,
        }


@attrs.define(kw_only=True)
class TerminalRecord:
    """How a request ended: the last record for its ``rid``."""

    #: When the record was made (epoch seconds).
    ts: float
    #: Router request ID (also the response's ``x-request-id``).
    rid: str
    #: Sanitised client ``x-request-id``, for correlation only.
    client_rid: str | None
    #: Trusted client ID (``None`` when authentication failed).
    client: str | None
    #: Completion route.
    route: str
    #: The model name the client asked for, the configured name when it named
    #: none (``None`` when the body could not be read).
    model: str | None
    #: Whether the client asked for a stream.
    stream: bool
    #: ``pd`` or ``single``.
    mode: str
    #: ``completed``, ``invalid``, ``denied``, ``rejected``, ``failed``, ``cancelled``.
    terminal: Terminal
    #: HTTP status sent to the client (499 when the client left first).
    status: int | None
    #: The error, or ``None`` for a completed request.
    error: ErrorRecord | None
    #: Every leg attempt, in order.
    legs: tuple[LegRecord, ...]
    #: The usage the client was given, when the engine reported it.
    usage: dict[str, Any] | None
    #: When the request arrived (epoch seconds).
    received: float
    #: From arrival to this record.
    duration_ms: float
    #: Time to the first byte of the answer body sent to the client.
    ttft_ms: float | None
    #: Router-owned body fields the client sent and Narwhal removed.
    stripped: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return {
            "ts": self.ts, "rid": self.rid, "client_rid": self.client_rid,
            "client": self.client, "route": self.route, "model": self.model,
            "stream": self.stream, "mode": self.mode, "terminal": self.terminal,
            "status": self.status,
            "error": None if self.error is None else self.error.to_json(),
            "legs": [leg.to_json() for leg in self.legs],
            "usage": self.usage, "received": self.received,
            "duration_ms": self.duration_ms, "ttft_ms": self.ttft_ms,
            "stripped": list(self.stripped),
        }


def encode(record: ProgressRecord | TerminalRecord) -> bytes:
    """One journal line: the record as compact JSON and a newline."""
    return wire.dumps_line(record.to_json())
