"""One shape per journal record (docs/design.md, "The journal's records").

A record's fields are declared once, in its attrs class; its ``to_json``
and the builder the router's hot path writes lines with are both derived
from that declaration. These tests hold that: every record's JSON keys are
its fields, in order; every builder takes the fields ``__init__`` takes, in
order, with the same defaults, and makes the same JSON; a field added to a
record (a test-only subclass here) reaches both with no other edit; and the
lines the router writes are byte for byte the ones pinned below.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import attrs
import pytest

from narwhal_core import WriteJournal, journal
from narwhal_core.journal import ErrorRecord, KvRecord, LegRecord, ProgressRecord, RoutingRecord, TerminalRecord

from .router_driver import COMPLETIONS, Driver, completion_body

KV = KvRecord(outcome="released", owner="r-p1-0", engine="http://p1:8000", method="decode_pull",
              error="abort answered 404", release_id="r-d2")
LEG = LegRecord(phase="prefill", attempt=2, backend_id="r-p2", engine="http://p1:8000", status=200, outcome="ok",
                started=1.5, duration_ms=3.25, kv=KV, prompt=1, request_id="r-p1")
ERROR = ErrorRecord(type="server_error", code="engine_timeout", param="prompt", message="Timed out.",
                    leg="decode", engine="http://d1:8000")
ROUTING = RoutingRecord(policy="kv", mode="pd", reason="long_prompt", prefill="http://p1:8000",
                        decode="http://d1:8000", candidates=[{"engine": "http://p1:8000", "uncached_tokens": 3}],
                        index="kv")
PROGRESS = ProgressRecord(ts=2.0, rid="r", event="admitted", route=COMPLETIONS, client="c", client_rid="x",
                          mode="pd", stream=True)
TERMINAL = TerminalRecord(
    ts=3.0, rid="r", client_rid="x", client="c", route=COMPLETIONS, model="m", stream=True, mode="pd",
    terminal="failed", status=504, error=ERROR, legs=(LEG, LEG), usage={"total_tokens": 3}, received=1.0,
    duration_ms=2000.0, ttft_ms=None, stripped=("request_id",), routing=ROUTING, trace_id="ab" * 16,
    traceparent=f"00-{'ab' * 16}-{'cd' * 8}-01",
)
#: One record of each class, every field set (none left absent from the JSON).
EVERY_FIELD = (KV, LEG, ERROR, ROUTING, PROGRESS, TERMINAL)
BUILDERS = {KvRecord: journal.kv_json, LegRecord: journal.leg_json, RoutingRecord: journal.routing_json,
            ProgressRecord: journal.progress_line, TerminalRecord: journal.terminal_line}


def names(record: type) -> list[str]:
    return [f.name for f in attrs.fields(record)]


def as_builder_arguments(record: Any) -> list[Any]:
    """The record's ``__init__`` values in order, nested records as their JSON (what a builder is given)."""
    out = []
    for f in attrs.fields(type(record)):
        if not f.init:
            continue
        value = getattr(record, f.name)
        if isinstance(value, tuple) and value and isinstance(value[0], journal._Record):
            value = [v.to_json() for v in value]
        elif isinstance(value, journal._Record):
            value = value.to_json()
        out.append(value)
    return out


@pytest.mark.parametrize("record", EVERY_FIELD, ids=lambda r: type(r).__name__)
def test_a_records_json_keys_are_its_fields_in_order(record: Any) -> None:
    assert list(record.to_json()) == names(type(record))
    assert json.loads(journal.wire.dumps(record.to_json())) == record.to_json()


@pytest.mark.parametrize("record", list(BUILDERS), ids=lambda r: r.__name__)
def test_a_builder_takes_the_fields_init_takes_in_order_with_their_defaults(record: type) -> None:
    params = inspect.signature(BUILDERS[record]).parameters
    init = [f for f in attrs.fields(record) if f.init]
    assert list(params) == [f.name for f in init]
    assert [p.default for p in params.values()] == [
        inspect.Parameter.empty if f.default is attrs.NOTHING else f.default for f in init
    ]


@pytest.mark.parametrize("record", [r for r in EVERY_FIELD if type(r) in BUILDERS], ids=lambda r: type(r).__name__)
def test_a_builder_makes_the_records_own_json(record: Any) -> None:
    built = BUILDERS[type(record)](*as_builder_arguments(record))
    if isinstance(built, bytes):  # the two line builders
        assert built == journal.encode(record)
    else:
        assert built == record.to_json()


def test_fields_that_may_be_absent_are_absent_when_none_and_the_rest_keep_their_order() -> None:
    leg = attrs.evolve(LEG, prompt=None, request_id=None, kv=None)
    assert list(leg.to_json()) == names(LegRecord)[:-2] and leg.to_json()["kv"] is None
    terminal = attrs.evolve(TERMINAL, trace_id=None, traceparent=None, routing=None)
    assert list(terminal.to_json()) == names(TerminalRecord)[:-2]
    assert list(journal.routing_json("prefix", "pd", "configured", None, None)) == names(RoutingRecord)[:-1]
    assert ProgressRecord(**{f: getattr(PROGRESS, f) for f in names(ProgressRecord) if f != "terminal"}).to_json()[
        "terminal"] is None


