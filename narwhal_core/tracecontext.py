"""W3C Trace Context: the client's ``traceparent`` and ``tracestate`` passed on to both legs (docs/contract.md).

A client (or the proxy in front of Narwhal) that traces its requests sends
``traceparent: 00-<trace-id>-<parent-id>-<flags>`` and maybe a
``tracestate`` list (W3C Trace Context, level 1). Narwhal keeps both and
sends them on with every leg, each leg a child span of the request's span,
so an engine that traces (vLLM's ``--otlp-traces-endpoint``) attaches its own
span under the leg that asked it. Without a valid ``traceparent``, a router
with ``[tracing]`` configured starts a trace of its own; one without adds
nothing at all (docs/configure.md, ``[tracing]``).

The core draws no random numbers, so every ID Narwhal writes is *derived*,
with BLAKE2b (8 bytes for a span ID, 16 for a trace ID), each kind of ID
under its own personalisation string so no two kinds can coincide:

* the request's span ID: ``blake2b(rid, person="narwhal.request")``;
* a leg's span ID: ``blake2b(backend ID, person="narwhal.leg")``;
* a trace Narwhal starts: ``blake2b(rid, person="narwhal.trace")``.

Rids begin with a random per-process prefix (``narwhal_runtime/app.py``),
and backend IDs are unique per leg attempt (``ids.py``), so the IDs differ
across requests, attempts, restarts and replicas, yet the runtime's exporter
(``narwhal_runtime/tracing.py``) recomputes from the journal record exactly
the span IDs the engines were sent. A digest of all zeros (an invalid ID)
becomes ``...01``.

What is refused is dropped, never an error to the client: a
``traceparent`` that is not version ``00`` of exactly 55 characters (or a
later version's forward-compatible prefix), with a trace ID or parent ID
of all zeros, upper-case hex, or sent more than once; and a ``tracestate``
whose fields together exceed :data:`MAX_TRACESTATE_BYTES`, hold more than
:data:`MAX_TRACESTATE_MEMBERS` members, a malformed member or a repeated
key (then only the ``tracestate`` goes; the ``traceparent`` is kept). Of the
flags, only ``sampled`` (``01``) and ``random`` (``02``) are passed on; the
other bits are reserved and sent as zero.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Final

import attrs

from .http.grammar import Headers

if TYPE_CHECKING:
    from .config import TracingConfig

__all__ = [
    "MAX_TRACESTATE_BYTES",
    "MAX_TRACESTATE_MEMBERS",
    "TraceContext",
    "leg_span_id",
    "parse_traceparent",
    "read_trace_context",
    "request_trace",
    "request_span_id",
    "sampled_by_ratio",
    "started_trace_id",
    "valid_tracestate",
]

#: The most ``tracestate`` bytes (all its fields, joined) passed on; more, and it is dropped.
MAX_TRACESTATE_BYTES: Final = 512
#: The most ``tracestate`` list members passed on (the W3C limit); more, and it is dropped.
MAX_TRACESTATE_MEMBERS: Final = 32

_TRACEPARENT: Final = b"traceparent"
_TRACESTATE: Final = b"tracestate"
#: version "-" trace-id "-" parent-id "-" flags, lowercase hex; a later version may append "-" and more.
_TRACEPARENT_RE: Final = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:-|\Z)")
_ZERO_TRACE: Final = b"0" * 32
_ZERO_SPAN: Final = b"0" * 16
#: The low 64 bits of a trace ID, as OpenTelemetry's ratio sampler reads them.
_TRACE_ID_SPACE: Final = 1 << 64
#: The flags passed on: sampled (bit 0) and random trace ID (bit 1, level 2); the rest are reserved.
_KNOWN_FLAGS: Final = 0x03
#: A list member: ``key=value`` (W3C Trace Context, "tracestate Header Field Values").
_MEMBER_RE: Final = re.compile(
    rb"([a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
    rb"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
_OWS: Final = b" \t"


def _derived(text: str, size: int, person: bytes) -> str:
    digest = hashlib.blake2b(text.encode(), digest_size=size, person=person).hexdigest()
    if digest.strip("0"):
        return digest
    return digest[:-1] + "1"  # all zeros is not a valid ID


def request_span_id(rid: str) -> str:
    """The span ID of request ``rid``'s own span, 16 lowercase hex digits."""
    return _derived(rid, 8, b"narwhal.request")


def leg_span_id(backend_id: str) -> str:
    """The span ID of the leg with ``backend_id`` (the parent ID its engine is sent), 16 hex digits."""
    return _derived(backend_id, 8, b"narwhal.leg")


def started_trace_id(rid: str) -> str:
    """The trace ID of a trace Narwhal starts for request ``rid``, 32 lowercase hex digits."""
    return _derived(rid, 16, b"narwhal.trace")


