"""Tracing end to end (docs/contract.md, "The engine request"; docs/operate.md, "Tracing"), on both runtimes.

* A client's ``traceparent`` and ``tracestate`` reach both simulated engines:
  the same trace ID, each leg a parent ID of its own (the leg's span); a
  client that sends none, to a router with tracing off, adds nothing.
* A request refused before admission (denied, invalid, a GET) names its
  trace in its terminal record as an admitted one does: the client's, or,
  with ``[tracing]`` exporting, the one Narwhal starts, whose span is
  exported too.
* With ``[tracing] endpoint`` pointing at an OTLP/HTTP receiver this test
  runs on loopback (it decodes the real protobuf payload), the request's
  span and both legs' spans arrive, linked to each other and to the IDs the
  engines were sent; an unsampled client trace exports nothing; a request
  without a traceparent gets a trace of Narwhal's own.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from narwhal_core.tracecontext import leg_span_id, request_span_id, started_trace_id

from ..helpers import COMPLETIONS, completion_records, header_values, journal_terminal, rid_of
from .support import http

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
BODY = {"prompt": "Describe the tusk of a narwhal.", "max_tokens": 3}


def _legs_received(fleet: Any, record: dict[str, Any]) -> list[dict[str, Any]]:
    """What the engines received for each of the record's legs, in the record's order."""
    by_id = {header_values(r, "x-request-id")[0]: r for r in completion_records(fleet)}
    return [by_id[leg["backend_id"]] for leg in record["legs"]]


def test_the_clients_trace_reaches_both_legs_each_a_child_span(start_router, fleet, journal_path) -> None:
    router = start_router()
    answer = http.post(router.url + COMPLETIONS, json=BODY, timeout=10, headers={
        "traceparent": f"00-{TRACE}-{PARENT}-01", "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"})
    assert answer.status_code == 200, answer.text
    record = journal_terminal(journal_path, rid_of(answer))
    assert (record["trace_id"], record["traceparent"]) == (TRACE, f"00-{TRACE}-{PARENT}-01")
    prefill, decode = _legs_received(fleet, record)
    parents = []
    for received, leg in zip((prefill, decode), record["legs"], strict=True):
        [traceparent] = header_values(received, "traceparent")
        version, trace_id, parent_id, flags = traceparent.split("-")
        assert (version, trace_id, flags) == ("00", TRACE, "01")
        assert parent_id == leg_span_id(leg["backend_id"]) != PARENT
        parents.append(parent_id)
        assert header_values(received, "tracestate") == ["congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"]
    assert len(set(parents)) == 2


@pytest.mark.parametrize("sent", [None, f"00-{TRACE.upper()}-{PARENT}-01", f"00-{'0' * 32}-{PARENT}-01"],
                         ids=["none", "upper-case", "zero-trace"])
def test_with_tracing_off_no_valid_traceparent_means_nothing_forwarded(
    start_router, fleet, journal_path, sent
) -> None:
    router = start_router()
    headers = {} if sent is None else {"traceparent": sent, "tracestate": "congo=t61rcWkgMzE"}
    answer = http.post(router.url + COMPLETIONS, json=BODY, headers=headers, timeout=10)
    assert answer.status_code == 200, answer.text
    record = journal_terminal(journal_path, rid_of(answer))
    assert "trace_id" not in record and "traceparent" not in record
    for received in _legs_received(fleet, record):
        assert header_values(received, "traceparent") == [] and header_values(received, "tracestate") == []


def _refusals(router: Any, api_key: str, headers: dict[str, str]) -> dict[str, Any]:
    """A denied request (no API key), an invalid one (a bad body, with the key) and a GET of a completion route."""
    return {
        "denied": http.post(router.url + COMPLETIONS, json=BODY, headers=headers, timeout=10),
        "invalid": http.post(router.url + COMPLETIONS, json={**BODY, "max_tokens": -1}, timeout=10,
                             headers={**headers, "authorization": f"Bearer {api_key}"}),
        "method": http.get(router.url + COMPLETIONS, headers=headers, timeout=10),
    }


def test_a_refusal_names_the_clients_trace_as_every_terminal_record_does(
    start_router, fleet, journal_path, api_keys
) -> None:
    router = start_router(ingress={"auth": "api_keys", "api_keys_file": str(api_keys.path)})
    client = f"00-{TRACE}-{PARENT}-01"
    answers = _refusals(router, api_keys.keys["team-a"], {"traceparent": client})
    assert {name: a.status_code for name, a in answers.items()} == {"denied": 401, "invalid": 400, "method": 405}
    for name, answer in answers.items():
        record = journal_terminal(journal_path, rid_of(answer))
        assert record["terminal"] == ("denied" if name == "denied" else "invalid"), record
        assert (record["trace_id"], record["traceparent"]) == (TRACE, client), name
    assert completion_records(fleet) == []


# ----------------------------------------------------------- the OTLP receiver


class OtlpReceiver:
    """An OTLP/HTTP collector on loopback: POST /v1/traces, protobuf bodies decoded and kept."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                encoding = self.headers.get("content-encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                receiver.paths.append(self.path)
                receiver.requests.append(message)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """Every span received, with its resource's attributes."""
        out = []
        for message in self.requests:
            for resource_spans in message.resource_spans:
                resource = _attrs(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    out.extend((resource, span) for span in scope_spans.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _attrs(pairs: Any) -> dict[str, Any]:
    out = {}
    for kv in pairs:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


def test_spans_arrive_at_the_collector_linked_as_the_engines_were_told(
    start_router, fleet, journal_path, receiver
) -> None:
    router = start_router(tracing={"endpoint": receiver.url, "service_name": "narwhal-under-test"})
    client = f"00-{TRACE}-{PARENT}-01"
    traced = http.post(router.url + COMPLETIONS, json={**BODY, "stream": True},
                       headers={"traceparent": client}, timeout=10)
    unsampled = http.post(router.url + COMPLETIONS, json=BODY, timeout=10,
                          headers={"traceparent": f"00-{'1' * 32}-{PARENT}-00"})
    started = http.post(router.url + COMPLETIONS, json=BODY, timeout=10)
    for answer in (traced, unsampled, started):
        assert answer.status_code == 200, answer.text
    records = {name: journal_terminal(journal_path, rid_of(answer))
               for name, answer in (("traced", traced), ("unsampled", unsampled), ("started", started))}
    router.stop()  # shutting down exports what is pending: no waiting for the batch delay

    assert set(receiver.paths) == {"/v1/traces"}
    spans = receiver.spans()
    assert {resource["service.name"] for resource, _ in spans} == {"narwhal-under-test"}
    by_trace: dict[str, list[Any]] = {}
    for _, span in spans:
        by_trace.setdefault(span.trace_id.hex(), []).append(span)
    # The unsampled trace is not exported (its legs were sent flags 00).
    assert "1" * 32 not in by_trace
    for received in _legs_received(fleet, records["unsampled"]):
        assert header_values(received, "traceparent")[0].endswith("-00")
    assert set(by_trace) == {TRACE, records["started"]["trace_id"]}
    assert records["started"]["trace_id"] == started_trace_id(records["started"]["rid"])

    for name, parent in (("traced", PARENT), ("started", None)):
        record = records[name]
        trace = by_trace[record["trace_id"]]
        assert len(trace) == 3, [s.name for s in trace]
        [request] = [s for s in trace if s.span_id.hex() == request_span_id(record["rid"])]
        assert request.name == f"POST {COMPLETIONS}"
        assert request.kind == request.SPAN_KIND_SERVER
        assert request.parent_span_id.hex() == (parent or "")
        attributes = _attrs(request.attributes)
        assert attributes["narwhal.rid"] == record["rid"]
        assert (attributes["http.response.status_code"], attributes["narwhal.terminal"]) == (200, "completed")
        assert attributes["narwhal.stream"] is (name == "traced")
        assert request.end_time_unix_nano - request.start_time_unix_nano == pytest.approx(
            record["duration_ms"] * 1e6, abs=1e3)
        legs = [s for s in trace if s is not request]
        for leg, received in zip(record["legs"], _legs_received(fleet, record), strict=True):
            [span] = [s for s in legs if s.span_id.hex() == leg_span_id(leg["backend_id"])]
            # The engine was told this span is its parent; the span's own parent is the request's.
            assert header_values(received, "traceparent")[0].split("-")[2] == span.span_id.hex()
            assert span.parent_span_id == request.span_id
            assert span.name == f"{leg['phase']} leg" and span.kind == span.SPAN_KIND_CLIENT
            leg_attributes = _attrs(span.attributes)
            assert leg_attributes["narwhal.backend_id"] == leg["backend_id"]
            assert leg_attributes["narwhal.engine"] == leg["engine"]
            assert leg_attributes["http.response.status_code"] == leg["status"] == 200
            assert leg_attributes["narwhal.outcome"] == "ok"
            if leg["phase"] == "prefill":
                assert leg_attributes["narwhal.kv.outcome"] == "pulled"
            assert span.start_time_unix_nano == pytest.approx(leg["started"] * 1e9, abs=1e3)


def test_a_refusal_gets_the_trace_narwhal_starts_and_its_span_is_exported(
    start_router, fleet, journal_path, receiver, api_keys
) -> None:
    router = start_router(ingress={"auth": "api_keys", "api_keys_file": str(api_keys.path)},
                          tracing={"endpoint": receiver.url})
    answers = _refusals(router, api_keys.keys["team-a"], {})
    records = {name: journal_terminal(journal_path, rid_of(answer)) for name, answer in answers.items()}
    router.stop()  # exports what is pending
    spans = {span.span_id.hex(): span for _, span in receiver.spans()}
    for name, record in records.items():
        assert record["trace_id"] == started_trace_id(record["rid"]) and "traceparent" not in record, name
        span = spans[request_span_id(record["rid"])]
        assert span.trace_id.hex() == record["trace_id"]
        assert _attrs(span.attributes)["narwhal.terminal"] == record["terminal"]
    assert len(spans) == 3 and completion_records(fleet) == []


def test_a_collector_that_is_down_costs_spans_never_requests(start_router, fleet, journal_path) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    router = start_router(tracing={"endpoint": url, "export_timeout_s": 0.5})
    answers = [http.post(router.url + COMPLETIONS, json=BODY, timeout=10) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    for answer in answers:
        assert journal_terminal(journal_path, rid_of(answer))["trace_id"]
    began = time.monotonic()
    router.stop()
    assert time.monotonic() - began < 5.0
