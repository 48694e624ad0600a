"""narwhal_runtime/tracing.py alone: terminal records in, spans out (docs/operate.md, "Tracing").

An in-memory exporter stands in for the collector (the OTLP path over a
socket is tests/e2e/test_tracing.py): which lines become spans, their
status, and the routing decision as attributes, present or absent.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode

from narwhal_core.config import TracingConfig
from narwhal_core.tracecontext import leg_span_id, request_span_id, sampled_by_ratio, started_trace_id
from narwhal_runtime.tracing import Tracer

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


class Memory(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


@pytest.fixture
def exported() -> Iterator[tuple[Tracer, Memory]]:
    memory = Memory()
    tracer = Tracer(TracingConfig(endpoint="http://127.0.0.1:4318"), exporter=memory)
    yield tracer, memory
    tracer.shutdown()


def _record(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "ts": 100.5, "rid": "abc0000000001", "client_rid": None, "client": "anonymous",
        "route": "/v1/completions", "model": "m", "stream": False, "mode": "pd", "terminal": "failed",
        "status": 502, "error": {"type": "server_error", "code": "decode_failed", "param": None,
                                 "message": "m", "leg": "decode", "engine": "http://127.0.0.1:2"},
        "legs": [
            {"phase": "prefill", "attempt": 1, "backend_id": "abc0000000001-p1", "engine": "http://127.0.0.1:1",
             "status": 200, "outcome": "ok", "started": 100.0, "duration_ms": 1.5,
             "kv": {"outcome": "released", "owner": "o", "engine": "http://127.0.0.1:1", "method": "decode_pull",
                    "error": None, "release_id": "abc0000000001-d2"}},
            {"phase": "decode", "attempt": 1, "backend_id": "abc0000000001-d1", "engine": "http://127.0.0.1:2",
             "status": 500, "outcome": "http_error", "started": 100.1, "duration_ms": 2.0, "kv": None,
             "routing": {"policy": "least_load", "candidates": 2}},
        ],
        "usage": None, "received": 100.0, "duration_ms": 500.0, "ttft_ms": None, "stripped": [],
        "trace_id": TRACE, "routing": {"policy": "least_load", "score": {"load": 0.5}, "why": ["a", "b"]},
    }
    record.update(changes)
    return record


def _line(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record) + b"\n"


def test_only_terminal_records_naming_a_trace_become_spans(exported: tuple[Tracer, Memory]) -> None:
    tracer, memory = exported
    untraced = {key: value for key, value in _record(rid="abc0000000002").items() if key != "trace_id"}
    progress = b'{"ts":1.0,"rid":"abc0000000003","terminal":null,"event":"admitted"}\n'
    tracer.take([progress, _line(untraced), _line(_record())])
    tracer.shutdown()
    assert sorted(span.name for span in memory.spans) == ["POST /v1/completions", "decode leg", "prefill leg"]
    assert {span.context.span_id for span in memory.spans} == {
        int(request_span_id("abc0000000001"), 16), int(leg_span_id("abc0000000001-p1"), 16),
        int(leg_span_id("abc0000000001-d1"), 16)}


def test_status_times_and_the_routing_decision(exported: tuple[Tracer, Memory]) -> None:
    tracer, memory = exported
    tracer.take([_line(_record())])
    tracer.shutdown()
    spans = {span.name: span for span in memory.spans}
    request, prefill, decode = spans["POST /v1/completions"], spans["prefill leg"], spans["decode leg"]
    assert request.parent is None  # Narwhal's own trace: the root
    assert prefill.parent == decode.parent == request.context
    assert (request.status.status_code, request.status.description) == (StatusCode.ERROR, "decode_failed")
    assert prefill.status.status_code is StatusCode.UNSET
    assert (decode.status.status_code, decode.status.description) == (StatusCode.ERROR, "http_error")
    assert (request.start_time, request.end_time) == (100_000_000_000, 100_500_000_000)
    assert (prefill.start_time, prefill.end_time) == (100_000_000_000, 100_001_500_000)
    assert request.attributes["narwhal.routing.policy"] == "least_load"
    assert request.attributes["narwhal.routing.score.load"] == 0.5
    assert request.attributes["narwhal.routing.why"] == '["a","b"]'
    assert request.attributes["error.type"] == "decode_failed"
    assert decode.attributes["narwhal.routing.candidates"] == 2
    assert prefill.attributes["narwhal.kv.outcome"] == "released"
    assert not any(key.startswith("narwhal.routing") for key in prefill.attributes)


def test_without_a_routing_object_there_are_no_routing_attributes(exported: tuple[Tracer, Memory]) -> None:
    tracer, memory = exported
    record = _record(terminal="completed", status=200, error=None)
    del record["routing"]
    del record["legs"][1]["routing"]
    tracer.take([_line(record)])
    tracer.shutdown()
    assert len(memory.spans) == 3
    for span in memory.spans:
        assert not any(key.startswith("narwhal.routing") for key in span.attributes)
    [request] = [span for span in memory.spans if span.name.startswith("POST")]
    assert request.status.status_code is StatusCode.UNSET


def test_a_client_trace_is_the_parent_and_an_unsampled_one_exports_nothing(exported: tuple[Tracer, Memory]) -> None:
    tracer, memory = exported
    tracer.take([
        _line(_record(traceparent=f"00-{TRACE}-00f067aa0ba902b7-01")),
        _line(_record(rid="abc0000000009", trace_id="1" * 32, traceparent=f"00-{'1' * 32}-00f067aa0ba902b7-00")),
    ])
    tracer.shutdown()
    assert {span.context.trace_id for span in memory.spans} == {int(TRACE, 16)}
    [request] = [span for span in memory.spans if span.name.startswith("POST")]
    assert request.parent is not None and request.parent.span_id == 0x00F067AA0BA902B7
    assert request.parent.is_remote


def test_an_unreadable_record_is_counted_not_fatal(exported: tuple[Tracer, Memory]) -> None:
    tracer, memory = exported
    tracer.take([b'{"trace_id":"zz", "rid": 1}\n', _line(_record())])
    tracer.shutdown()
    assert tracer.failed == 1 and len(memory.spans) == 3


def test_a_started_trace_is_exported_at_the_sample_ratio() -> None:
    """Narwhal's own traces at ``sample_ratio``: the same verdict the core flagged to the engines."""
    memory = Memory()
    tracer = Tracer(TracingConfig(endpoint="http://127.0.0.1:4318", sample_ratio=0.25), exporter=memory)
    rids = [f"abc{n:010d}" for n in range(200)]
    tracer.take([_line(_record(rid=rid, trace_id=started_trace_id(rid))) for rid in rids])
    tracer.shutdown()
    exported = {span.context.trace_id for span in memory.spans}
    expected = {int(started_trace_id(rid), 16) for rid in rids if sampled_by_ratio(started_trace_id(rid), 0.25)}
    assert exported == expected
    assert 30 <= len(expected) <= 70  # about a quarter of 200, by the trace IDs' low bits


def test_unsampled_started_traces_are_not_even_queued() -> None:
    """Below ratio 1 the event loop's side drops Narwhal's unsampled traces by their IDs; client traces go on."""
    memory = Memory()
    tracer = Tracer(TracingConfig(endpoint="http://127.0.0.1:4318", sample_ratio=0.25), exporter=memory)
    rids = [f"abc{n:010d}" for n in range(100)]
    sampled = [rid for rid in rids if sampled_by_ratio(started_trace_id(rid), 0.25)]
    client = _record(rid="abc9999999999", trace_id="1" * 32, traceparent=f"00-{'1' * 32}-00f067aa0ba902b7-01")
    tracer.take([_line(_record(rid=rid, trace_id=started_trace_id(rid))) for rid in rids] + [_line(client)])
    assert len(tracer._pending) == len(sampled) + 1  # the client's sampled trace whatever the ratio
    tracer.shutdown()
    assert int("1" * 32, 16) in {span.context.trace_id for span in memory.spans}