def test_a_new_field_is_one_declaration() -> None:
    @journal._shaped
    @attrs.define(kw_only=True)
    class LegWithQueueTime(LegRecord):
        """A leg record with the fields a newcomer adds: one declaration each, nothing else."""

        #: Time the leg waited in the engine's queue (absent when unknown).
        queued_ms: float | None = attrs.field(default=None, metadata=journal._UNLESS_NONE)
        #: Where the engine runs.
        zone: str = "eu-1"

    fields = {f.name: getattr(LEG, f.name) for f in attrs.fields(LegRecord)}
    leg = LegWithQueueTime(**fields, queued_ms=0.5)
    assert leg.to_json() == {**LEG.to_json(), "queued_ms": 0.5, "zone": "eu-1"}
    assert list(LegWithQueueTime(**fields).to_json()) == [*names(LegRecord), "zone"]
    builder = journal._generated(LegWithQueueTime, "leg_with_queue_time_json", builder=True)
    assert builder(*as_builder_arguments(leg)) == leg.to_json()
    assert list(inspect.signature(builder).parameters)[-2:] == ["queued_ms", "zone"]


def test_a_field_the_generated_code_cannot_hold_is_refused_when_the_class_is_defined() -> None:
    with pytest.raises(TypeError, match=r"Bad\.items: a journal field's default must be a literal value"):
        @journal._shaped
        @attrs.define(kw_only=True)
        class Bad(journal._Record):
            items: list[str] = attrs.Factory(list)
    with pytest.raises(TypeError, match=r"Clash\.out: the generated code uses that name"):
        @journal._shaped
        @attrs.define(kw_only=True)
        class Clash(journal._Record):
            out: str


# ------------------------------------------------------------ golden lines

#: The lines of one PD completion and of one refusal, as the router writes them (the journal's byte format:
#: key order, spelling, what is absent; docs/operate.md, "The journal").
GOLDEN = [
    b'{"ts":0.0,"rid":"t0000000000","terminal":null,"event":"admitted","route":"/v1/completions",'
    b'"client":"anonymous","client_rid":"c-7","mode":"pd","stream":false}\n',
    b'{"ts":0.75,"rid":"t0000000000","client_rid":"c-7","client":"anonymous","route":"/v1/completions",'
    b'"model":"meta-llama/Llama-3.1-8B-Instruct","stream":false,"mode":"pd","terminal":"completed","status":200,'
    b'"error":null,"legs":[{"phase":"prefill","attempt":1,"backend_id":"t0000000000-p1",'
    b'"engine":"http://10.0.0.1:8100","status":200,"outcome":"ok","started":0.0,"duration_ms":250.0,'
    b'"kv":{"outcome":"pulled","owner":"t0000000000-p1-0","engine":"http://10.0.0.1:8100","method":"decode",'
    b'"error":null,"release_id":null}},{"phase":"decode","attempt":1,"backend_id":"t0000000000-d1",'
    b'"engine":"http://10.0.1.1:8200","status":200,"outcome":"ok","started":0.25,"duration_ms":500.0,"kv":null}],'
    b'"usage":{"prompt_tokens":230,"total_tokens":247,"completion_tokens":17,'
    b'"prompt_tokens_details":{"cached_tokens":48}},"received":0.0,"duration_ms":750.0,"ttft_ms":750.0,'
    b'"stripped":["request_id"],"routing":{"policy":"prefix","mode":"pd","reason":"configured",'
    b'"prefill":"http://10.0.0.1:8100","decode":"http://10.0.1.1:8200","candidates":['
    b'{"engine":"http://10.0.0.1:8100","uncached_tokens":252,"queued_tokens":0},'
    b'{"engine":"http://10.0.0.2:8100","uncached_tokens":252,"queued_tokens":0}]}}\n',
    b'{"ts":0.75,"rid":"t0000000001","client_rid":null,"client":"anonymous","route":"/v1/completions",'
    b'"model":null,"stream":false,"mode":"pd","terminal":"invalid","status":400,"error":'
    b'{"type":"invalid_request_error","code":null,"param":"max_tokens","message":"max_tokens must be at least 1",'
    b'"leg":null,"engine":null},"legs":[],"usage":null,"received":0.75,"duration_ms":0.0,"ttft_ms":null,'
    b'"stripped":[],"routing":null}\n',
]

def test_the_routers_lines_are_the_pinned_bytes() -> None:
    d = Driver()
    d.post(COMPLETIONS, completion_body(request_id="mine"), headers=[("X-Request-Id", "c-7")])
    d.advance(0.25)
    prefill = d.leg("prefill")
    d.answer_prefill(prefill.bid)
    d.advance(0.5)
    d.answer_decode(d.leg("decode").bid)
    d.post(COMPLETIONS, {"prompt": "x", "max_tokens": -1})
    assert [cmd.line for _, cmd in d.commands if type(cmd) is WriteJournal] == GOLDEN
