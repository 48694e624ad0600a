"""Every answer on a completion route that names a rid has exactly one terminal record (issue 20, items 2-3).

Over raw sockets, on both runtimes: a sweep over every client-fault answer
Narwhal gives (400 of each kind, 404, 405, 408 for a slow head and a slow
body, 413, 431, 505, a contract 400) on both completion routes. The rule
checked both ways: each rid a completion-route answer names has exactly
one terminal record, with the status sent, and every rid in the journal
was sent to a client. Then the client mistakes that used to cost engine
traffic: ``max_tokens``/``max_completion_tokens`` below 1 are refused
before admission (the engines see nothing), and an engine's 400 on either
leg is the client's mistake (``invalid``, not retried), while the KV of
the prefill is released.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from narwhal_sim.testing import SimThread

from ..harness import Fleet, RouterThread
from ..helpers import COMPLETIONS, COMPLETION_PATHS, completion_records, journal_terminal, poll, read_journal
from .support import RawClient, chunked, http, request_bytes

BODY_TIMEOUT_S = 0.3
HEADER_TIMEOUT_S = 0.3
MAX_BODY = 2048
INGRESS = {
    "header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S, "max_body_bytes": MAX_BODY,
    "max_headers": 20, "max_header_bytes": 2048,
}


def _body(route: str, **fields: Any) -> bytes:
    base: dict[str, Any] = {"prompt": "tusk"} if route == COMPLETIONS else {
        "messages": [{"role": "user", "content": "tusk"}]
    }
    return json.dumps({**base, **fields}).encode()


def _faults(route: str) -> list[tuple[str, bytes, int]]:
    """(name, bytes the client sends and then stops, status expected)."""
    good = _body(route)
    return [
        ("not-json", request_bytes("POST", route, b"{not json"), 400),
        ("bad-field-type", request_bytes("POST", route, _body(route, max_tokens="8")), 400),
        ("max-tokens-zero", request_bytes("POST", route, _body(route, max_tokens=0)), 400),
        ("unknown-model", request_bytes("POST", route, _body(route, model="gpt-4o")), 404),
        ("wrong-method", request_bytes("GET", route), 405),
        ("malformed-header", request_bytes("POST", route, good).replace(b"host:", b"ho st:", 1), 400),
        ("bad-chunk", request_bytes("POST", route, headers=[("transfer-encoding", "chunked")])
         + b"zz\r\n" + good + b"\r\n0\r\n\r\n", 400),
        ("both-lengths", request_bytes("POST", route, good, headers=[("transfer-encoding", "chunked"),
                                                                        ("content-length", str(len(good)))]), 400),
        ("body-too-large", request_bytes("POST", route, b"x" * (MAX_BODY + 1)), 413),
        ("chunked-too-large", request_bytes("POST", route, headers=[("transfer-encoding", "chunked")])
         + chunked(b"x" * (MAX_BODY + 1)), 413),
        ("too-many-headers", request_bytes("POST", route, good, headers=[(f"x-h{i}", "1") for i in range(30)]), 431),
        ("header-too-large", request_bytes("POST", route, good, headers=[("x-big", "y" * 3000)]), 431),
        ("http-2", request_bytes("POST", route, good, version="HTTP/2.0"), 505),
        ("slow-body", request_bytes("POST", route, good)[:-5], 408),
        ("slow-head", request_bytes("POST", route, good).partition(b"\r\n")[0] + b"\r\nhost: x\r\n", 408),
        ("slow-after-continue", request_bytes("POST", route, good, headers=[("expect", "100-continue")])
         .partition(b"\r\n\r\n")[0] + b"\r\n\r\n", 408),
    ]


def _answer(router: RouterThread, data: bytes) -> Any:
    """Send ``data`` on a fresh connection; the one final answer (after any 100 Continue)."""
    with RawClient(router.address or ("127.0.0.1", 0), timeout=5) as client:
        client.send(data)
        while True:
            response = client.read_response()
            if response.status != 100:
                return response


@pytest.mark.parametrize("route", COMPLETION_PATHS)
def test_every_client_fault_answer_has_exactly_one_record_per_rid(
    start_router: Callable[..., RouterThread], fleet: Fleet, journal_path: Path, route: str
) -> None:
    router = start_router(ingress=INGRESS)
    sent: dict[str, tuple[str, int]] = {}
    for name, data, status in _faults(route):
        response = _answer(router, data)
        assert response.status == status, (name, response.status, response.body[:200])
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", name
        rid = response.header("x-request-id")
        assert rid, name
        sent[rid] = (name, status)
    # An answer off the completion routes names a rid too; it has no record.
    other = _answer(router, request_bytes("POST", route + "x", _body(route)))
    assert other.status == 404 and other.header("x-request-id")
    poll(lambda: sum(r.get("terminal") is not None for r in read_journal(journal_path)) >= len(sent),
         timeout=10, what="a terminal record per answer")
    records = read_journal(journal_path)
    for rid, (name, status) in sent.items():
        mine = [r for r in records if r["rid"] == rid]
        assert len(mine) == 1, (name, mine)
        (record,) = mine
        assert (record["terminal"], record["status"], record["route"]) == ("invalid", status, route), (name, record)
        assert record["legs"] == [], name
    assert {r["rid"] for r in records} == set(sent), "a rid in the journal that no client was sent"
    assert completion_records(fleet) == []


# ------------------------------------------------------------- max_tokens


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_an_output_length_below_one_is_400_with_no_engine_traffic(
    start_router: Callable[..., RouterThread], fleet: Fleet, journal_path: Path, field: str, value: int
) -> None:
    router = start_router()
    for route in COMPLETION_PATHS:
        for stream in (False, True):
            answer = http.post(router.url + route, content=_body(route, stream=stream, **{field: value}),
                               headers={"content-type": "application/json"})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", field), error
            record = journal_terminal(journal_path, answer.headers["x-request-id"])
            assert (record["terminal"], record["status"], record["legs"]) == ("invalid", 400, [])
            assert record["error"]["param"] == field
    assert completion_records(fleet) == []
    assert all(engine.stats()["completions"] == 0 for engine in fleet.all())


# ------------------------------------------------------- engine 4xx per leg


@pytest.fixture
def short_context_fleet() -> Iterator[Fleet]:
    """Engines with a 64-token context: two of each, so that a retry would show."""
    engines = [SimThread(role=role, speed=0, max_model_len=64) for role in ("prefill", "prefill", "decode", "decode")]
    for engine in engines:
        engine.start()
    try:
        yield Fleet(prefill=engines[:2], decode=engines[2:])
    finally:
        for engine in engines:
            engine.stop()


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_an_engine_400_on_a_leg_is_invalid_named_and_not_retried(
    start_router: Callable[..., RouterThread], short_context_fleet: Fleet, journal_path: Path, leg: str
) -> None:
    fleet = short_context_fleet
    router = start_router(fleet_=fleet, engine={"kv_release": "abort_endpoint"})
    # Too long for the context even with one output token (the prefill leg's),
    # or only with the client's max_tokens (the decode leg's).
    prompt = "tusk " * (100 if leg == "prefill" else 40)
    answer = http.post(router.url + COMPLETIONS, json={"prompt": prompt, "max_tokens": 40})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and "maximum context length" in error["message"]
    assert error["param"] == "max_tokens"  # the engine's param, as it sent it
    record = journal_terminal(journal_path, answer.headers["x-request-id"])
    assert (record["terminal"], record["status"]) == ("invalid", 400)
    legs = record["legs"]
    assert record["error"]["leg"] == leg and record["error"]["engine"] == legs[-1]["engine"]
    assert [(x["phase"], x["outcome"], x["status"]) for x in legs] == (
        [("prefill", "refused", 400)] if leg == "prefill" else [("prefill", "ok", 200), ("decode", "refused", 400)]
    )
    # Not retried: one completion request reached the fleet per leg run.
    assert len(completion_records(fleet.prefill)) == 1
    assert len(completion_records(fleet.decode)) == (0 if leg == "prefill" else 1)
    if leg == "decode":
        # The prefilled KV no decode leg pulled is released at once.
        assert legs[0]["kv"]["outcome"] == "released"
        poll(lambda: all(e.stats()["kv_held"] == 0 for e in fleet.prefill), timeout=5, what="KV released")
    router.wait_idle()
