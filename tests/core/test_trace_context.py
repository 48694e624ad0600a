"""W3C trace context (docs/contract.md, "The engine request"): what a client's traceparent becomes on the legs.

* ``narwhal_core.tracecontext`` alone: a valid ``traceparent`` is read, every
  invalid one (and a repeated one) is dropped; ``tracestate`` is bounded and
  checked; the span and trace IDs Narwhal derives are stable, well formed
  and distinct; no header bytes make it raise (Hypothesis).
* The sans-IO router: both legs carry the client's trace ID with a parent ID
  of their own; the terminal record names the trace; without a traceparent
  and with tracing off the legs carry nothing more than before; with
  ``[tracing]`` configured Narwhal starts a trace.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal_core.config import TracingConfig
from narwhal_core.errors import ConfigError
from narwhal_core.ids import backend_id
from narwhal_core.tracecontext import (
    MAX_TRACESTATE_BYTES,
    MAX_TRACESTATE_MEMBERS,
    TraceContext,
    leg_span_id,
    parse_traceparent,
    read_trace_context,
    request_span_id,
    sampled_by_ratio,
    started_trace_id,
    valid_tracestate,
)

from .router_driver import COMPLETIONS, Driver, completion_body, make_config

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{PARENT}-01"
RID = "3f9c0a1b2c0000000001"
HEX16 = re.compile(r"[0-9a-f]{16}\Z")
HEX32 = re.compile(r"[0-9a-f]{32}\Z")


# ----------------------------------------------------------------- traceparent


def test_a_valid_traceparent_is_read() -> None:
    assert parse_traceparent(VALID.encode()) == (TRACE, PARENT, 1)
    assert parse_traceparent(f"00-{TRACE}-{PARENT}-00".encode()) == (TRACE, PARENT, 0)


def test_a_later_version_is_read_by_its_first_fields() -> None:
    assert parse_traceparent(f"01-{TRACE}-{PARENT}-01".encode()) == (TRACE, PARENT, 1)
    assert parse_traceparent(f"cc-{TRACE}-{PARENT}-09-what-comes-next".encode()) == (TRACE, PARENT, 9)


@pytest.mark.parametrize("value", [
    "",
    VALID[:-1],                                         # too short
    VALID + "-",                                        # version 00 is exactly 55 characters
    VALID + "0",
    f"ff-{TRACE}-{PARENT}-01",                          # version ff is invalid
    f"01-{TRACE}-{PARENT}-01x",                         # a later version: only "-" may follow
    f"00-{'0' * 32}-{PARENT}-01",                       # all-zero trace ID
    f"00-{TRACE}-{'0' * 16}-01",                        # all-zero parent ID
    VALID.upper(),                                      # upper-case hex
    f"00-{TRACE.upper()}-{PARENT}-01",
    f"00_{TRACE}-{PARENT}-01",                          # separators
    f"00-{TRACE}_{PARENT}-01",
    f"00-{TRACE[:-1]}g-{PARENT}-01",                    # not hex
    f"00-{TRACE}-{PARENT}-0g",
    f" {VALID}",
    f"0-{TRACE}-{PARENT}-01",
])
def test_an_invalid_traceparent_is_dropped(value: str) -> None:
    assert parse_traceparent(value.encode()) is None
    headers = ((b"host", b"x"), (b"traceparent", value.encode()), (b"tracestate", b"a=1"))
    assert read_trace_context(headers, RID, False) is None


def test_a_repeated_traceparent_is_dropped_even_when_both_are_valid() -> None:
    headers = ((b"traceparent", VALID.encode()), (b"traceparent", VALID.encode()))
    assert read_trace_context(headers, RID, False) is None
    started = read_trace_context(headers, RID, True)
    assert started is not None and started.parent_id is None and started.trace_id != TRACE


def test_only_the_sampled_and_random_flags_are_passed_on() -> None:
    for sent, kept in (("01", "01"), ("00", "00"), ("03", "03"), ("ff", "03"), ("04", "00")):
        context = read_trace_context(((b"traceparent", f"00-{TRACE}-{PARENT}-{sent}".encode()),), RID, False)
        assert context is not None and context.flags == kept


# ------------------------------------------------------------------ tracestate


def test_tracestate_is_kept_checked_and_joined() -> None:
    assert valid_tracestate([b"congo=t61rcWkgMzE", b" rojo=00f067aa0ba902b7 , ,"]) == (
        b"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    assert valid_tracestate([b"tenant1@vendor=x"]) == b"tenant1@vendor=x"


@pytest.mark.parametrize("values", [
    [b"a=1,a=2"],                      # a repeated key
    [b"A=1"],                          # keys are lower case
    [b"a"],                            # no "="
    [b"a=1 "[:-1] + b"=x"],            # "=" in a value
    [b"a= "],                          # a value may not end in a space
    [b""], [b" , "],                   # nothing to pass on
])
def test_a_malformed_tracestate_is_dropped(values: list[bytes]) -> None:
    assert valid_tracestate(values) is None


def test_tracestate_is_bounded_in_bytes() -> None:
    head = b",".join(f"{key}=".encode() + b"v" * 98 for key in "abcde")  # 5 members of 100 bytes
    at_limit = head + b",z=" + b"v" * (MAX_TRACESTATE_BYTES - len(head) - 3)
    assert len(at_limit) == MAX_TRACESTATE_BYTES
    assert valid_tracestate([at_limit]) == at_limit
    assert valid_tracestate([at_limit + b"v"]) is None
    # Across several fields too: they are joined with "," before they are measured.
    assert valid_tracestate([head, b"z=" + b"v" * (MAX_TRACESTATE_BYTES - len(head) - 3)]) == at_limit
    assert valid_tracestate([head, b"z=" + b"v" * (MAX_TRACESTATE_BYTES - len(head) - 2)]) is None


def test_tracestate_is_bounded_in_members() -> None:
    members = [f"k{i}=v".encode() for i in range(MAX_TRACESTATE_MEMBERS + 1)]
    assert valid_tracestate(members[:-1]) == b",".join(members[:-1])
    assert valid_tracestate(members) is None


def test_a_dropped_tracestate_keeps_the_traceparent() -> None:
    context = read_trace_context(((b"traceparent", VALID.encode()), (b"tracestate", b"A=1")), RID, False)
    assert context == TraceContext(trace_id=TRACE, parent_id=PARENT, flags="01", state=None)


# ---------------------------------------------------------------- derived IDs


def test_derived_ids_are_well_formed_and_stable() -> None:
    assert HEX16.match(request_span_id(RID)) and request_span_id(RID) == request_span_id(RID)
    assert HEX16.match(leg_span_id(RID + "-p1")) and leg_span_id(RID + "-p1") == leg_span_id(RID + "-p1")
    assert HEX32.match(started_trace_id(RID)) and started_trace_id(RID) == started_trace_id(RID)
    # The derivation the module documents (the runtime's exporter recomputes these from the journal).
    assert request_span_id(RID) == hashlib.blake2b(RID.encode(), digest_size=8, person=b"narwhal.request").hexdigest()
    assert leg_span_id(RID + "-p1") == hashlib.blake2b(
        (RID + "-p1").encode(), digest_size=8, person=b"narwhal.leg").hexdigest()
    assert started_trace_id(RID) == hashlib.blake2b(RID.encode(), digest_size=16, person=b"narwhal.trace").hexdigest()


def test_derived_ids_are_distinct_per_request_leg_and_kind() -> None:
    rids = [f"{prefix}{n:010x}" for prefix in ("3f9c0a1b2c", "a1b2c3d4e5") for n in range(200)]
    legs = [backend_id(rid, phase, attempt) for rid in rids for phase in ("prefill", "decode")
            for attempt in (1, 2, 3)]
    span_ids = [request_span_id(rid) for rid in rids] + [leg_span_id(bid) for bid in legs]
    assert len(set(span_ids)) == len(span_ids)
    assert len({started_trace_id(rid) for rid in rids}) == len(rids)
    # Each kind of ID under its own personalisation: the same text gives different IDs.
    assert request_span_id(RID) != leg_span_id(RID) != started_trace_id(RID)[:16]


def test_leg_headers_name_the_legs_own_span() -> None:
    context = TraceContext(trace_id=TRACE, parent_id=PARENT, flags="01", state=b"a=1")
    bid = RID + "-d2"
    assert context.leg_headers(bid) == (
        (b"traceparent", f"00-{TRACE}-{leg_span_id(bid)}-01".encode()), (b"tracestate", b"a=1"))
    assert context.traceparent == VALID
    started = TraceContext(trace_id=started_trace_id(RID), parent_id=None, flags="01", state=None)
    assert started.leg_headers(bid) == ((b"traceparent", f"00-{started.trace_id}-{leg_span_id(bid)}-01".encode()),)
    assert started.traceparent is None


# ------------------------------------------------------------------ any bytes


_NAMES = st.sampled_from([b"traceparent", b"tracestate", b"host", b"x-request-id"])
_VALUES = st.one_of(
    st.binary(max_size=80),
    st.builds(lambda v: v.encode(), st.from_regex(r"[0-9a-fA-F-]{0,60}", fullmatch=True)),
    st.just(VALID.encode()),
    st.builds(lambda n: b",".join([b"k=v"] * n), st.integers(0, 40)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=6), st.booleans())
def test_no_header_bytes_make_it_raise(headers: list[tuple[bytes, bytes]], start: bool) -> None:
    context = read_trace_context(tuple(headers), RID, start)
    if context is None:
        assert not start
        return
    assert HEX32.match(context.trace_id) and context.trace_id != "0" * 32
    assert context.parent_id is None or (HEX16.match(context.parent_id) and context.parent_id != "0" * 16)
    for name, value in context.leg_headers(RID + "-p1"):
        assert value and all(0x21 <= b <= 0x7E or b in (0x20, 0x09) for b in value), (name, value)
    if context.state is not None:
        assert len(context.state) <= MAX_TRACESTATE_BYTES


# ------------------------------------------------------------- on the router


def _served(d: Driver, headers: tuple[tuple[str, str], ...] = ()) -> tuple[Any, Any, dict[str, Any]]:
    d.post(COMPLETIONS, completion_body(), headers)
    prefill = d.leg("prefill")
    d.answer_prefill(prefill.bid)
    decode = d.leg("decode")
    d.answer_decode(decode.bid)
    return prefill, decode, d.terminal(decode.rid)


def test_both_legs_carry_the_clients_trace_each_as_a_child_span() -> None:
    d = Driver()
    prefill, decode, record = _served(d, (("traceparent", VALID), ("tracestate", "congo=t61rcWkgMzE")))
    for leg in (prefill, decode):
        assert leg.headers[b"traceparent"] == f"00-{TRACE}-{leg_span_id(leg.bid)}-01".encode()
        assert leg.headers[b"tracestate"] == b"congo=t61rcWkgMzE"
    assert prefill.headers[b"traceparent"] != decode.headers[b"traceparent"]
    assert (record["trace_id"], record["traceparent"]) == (TRACE, VALID)
    d.check_invariants(final=True)


def test_without_a_traceparent_and_with_tracing_off_nothing_is_added() -> None:
    d = Driver()
    prefill, decode, record = _served(d)
    for leg in (prefill, decode):
        assert set(leg.headers) == {b"host", b"content-type", b"content-length", b"x-request-id"}
    assert "trace_id" not in record and "traceparent" not in record


def test_with_tracing_on_narwhal_starts_a_trace() -> None:
    config = attrs.evolve(make_config(), tracing=TracingConfig(endpoint="http://127.0.0.1:4318"))
    d = Driver(config)
    prefill, decode, record = _served(d, (("traceparent", VALID.upper()),))  # invalid: a new trace
    trace_id = started_trace_id(decode.rid)
    assert record["trace_id"] == trace_id and "traceparent" not in record
    for leg in (prefill, decode):
        assert leg.headers[b"traceparent"] == f"00-{trace_id}-{leg_span_id(leg.bid)}-01".encode()
        assert b"tracestate" not in leg.headers


def test_a_request_refused_at_admission_names_its_trace() -> None:
    d = Driver(admission={"max_inflight": 1, "queue_size": 0})
    d.post(COMPLETIONS, completion_body())
    refused = d.post(COMPLETIONS, completion_body(), (("traceparent", VALID),))
    assert refused.last.status == 503
    record = d.terminal(refused.last.rid)
    assert (record["terminal"], record["trace_id"], record["traceparent"]) == ("rejected", TRACE, VALID)


# ----------------------------------------------------------------- the config


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:4318", "https://otel.example:4318", "http://[::1]:4318"])
def test_tracing_endpoint_accepts_a_collector_url(endpoint: str) -> None:
    assert TracingConfig(endpoint=endpoint).endpoint == endpoint


@pytest.mark.parametrize("endpoint", [
    "", "127.0.0.1:4318", "ftp://h:1", "http://h", "http://h:0", "http://h:1/v1/traces", "http://u:p@h:1",
    "http://h:1?x", "http://::1:4318",
])
def test_tracing_endpoint_refuses_anything_else(endpoint: str) -> None:
    with pytest.raises(ConfigError) as info:
        TracingConfig(endpoint=endpoint)
    assert info.value.key == "tracing.endpoint"


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_a_started_trace_is_sampled_by_its_trace_id_at_the_ratio(ratio: float) -> None:
    config = attrs.evolve(make_config(), tracing=TracingConfig(endpoint="http://127.0.0.1:4318", sample_ratio=ratio))
    d = Driver(config)
    flags = []
    for _ in range(40):
        prefill, decode, record = _served(d)
        trace_id = record["trace_id"]
        flag = "01" if sampled_by_ratio(trace_id, ratio) else "00"
        for leg in (prefill, decode):
            assert leg.headers[b"traceparent"] == f"00-{trace_id}-{leg_span_id(leg.bid)}-{flag}".encode()
        flags.append(flag)
    if ratio == 0.0:
        assert set(flags) == {"00"}
    elif ratio == 1.0:
        assert set(flags) == {"01"}
    else:
        assert 8 <= flags.count("01") <= 32


def test_the_ratio_sampler_reads_the_low_64_bits() -> None:
    assert sampled_by_ratio("f" * 16 + "0" * 16, 0.001)
    assert not sampled_by_ratio("0" * 16 + "f" * 16, 0.999)
    assert sampled_by_ratio("0" * 16 + "7" + "f" * 15, 0.5)
    assert not sampled_by_ratio("0" * 16 + "8" + "0" * 15, 0.5)


def test_a_clients_sampled_flag_is_kept_whatever_the_ratio() -> None:
    config = attrs.evolve(make_config(), tracing=TracingConfig(endpoint="http://127.0.0.1:4318", sample_ratio=0.0))
    d = Driver(config)
    prefill, decode, _ = _served(d, (("traceparent", VALID),))
    assert prefill.headers[b"traceparent"].endswith(b"-01") and decode.headers[b"traceparent"].endswith(b"-01")


@pytest.mark.parametrize("ratio", [-0.1, 1.5, "half"])
def test_sample_ratio_out_of_range_is_refused(ratio: object) -> None:
    with pytest.raises(ConfigError) as info:
        TracingConfig(sample_ratio=ratio)  # type: ignore[arg-type]
    assert info.value.key == "tracing.sample_ratio"
