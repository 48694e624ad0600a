"""Hostile JSON bodies (docs/contract.md, "Request rules"; ``narwhal_core.wire``), over real sockets and in the core.

Every shape that is not a JSON object Narwhal accepts is a 400 in the OpenAI
envelope with ``param: null`` and one ``invalid`` journal record, reaches no
engine, and costs time and memory proportional to its size. Duplicate keys
follow the documented rule (the last value wins) and the engines see exactly
the value Narwhal validated.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from narwhal_core import wire
from narwhal_core.contract import check_request
from narwhal_core.errors import ContractError

from ..helpers import (
    CHAT,
    COMPLETIONS,
    MODEL,
    REPO,
    assert_envelope,
    assert_journal_consistent,
    completion_records,
    journal_terminal,
)
from .memory_probe import EXACT, array_of
from .support import RawClient, Response, assert_still_serves, json_post

#: (id, body, status, param): each refused before any engine is asked.
HOSTILE: list[tuple[str, bytes, int, str | None]] = [
    # Nesting (wire.MAX_DEPTH = 128).
    ("deep-array", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("deep-object", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, 400, None),
    ("deep-unclosed", b"[" * 1_000_000, 400, None),
    ("deep-in-prompt", b'{"prompt":' + b"[" * 128 + b"]" * 128 + b"}", 400, None),
    ("deep-exact-path", b"{" + EXACT + b'"prompt":' + b"[" * 200 + b"]" * 200 + b"}", 400, None),
    # Numbers.
    ("integer-4301-digits", b'{"prompt":"a","x":' + b"9" * 4301 + b"}", 400, None),
    ("integer-1m-digits", b'{"prompt":"a","x":-' + b"9" * 1_000_000 + b"}", 400, None),
    ("max_tokens-1e400", b'{"prompt":"a","max_tokens":1e400}', 400, "max_tokens"),
    ("max_tokens-float", b'{"prompt":"a","max_tokens":1.0}', 400, "max_tokens"),
    ("n-huge", b'{"prompt":"a","n":' + b"9" * 100 + b"}", 400, "n"),
    ("nan", b'{"prompt":"a","temperature":NaN}', 400, None),
    ("infinity", b'{"prompt":"a","temperature":Infinity}', 400, None),
    ("minus-infinity", b'{"prompt":"a","temperature":-Infinity}', 400, None),
    ("nan-exact-path", b"{" + EXACT + b'"prompt":"a","temperature":NaN}', 400, None),
    ("infinity-exact-path", b"{" + EXACT + b'"prompt":"a","t":-Infinity}', 400, None),
    ("leading-zero", b'{"prompt":"a","x":012}', 400, None),
    ("hex-number", b'{"prompt":"a","x":0x10}', 400, None),
    # Text.
    ("invalid-utf8", b'{"prompt":"\xff"}', 400, None),
    ("overlong-utf8", b'{"prompt":"\xc0\xaf"}', 400, None),
    ("utf8-encoded-surrogate", b'{"prompt":"\xed\xa0\x80"}', 400, None),
    ("truncated-utf8", b'{"prompt":"\xe2\x82"}', 400, None),
    ("invalid-utf8-exact-path", b"{" + EXACT + b'"prompt":"\xff"}', 400, None),
    ("lone-high-surrogate", b'{"prompt":"\\ud800"}', 400, None),
    ("lone-low-surrogate", b'{"prompt":"\\udc00x"}', 400, None),
    ("lone-surrogate-key", b'{"\\ud800":1,"prompt":"a"}', 400, None),
    ("lone-surrogate-exact-path", b"{" + EXACT + b'"prompt":"\\ud800"}', 400, None),
    ("raw-control-char", b'{"prompt":"a\x01b"}', 400, None),
    ("huge-string-unterminated", b'{"prompt":"' + b"a" * 1_000_000, 400, None),
    ("huge-model-name", b'{"prompt":"a","model":"' + b"x" * 1_000_000 + b'"}', 404, "model"),
    # Not an object, or not one document.
    ("empty", b"", 400, None),
    ("whitespace", b"   \r\n", 400, None),
    ("array", b"[]", 400, None),
    ("string", b'"prompt"', 400, None),
    ("number", b"1", 400, None),
    ("null", b"null", 400, None),
    ("true", b"true", 400, None),
    ("trailing-garbage", b'{"prompt":"a"} x', 400, None),
    ("two-documents", b'{"prompt":"a"}{"prompt":"b"}', 400, None),
    ("single-quotes", b"{'prompt':'a'}", 400, None),
    ("trailing-comma", b'{"prompt":"a",}', 400, None),
    ("comment", b'{"prompt":"a"/* c */}', 400, None),
    # Giant arrays.
    ("giant-top-level-array", b"[" + array_of(b"0", 900_000) + b"]", 400, None),
    ("giant-messages-not-objects", b'{"messages":[' + array_of(b"1", 900_000) + b"]}", 400, "messages"),
    ("giant-array-of-objects", b"[" + array_of(b"{}", 600_000) + b"]", 400, None),
    ("giant-array-of-floats-exact", b"{" + EXACT + b'"y":[' + array_of(b"0.5", 400_000) + b"]}", 400, "prompt"),
    ("giant-tools", b'{"prompt":"a","tools":[' + array_of(b'{"type":"x"}', 150_000) + b"]}", 400, "tools[0].type"),
]

#: Seconds a request may take per MB of body, plus a constant (generous: a busy CI box).
SECONDS_PER_MB = 3.0
SECONDS_BASE = 1.5


def _post(router: Any, route: str, body: bytes) -> tuple[Response, float]:
    with RawClient(router.address, timeout=30) as client:
        started = time.monotonic()
        client.send(json_post(route, body))
        response = client.read_response()
        return response, time.monotonic() - started


@pytest.mark.parametrize(
    ("body", "status", "param"), [(b, s, p) for _, b, s, p in HOSTILE], ids=[i for i, *_ in HOSTILE]
)
def test_hostile_body_is_refused_in_the_envelope(start_router, fleet, journal_path, body, status, param) -> None:
    route = CHAT if b'"messages"' in body[:20] else COMPLETIONS
    router = start_router()
    response, elapsed = _post(router, route, body)
    error = assert_envelope(response, status, type="invalid_request_error", param=param,
                            code="model_not_found" if status == 404 else None)
    assert elapsed < SECONDS_BASE + SECONDS_PER_MB * len(body) / 1e6, elapsed
    # The answer never echoes the hostile input at length.
    assert len(response.body) < 2048 and len(error["message"]) < 1024
    record = journal_terminal(journal_path, response.header("x-request-id"))
    assert record["terminal"] == "invalid" and record["status"] == status, record
    assert record["legs"] == [] and record["error"]["param"] == param
    assert completion_records(fleet.all()) == []
    assert len(json.dumps(record)) < 4096
    assert_still_serves(router.address, journal_path)
    assert_journal_consistent(journal_path)


#: What the contract answers each body of ``tests/security/memory_probe.py``: 400 for JSON that does not
#: parse, a body that is not an object, no prompt, messages that are not objects, or an integer over
#: ``narwhal_core.wire.MAX_INT_DIGITS`` digits; 404 for a model nobody serves; 200 otherwise.
PROBE_STATUS = {
    "deep-unclosed": 400, "long-integer": 400, "many-4300-digit-integers": 200, "giant-array": 400,
    "giant-array-of-floats": 400, "giant-array-of-objects": 400, "giant-array-of-objects-exact": 400,
    "giant-array-of-arrays-exact": 400, "giant-array-of-members": 400, "giant-messages": 400,
    "giant-prompt-array": 200, "huge-string": 200, "huge-string-unterminated": 400, "huge-string-of-escapes": 200,
    "huge-model-name": 404, "many-keys": 400,
}


def test_contract_memory_and_time_grow_at_most_linearly_with_the_body() -> None:
    """Peak memory (resident high-water mark) and CPU time of the contract on ~2 MB worst cases."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.security.memory_probe"], cwd=REPO, capture_output=True, timeout=180
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    results = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert sorted(r["name"] for r in results) == sorted(PROBE_STATUS), results
    for result in results:
        size = result["size"]
        # ~35 bytes of Python objects per body byte at worst (an array of tiny objects).
        assert result["peak"] <= 48 * size + 16 * 2**20, result
        assert result["seconds"] <= 0.5 + 1.5 * size / 1e6, result
        assert result["status"] == PROBE_STATUS[result["name"]], result


