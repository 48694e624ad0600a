"""Journal records (docs/contract.md, "The journal"; docs/operate.md): how each request went, one JSON line each.

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
    "RoutingRecord",
    "ProgressRecord",
    "TerminalRecord",
    "encode",
    "kv_json",
    "leg_json",
    "routing_json",
    "progress_line",
    "terminal_line",
]

Terminal = Literal["completed", "invalid", "denied", "rejected", "failed", "cancelled"]
TERMINALS: Final = ("completed", "invalid", "denied", "rejected", "failed", "cancelled")
#: What became of a prefill's KV, saying only what was confirmed (docs/operate.md,
#: "KV release in operation"): ``pulled`` (a decode leg took it), ``released``
#: (an engine confirmed the release), ``release_sent`` (a release went out, or
#: may have, and nothing confirmed it), ``held_until_lease`` (nothing Narwhal
#: sent reached the engine: it frees the blocks when their lease ends).
KvOutcome = Literal["pulled", "released", "release_sent", "held_until_lease", "none"]
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
#: record markedly dearer (benchmarks/README.md, "Figures behind the code").
#: Treat them as values all the same.
@attrs.define(kw_only=True)
class KvRecord:
    """What became of the KV blocks a prefill leg left on its engine (docs/contract.md, "Prefill and decode legs")."""

    #: ``pulled``, ``released``, ``release_sent`` or ``held_until_lease``; ``none`` when the
    #: prefill answer handed off no KV (``kv_transfer_params: null``): the
    #: engine holds nothing and the decode leg recomputed the prompt.
    outcome: KvOutcome
    #: The engine's key for the blocks (``remote_request_id``).
    owner: str
    #: The prefill engine holding the blocks.
    engine: str
    #: How the outcome came about: ``decode`` (pulled by a decode leg),
    #: ``decode_pull``, ``abort_endpoint``, ``decode_abort`` or ``lease``; ``none`` with the
    #: outcome ``none``.
    method: str
    #: Why a release did not happen, when it failed; with the outcome
    #: ``none``, why the prefill handed off no KV.
    error: str | None = None
    #: For ``decode_pull`` and ``decode_abort``: the backend ID of the decode
    #: request that carried the release.
    release_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return kv_json(self.outcome, self.owner, self.engine, self.method, self.error, self.release_id)


@attrs.define(kw_only=True)
class LegRecord:
    """One engine attempt of one phase."""

    #: ``prefill`` or ``decode``.
    phase: str
    #: 1-based attempt number within the phase.
    attempt: int
    #: The leg's backend ID, sent as its ``X-Request-Id`` unless ``request_id`` says otherwise.
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
    #: For a batch of prompts: the index of the prompt the leg served
    #: (absent from the JSON of a one-prompt request's legs).
    prompt: int | None = None
    #: The ``X-Request-Id`` the leg was sent when it is not ``backend_id``: a
    #: decode leg carrying NIXL connector 1 KV gets its prefill leg's
    #: (docs/operate.md, "vLLM compatibility"); absent from the JSON otherwise.
    request_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return leg_json(
            self.phase, self.attempt, self.backend_id, self.engine, self.status, self.outcome,
            self.started, self.duration_ms, None if self.kv is None else self.kv.to_json(), self.prompt,
            self.request_id,
        )


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
class RoutingRecord:
    """How an admitted request was routed (docs/operate.md, "The journal"; docs/configure.md, ``[routing]``)."""

    #: ``routing.policy``: ``least_loaded``, ``round_robin``, ``prefix`` or ``kv``.
    policy: str
    #: ``pd`` (a prefill leg, then a decode leg) or ``single`` (the whole request on a decode engine).
    mode: str
    #: Why that mode, one fixed word: ``configured``, ``no_prefill_engines``, ``short_prompt``,
    #: ``prefill_queue`` or ``long_prompt``.
    reason: str
    #: The engine of the request's last prefill leg (``None``: it had none).
    prefill: str | None
    #: The engine of the request's last decode leg (``None``: it had none).
    decode: str | None
    #: The prefill engines weighed at admission, the chosen one first: ``engine``,
    #: ``uncached_tokens`` and ``queued_tokens`` each (and with ``kv``: ``matched_tokens`` and
    #: ``index``); at most 8; empty when nothing was weighed.
    candidates: list[dict[str, Any]] = attrs.Factory(list)
    #: With ``kv`` only: the index that weighed the chosen engine, ``kv`` or ``approximate``.
    index: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return routing_json(
            self.policy, self.mode, self.reason, self.prefill, self.decode, self.candidates, index=self.index
        )


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
        return _progress_json(
            self.ts, self.rid, self.event, self.route, self.client, self.client_rid, self.mode, self.stream
        )


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
    #: ``pd`` or ``single``: the routing's decision for an admitted request; for
    #: one refused before admission, what the configuration would have started with.
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
    #: How the request was routed; ``None`` when it was never admitted.
    routing: RoutingRecord | None = None
    #: The W3C trace the request belongs to (absent from the JSON when none: docs/operate.md, "Tracing").
    trace_id: str | None = None
    #: The client's ``traceparent`` as Narwhal read it (absent when the client sent no valid one).
    traceparent: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return _terminal_json(
            self.ts, self.rid, self.client_rid, self.client, self.route, self.model, self.stream, self.mode,
            self.terminal, self.status, self.error, [leg.to_json() for leg in self.legs], self.usage,
            self.received, self.duration_ms, self.ttft_ms, self.stripped,
            None if self.routing is None else self.routing.to_json(), self.trace_id, self.traceparent,
        )


def encode(record: ProgressRecord | TerminalRecord) -> bytes:
    """One journal line: the record as compact JSON and a newline."""
    return wire.dumps_line(record.to_json())


# The JSON shape of each record, in one place. The records above encode
# through these, and so does the router's hot path, which writes the lines of
# admitted requests straight from its own state (positional arguments, in
# field order: no record object is built only to be encoded and dropped).


def kv_json(
    outcome: KvOutcome, owner: str, engine: str, method: str, error: str | None, release_id: str | None
) -> dict[str, Any]:
    """A :class:`KvRecord` as a JSON object, from its fields in order."""
    return {
        "outcome": outcome, "owner": owner, "engine": engine,
        "method": method, "error": error, "release_id": release_id,
    }


def leg_json(
    phase: str, attempt: int, backend_id: str, engine: str, status: int | None, outcome: LegOutcome,
    started: float, duration_ms: float, kv: dict[str, Any] | None, prompt: int | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """A :class:`LegRecord` as a JSON object, from its fields in order (``kv`` from :func:`kv_json`)."""
    out = {
        "phase": phase, "attempt": attempt, "backend_id": backend_id,
        "engine": engine, "status": status, "outcome": outcome,
        "started": started, "duration_ms": duration_ms, "kv": kv,
    }
    if prompt is not None:
        out["prompt"] = prompt
    if request_id is not None:
        out["request_id"] = request_id
    return out


def routing_json(
    policy: str, mode: str, reason: str, prefill: str | None, decode: str | None,
    candidates: list[dict[str, Any]], *, index: str | None = None,
) -> dict[str, Any]:
    """A :class:`RoutingRecord` as a JSON object, from its fields in order (``index`` only when set)."""
    out = {
        "policy": policy, "mode": mode, "reason": reason,
        "prefill": prefill, "decode": decode, "candidates": candidates,
    }
    if index is not None:
        out["index"] = index
    return out


def _progress_json(
    ts: float, rid: str, event: str, route: str, client: str, client_rid: str | None, mode: str, stream: bool
) -> dict[str, Any]:
    return {
        "ts": ts, "rid": rid, "terminal": None, "event": event,
        "route": route, "client": client, "client_rid": client_rid,
        "mode": mode, "stream": stream,
    }


def progress_line(
    ts: float, rid: str, event: str, route: str, client: str, client_rid: str | None, mode: str, stream: bool
) -> bytes:
    """:func:`encode` of a :class:`ProgressRecord`, from its fields in order."""
    return wire.dumps_line(_progress_json(ts, rid, event, route, client, client_rid, mode, stream))


def _terminal_json(
    ts: float, rid: str, client_rid: str | None, client: str | None, route: str, model: str | None,
    stream: bool, mode: str, terminal: Terminal, status: int | None, error: ErrorRecord | None,
    legs: list[dict[str, Any]], usage: dict[str, Any] | None, received: float, duration_ms: float,
    ttft_ms: float | None, stripped: tuple[str, ...], routing: dict[str, Any] | None,
    trace_id: str | None = None, traceparent: str | None = None,
) -> dict[str, Any]:
    out = {
        "ts": ts, "rid": rid, "client_rid": client_rid,
        "client": client, "route": route, "model": model,
        "stream": stream, "mode": mode, "terminal": terminal,
        "status": status,
        "error": None if error is None else error.to_json(),
        "legs": legs,
        "usage": usage, "received": received,
        "duration_ms": duration_ms, "ttft_ms": ttft_ms,
        "stripped": list(stripped),
        "routing": routing,
    }
    if trace_id is not None:
        out["trace_id"] = trace_id
        if traceparent is not None:
            out["traceparent"] = traceparent
    return out


def terminal_line(
    ts: float, rid: str, client_rid: str | None, client: str | None, route: str, model: str | None,
    stream: bool, mode: str, terminal: Terminal, status: int | None, error: ErrorRecord | None,
    legs: list[dict[str, Any]], usage: dict[str, Any] | None, received: float, duration_ms: float,
    ttft_ms: float | None, stripped: tuple[str, ...], routing: dict[str, Any] | None = None,
    trace_id: str | None = None, traceparent: str | None = None,
) -> bytes:
    """:func:`encode` of a :class:`TerminalRecord`, from its fields in order (``legs`` from :func:`leg_json`)."""
    return wire.dumps_line(_terminal_json(
        ts, rid, client_rid, client, route, model, stream, mode, terminal, status, error, legs, usage,
        received, duration_ms, ttft_ms, stripped, routing, trace_id, traceparent,
    ))
