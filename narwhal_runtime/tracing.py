"""Exporting a span per request and per leg over OTLP/HTTP (docs/operate.md, "Tracing"), off the event loop.

With ``[tracing] endpoint`` set, the server hands this :class:`Tracer` the
journal lines of every batch it writes (:meth:`Tracer.take`, on the event
loop: a substring test per line, and an append for a terminal record that
names a trace). A thread of its own turns those records into spans with the
OpenTelemetry SDK, a few times a second; the SDK's ``BatchSpanProcessor``
sends them to the collector from another thread, in batches. The router's
hot path pays nothing more: the record it already wrote is all the spans
are made of.

The spans carry the IDs the core sent the engines
(:mod:`narwhal_core.tracecontext`): the request's span is
``request_span_id(rid)``, a child of the client's ``traceparent`` when the
record has one (else the root of the trace Narwhal started), and each leg's
span is ``leg_span_id(backend_id)``, a child of the request's. An engine that
traces makes its own span a child of its leg's, so the three line up in the
collector. The spans are built whole, as the SDK's ``ReadableSpan`` values
(start, end, IDs and attributes are all known once the record is written),
and handed to the batch processor: no tracer, sampler or ID generator is
involved, which also makes a span several times cheaper to make.

A trace whose client said "not sampled" (flags ``00``) is not exported: its
spans carry the client's flags, and the batch processor drops unsampled
spans, as the engines, sent the same flags, do. A trace Narwhal starts is
sampled at ``tracing.sample_ratio``, by its trace ID (the core's
``sampled_by_ratio``: the engines were sent the same verdict).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import orjson
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from narwhal_core.config import TracingConfig
from narwhal_core.tracecontext import leg_span_id, request_span_id, sampled_by_ratio

from .log import log_event

__all__ = ["Tracer", "MAX_PENDING"]

#: A terminal record naming a trace: ``"trace_id":"`` appears in no other line (a quote inside a JSON
#: string is escaped, and progress records have no trace).
_MARK = b'"trace_id":"'
#: A record whose client sent a trace (its sampled flag is the client's, not the ratio's).
_CLIENT = b'"traceparent":"'
#: Records waiting for the span thread; past this, new ones are dropped and counted (``dropped``).
MAX_PENDING = 65536
#: How often the span thread wakes, and how many records it turns into spans before it lets the
#: event loop have the interpreter again.
_INTERVAL_S = 0.1
_CHUNK = 64
#: Leg outcomes that are not the leg's failure (docs/operate.md, "The journal").
_LEG_FINE = frozenset({"ok", "refused", "cancelled"})
_UNSET = Status(StatusCode.UNSET)



class _ToProcessLog(logging.Handler):
    """The SDK's own complaints (an export failed, its queue is full) as process-log lines, at most one a second."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self._last = 0.0
        self._quiet = 0

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        if now - self._last < 1.0:
            self._quiet += 1
            return
        self._last = now
        log_event("tracing_error", level="error", message=record.getMessage()[:500], unlogged=self._quiet)
        self._quiet = 0


def _attributes(pairs: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in pairs.items() if value is not None}