def test_contract_refusals_in_the_core_are_all_400_or_404() -> None:
    for name, body, status, param in HOSTILE:
        route = CHAT if b'"messages"' in body[:20] else COMPLETIONS
        with pytest.raises(ContractError) as caught:
            check_request(route, body, {MODEL}, MODEL)
        assert (caught.value.status, caught.value.param) == (status, param), name


# --------------------------------------------------------- duplicate keys


def _pairs(text: str) -> Any:
    """Parse JSON refusing duplicate keys, so a duplicate that reached an engine fails the test."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"duplicate keys reached the engine: {keys}"
        return dict(pairs)

    return json.loads(text, object_pairs_hook=hook)


@pytest.mark.parametrize("path", ["fast", "exact"])
def test_duplicate_keys_last_value_wins_and_the_engine_sees_exactly_that(
    start_router, fleet, journal_path, path
) -> None:
    router = start_router()
    extra = EXACT if path == "exact" else b""
    body = (
        b'{' + extra + b'"prompt":"dup","max_tokens":"x","max_tokens":2,"model":"gpt-4","model":"llama-3.1-8b",'
        b'"stream":true,"stream":false,"kv_transfer_params":{"remote_host":"169.254.169.254"},'
        b'"kv_transfer_params":null,"temperature":0.1,"temperature":0.7,"logprobs":null,"logprobs":1}'
    )
    assert wire.loads(body)["max_tokens"] == 2
    response, _ = _post(router, COMPLETIONS, body)
    assert response.status == 200, response.body
    assert response.header("content-type").startswith("application/json")  # stream: the last value, false
    record = journal_terminal(journal_path, response.header("x-request-id"))
    assert record["stripped"] == ["kv_transfer_params"] and record["model"] == "llama-3.1-8b"
    prefill = completion_records(fleet.prefill)
    decode = completion_records(fleet.decode)
    assert len(prefill) == 1 and len(decode) == 1
    sent = _pairs(decode[0]["body"])
    assert sent["max_tokens"] == 2 and sent["temperature"] == 0.7 and sent["logprobs"] == 1
    assert sent["model"] == MODEL and sent["stream"] is False
    assert "169.254.169.254" not in decode[0]["body"] and "169.254.169.254" not in prefill[0]["body"]
    assert sent["kv_transfer_params"]["remote_engine_id"] == fleet.prefill[0].engine_id
    if path == "exact":
        assert '"x":1.00000000000000000001' in decode[0]["body"]
    prefilled = _pairs(prefill[0]["body"])
    assert prefilled["max_tokens"] == 1 and prefilled["temperature"] == 0.7


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"prompt":"a","max_tokens":2,"max_tokens":"x"}', 400, "max_tokens"),
        (b'{"model":"llama-3.1-8b","model":"gpt-4","prompt":"a"}', 404, "model"),
        (b'{"prompt":"a","n":1,"n":2}', 400, "n"),
        (b'{"prompt":"a","prompt":null}', 400, "prompt"),
        (b'{"prompt":"a","audio":{"voice":"x"},"audio":null,"tools":[],"tools":[{"type":"retrieval"}]}', 400,
         "tools[0].type"),
        (b"{" + EXACT + b'"prompt":"a","max_tokens":2,"max_tokens":"x"}', 400, "max_tokens"),
    ],
    ids=["max_tokens", "model", "n", "prompt", "tools", "exact-path"],
)
def test_duplicate_keys_are_validated_by_their_last_value(start_router, fleet, journal_path, body, status, param) -> None:
    router = start_router()
    response, _ = _post(router, COMPLETIONS, body)
    assert_envelope(response, status, type="invalid_request_error", param=param)
    assert completion_records(fleet.all()) == []
    assert journal_terminal(journal_path, response.header("x-request-id"))["terminal"] == "invalid"


def test_huge_numbers_outside_the_validation_set_pass_through_exactly(start_router, fleet, journal_path) -> None:
    """Huge numbers are JSON: they reach the engine as written.

    The simulator parses with orjson, which refuses ``1e400`` (beyond a double): its 400 is relayed.
    """
    router = start_router()
    body = (b'{"prompt":"a","max_tokens":1,"x_big":1e400,"x_tiny":-1e-400,'
            b'"x_int":' + b"1234567890" * 40 + b',"x_precise":0.30000000000000000000000001}')
    response, _ = _post(router, COMPLETIONS, body)
    # the engine's refusal, relayed (docs/contract.md, "Responses and errors")
    assert_envelope(response, 400, type="invalid_request_error", code=None, param=None)
    assert journal_terminal(journal_path, response.header("x-request-id"))["terminal"] == "invalid"
    legs = completion_records(fleet.prefill)
    assert legs, "the request never reached the prefill engine"
    for leg in legs:
        assert '"x_big":1e400' in leg["body"] and '"x_tiny":-1e-400' in leg["body"]
        assert '"x_int":' + "1234567890" * 40 in leg["body"]
        assert '"x_precise":0.30000000000000000000000001' in leg["body"]
        assert "Infinity" not in leg["body"]