def sampled_by_ratio(trace_id: str, ratio: float) -> bool:
    """Whether a trace Narwhal starts is sampled, at ``tracing.sample_ratio`` (docs/configure.md, ``[tracing]``).

    Decided by the trace ID alone, as OpenTelemetry's ``TraceIdRatioBased``
    sampler does (``opentelemetry/sdk/trace/sampling.py``, SDK 1.25+): its
    low 64 bits below ``round(ratio * 2**64)``. The core draws no random
    number, and the runtime's exporter reaches the same verdict from the
    journal record's trace ID. A client's trace keeps the client's verdict.
    """
    return int(trace_id[16:], 16) < round(ratio * _TRACE_ID_SPACE)


def parse_traceparent(value: bytes) -> tuple[str, str, int] | None:
    """``(trace_id, parent_id, flags)`` of a valid ``traceparent`` value; ``None`` for any other.

    Version ``00`` must be exactly 55 characters; a later version (not
    ``ff``) is read by its first four fields when a ``-`` or nothing follows
    them, as W3C Trace Context asks of a parser that meets a newer version.
    """
    m = _TRACEPARENT_RE.match(value)
    if m is None:
        return None
    version, trace_id, parent_id, flags = m.groups()
    if version == b"ff" or (version == b"00" and len(value) != 55):
        return None
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
    return trace_id.decode("ascii"), parent_id.decode("ascii"), int(flags, 16)


def valid_tracestate(values: list[bytes]) -> bytes | None:
    """The ``tracestate`` fields to pass on, joined and without empty members; ``None`` to drop them."""
    joined = b",".join(values)
    if len(joined) > MAX_TRACESTATE_BYTES:
        return None
    members = []
    keys = set()
    for member in joined.split(b","):
        member = member.strip(_OWS)
        if not member:
            continue  # empty members are allowed, and not passed on
        m = _MEMBER_RE.fullmatch(member)
        if m is None or m.group(1) in keys:
            return None
        keys.add(m.group(1))
        members.append(member)
    if not members or len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    return b",".join(members)


@attrs.frozen(kw_only=True)
class TraceContext:
    """The trace a request belongs to, and what its legs are sent (docs/contract.md, "The engine request")."""

    #: 32 lowercase hex digits: the client's trace, or one Narwhal started (:func:`started_trace_id`).
    trace_id: str
    #: The client's span, parent of the request's span; ``None`` when Narwhal started the trace.
    parent_id: str | None
    #: The flags passed on, two hex digits (``01``: sampled).
    flags: str
    #: The client's ``tracestate``, checked, or ``None``.
    state: bytes | None

    @property
    def traceparent(self) -> str | None:
        """The client's ``traceparent`` as Narwhal read it (version ``00``); ``None`` when Narwhal started the trace."""
        if self.parent_id is None:
            return None
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags}"

    def leg_headers(self, backend_id: str) -> tuple[tuple[bytes, bytes], ...]:
        """The headers a leg carries: a ``traceparent`` naming the leg's own span, and the ``tracestate``."""
        parent = f"00-{self.trace_id}-{leg_span_id(backend_id)}-{self.flags}".encode("ascii")
        if self.state is None:
            return ((_TRACEPARENT, parent),)
        return ((_TRACEPARENT, parent), (_TRACESTATE, self.state))


def read_trace_context(headers: Headers, rid: str, start: bool, ratio: float = 1.0) -> TraceContext | None:
    """The trace context of request ``rid`` from its ``headers``; ``start``: begin one when the client sent none.

    A trace Narwhal begins is sampled (flags ``01``) or not (``00``, still
    passed on, so the engines' logs can name it) by :func:`sampled_by_ratio`.

    ``None`` (nothing forwarded) when the client sent no valid
    ``traceparent`` and ``start`` is false.
    """
    parent = None
    parents = 0
    states: list[bytes] | None = None
    for name, value in headers:
        if name == _TRACEPARENT:
            parent = value
            parents += 1
        elif name == _TRACESTATE:
            if states is None:
                states = []
            states.append(value)
    if parent is not None and parents == 1:
        parsed = parse_traceparent(parent)
        if parsed is not None:
            trace_id, parent_id, flags = parsed
            return TraceContext(
                trace_id=trace_id, parent_id=parent_id, flags=f"{flags & _KNOWN_FLAGS:02x}",
                state=None if states is None else valid_tracestate(states),
            )
    if start:
        # W3C: a missing or invalid traceparent restarts the trace (its tracestate goes with it).
        trace_id = started_trace_id(rid)
        sampled = "01" if ratio >= 1.0 or sampled_by_ratio(trace_id, ratio) else "00"
        return TraceContext(trace_id=trace_id, parent_id=None, flags=sampled, state=None)
    return None


def request_trace(headers: Headers, rid: str, tracing: TracingConfig) -> TraceContext | None:
    """The trace of request ``rid`` under ``[tracing]``: the client's, one Narwhal starts, or ``None``.

    Every terminal record of a completion request names it, a refusal's
    before admission too (docs/operate.md, "Tracing").
    """
    # Tracing off and no traceparent: one pass over the headers is all tracing costs (docs/contract.md).
    return read_trace_context(headers, rid, tracing.endpoint is not None, tracing.sample_ratio)