def _routing(routing: Any, prefix: str = "narwhal.routing") -> dict[str, Any]:
    """A record's ``routing`` object as flat span attributes (nested objects by dotted key)."""
    out: dict[str, Any] = {}
    if not isinstance(routing, dict):
        return out
    for key, value in routing.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            out.update(_routing(value, name))
        elif isinstance(value, (str, bool, int, float)):
            out[name] = value
        elif value is not None:
            out[name] = orjson.dumps(value).decode()
    return out


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Tracer:
    """Terminal journal records in, OTLP spans out; see the module docstring."""

    def __init__(self, config: TracingConfig, *, exporter: SpanExporter | None = None) -> None:
        if exporter is None:
            assert config.endpoint is not None
            exporter = OTLPSpanExporter(
                endpoint=config.endpoint + "/v1/traces", timeout=config.export_timeout_s
            )
        self._resource = Resource.create({"service.name": config.service_name})
        self._scope = InstrumentationScope("narwhal")
        self._processor = BatchSpanProcessor(
            exporter, max_queue_size=8192, schedule_delay_millis=1000, max_export_batch_size=512,
            export_timeout_millis=config.export_timeout_s * 1000,
        )
        self._timeout = config.export_timeout_s
        self._ratio = config.sample_ratio
        sdk_log = logging.getLogger("opentelemetry")
        if not any(isinstance(h, _ToProcessLog) for h in sdk_log.handlers):
            sdk_log.addHandler(_ToProcessLog(logging.WARNING))
            sdk_log.propagate = False
        self._pending: deque[bytes] = deque()
        #: Records dropped because the span thread fell :data:`MAX_PENDING` behind; records it could not read.
        self.dropped = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="narwhal-tracing", daemon=True)
        self._thread.start()

    # ----------------------------------------------------- the event loop's side

    def take(self, lines: list[bytes]) -> None:
        """The journal lines of one batch: keep the terminal records that name a sampled trace.

        A trace Narwhal started (no client ``traceparent`` in the record) and
        left unsampled by ``tracing.sample_ratio`` is skipped here, from its
        trace ID's bytes, so the span thread never parses its record.
        """
        pending = self._pending
        ratio = self._ratio
        for line in lines:
            at = line.find(_MARK)
            if at < 0:
                continue
            if ratio < 1.0 and _CLIENT not in line:
                start = at + len(_MARK)
                if not sampled_by_ratio(line[start : start + 32].decode("ascii", "replace"), ratio):
                    continue
            if len(pending) < MAX_PENDING:
                pending.append(line)
            else:
                self.dropped += 1

    def shutdown(self) -> None:
        """Turn what is pending into spans, send them, stop (blocks: call it from a worker thread); once."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(self._timeout + 5.0)
        self._processor.force_flush(int(self._timeout * 1000))
        self._processor.shutdown()
        if self.dropped or self.failed:
            log_event("tracing_records_dropped", level="error", dropped=self.dropped, unreadable=self.failed)

    # --------------------------------------------------------- the span thread

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(_INTERVAL_S)
            self._drain()
            if stopping:
                return

    def _drain(self) -> None:
        pending = self._pending
        done = 0
        while pending:
            line = pending.popleft()
            try:
                self.export(orjson.loads(line))
            except Exception as exc:  # noqa: BLE001 - one odd record must not stop the thread
                self.failed += 1
                if self.failed == 1:
                    log_event("tracing_error", level="error", message=f"{type(exc).__name__}: {exc}"[:500])
            done += 1
            if done % _CHUNK == 0:
                time.sleep(0)  # let the event loop's thread run

    def export(self, record: dict[str, Any]) -> None:
        """The request's span and its legs' spans, from its terminal record (on the span thread only)."""
        trace_id = int(record["trace_id"], 16)
        parent = None
        # A trace Narwhal started: sampled as the core flagged it to the engines (the same verdict).
        sampled = self._ratio >= 1.0 or sampled_by_ratio(record["trace_id"], self._ratio)
        flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        client = record.get("traceparent")
        if client:
            _, _, parent_id, client_flags = client.split("-")
            flags = TraceFlags(int(client_flags, 16))
            parent = SpanContext(trace_id, int(parent_id, 16), is_remote=True, trace_flags=flags)
        if not flags.sampled:
            return  # not sampled: by the client, or by tracing.sample_ratio
        request = SpanContext(trace_id, int(request_span_id(record["rid"]), 16), False, flags)
        start = _ns(record["received"])
        for leg in record["legs"]:
            leg_start = _ns(leg["started"])
            self._processor.on_end(ReadableSpan(
                f"{leg['phase']} leg", SpanContext(trace_id, int(leg_span_id(leg["backend_id"]), 16), False, flags),
                request, self._resource, self._leg_attributes(leg), kind=SpanKind.CLIENT,
                status=_UNSET if leg["outcome"] in _LEG_FINE else Status(StatusCode.ERROR, leg["outcome"]),
                start_time=leg_start, end_time=leg_start + _ns(leg["duration_ms"] / 1000.0),
                instrumentation_scope=self._scope,
            ))
        error = record.get("error")
        status = record.get("status")
        failed = record["terminal"] == "failed" or (status is not None and status >= 500)
        self._processor.on_end(ReadableSpan(
            f"POST {record['route']}", request, parent, self._resource, self._request_attributes(record),
            kind=SpanKind.SERVER,
            status=Status(StatusCode.ERROR, (error or {}).get("code") or record["terminal"]) if failed else _UNSET,
            start_time=start, end_time=start + _ns(record["duration_ms"] / 1000.0),
            instrumentation_scope=self._scope,
        ))

    @staticmethod
    def _request_attributes(record: dict[str, Any]) -> dict[str, Any]:
        error = record.get("error") or {}
        usage = record.get("usage") or {}
        return _attributes({
            "http.request.method": "POST",
            "http.route": record["route"],
            "http.response.status_code": record.get("status"),
            "narwhal.rid": record["rid"],
            "narwhal.client": record.get("client"),
            "narwhal.model": record.get("model"),
            "narwhal.stream": record.get("stream"),
            "narwhal.mode": record.get("mode"),
            "narwhal.terminal": record["terminal"],
            "narwhal.ttft_ms": record.get("ttft_ms"),
            "error.type": error.get("code") or error.get("type"),
            "gen_ai.usage.input_tokens": usage.get("prompt_tokens") if isinstance(usage, dict) else None,
            "gen_ai.usage.output_tokens": usage.get("completion_tokens") if isinstance(usage, dict) else None,
            **_routing(record.get("routing")),
        })

    @staticmethod
    def _leg_attributes(leg: dict[str, Any]) -> dict[str, Any]:
        kv = leg.get("kv") or {}
        return _attributes({
            "narwhal.phase": leg["phase"],
            "narwhal.attempt": leg.get("attempt"),
            "narwhal.backend_id": leg["backend_id"],
            "narwhal.engine": leg.get("engine"),
            "http.response.status_code": leg.get("status"),
            "narwhal.outcome": leg.get("outcome"),
            "narwhal.prompt": leg.get("prompt"),
            "narwhal.kv.outcome": kv.get("outcome"),
            "narwhal.kv.method": kv.get("method"),
            "narwhal.kv.error": kv.get("error"),
            **_routing(leg.get("routing")),
        })
