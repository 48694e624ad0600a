"""docs/contract.md, "The engine request" and "Prefill and decode legs", end to end: exactly what the engines receive.

The engines record every request they get (headers as received, raw body),
so these tests compare the prefill and decode legs byte for byte with what
docs/contract.md says they must be: the client's body with exactly the listed edits,
key order kept, numbers and strings unchanged; only the headers Narwhal
writes; the engine credential on every leg, probe and KV release.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from narwhal_core.kv import NOTHING_HELD

from ..harness import Fleet
from ..helpers import (
    BACKEND_ID_RE,
    CHAT,
    COMPLETIONS,
    COMPLETION_PATHS,
    LEG_HEADERS,
    MODEL,
    PREFILL_KV_REQUEST,
    assert_envelope,
    completion_records,
    each_route,
    header_pairs,
    header_values,
    journal_terminal,
    poll,
    read_journal,
    rid_of,
)
from .support import exact_json, http, sse_chunks


#: Client headers that must never reach an engine (docs/contract.md, "The engine request").
HOSTILE_HEADERS = {
    "Authorization": "Bearer client-secret-abc",
    "api-key": "client-api-key-def",
    "x-api-key": "client-x-api-key-ghi",
    "Cookie": "session=client-cookie-jkl",
    "X-Request-Id": "client-rid-123",
    "X-Narwhal-Client": "impostor",
    "X-Narwhal-Debug": "debug-mno",
    "X-Custom-Trace": "tr-42",
}


def _is_subsequence(short: list[str], long: list[str]) -> bool:
    it = iter(long)
    return all(item in it for item in short)


def _expected_prefill(client: dict[str, Any], stripped: set[str]) -> dict[str, Any]:
    """docs/contract.md, "Prefill and decode legs", applied to the client's body (values only; order is
    checked separately)."""
    out: dict[str, Any] = {}
    for key, value in client.items():
        if key in stripped or key in ("min_completion_tokens", "stream_options"):
            continue
        if key == "min_tokens":
            # Kept as 1 when the client asked for at least one token (docs/operate.md).
            if not (type(value) is int and value >= 1):
                continue
            value = 1
        elif key in ("max_tokens", "max_completion_tokens"):
            value = 1
        elif key == "stream":
            value = False
        elif key == "model":
            value = MODEL
        out[key] = value
    out.setdefault("model", MODEL)
    out.setdefault("max_tokens", 1)
    out.setdefault("stream", False)
    out["kv_transfer_params"] = PREFILL_KV_REQUEST
    return out


def _expected_decode(client: dict[str, Any], stripped: set[str], kv: dict[str, Any]) -> dict[str, Any]:
    """docs/contract.md, "Prefill and decode legs": the client's body (model set, router-owned fields gone)
    plus the prefill's KV params."""
    out = {key: (MODEL if key == "model" else value) for key, value in client.items() if key not in stripped}
    out.setdefault("model", MODEL)
    out["kv_transfer_params"] = kv
    return out


def _legs(fleet: Fleet) -> tuple[dict[str, Any], dict[str, Any]]:
    prefill = completion_records(fleet.prefill)
    decode = completion_records(fleet.decode)
    assert len(prefill) == 1 and len(decode) == 1, (prefill, decode)
    return prefill[0], decode[0]


def _check_leg_headers(record: dict[str, Any], backend_id: str, engine_key: str | None) -> None:
    names = [name for name, _ in header_pairs(record)]
    assert set(names) <= LEG_HEADERS, f"headers Narwhal did not write reached the engine: {names}"
    assert header_values(record, "x-request-id") == [backend_id]
    if engine_key is None:
        assert header_values(record, "authorization") == []
    else:
        assert header_values(record, "authorization") == [f"Bearer {engine_key}"]
    assert len(header_values(record, "host")) == 1
    raw = json.dumps(record["headers"])
    for value in HOSTILE_HEADERS.values():
        assert value not in raw, value


# ------------------------------------------------------------------ bodies


_CLIENT_BODIES = {
    COMPLETIONS: {
        "model": "llama-3.1-8b",
        "prompt": "Describe the tusk of a narwhal.",
        "max_tokens": 7,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 2,
        "top_p": 0.95,
        "stop": ["\n\n", "END"],
        "n": 1,
        "seed": 11,
        "logit_bias": {"50256": -100},
    },
    CHAT: {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Narwhal tusk?"}],
        "temperature": 0.2,
        "max_completion_tokens": 6,
        "max_tokens": 9,
        "min_completion_tokens": 1,
        "frequency_penalty": 0.5,
        "best_of": 1,
        "response_format": {"type": "text"},
        "user": "ünïcødé-🐳",
    },
}


@each_route
@pytest.mark.parametrize("model", ["configured", "alias", "absent"])
def test_prefill_and_decode_bodies_are_the_client_body_with_the_listed_edits(
    start_router, fleet, journal_path, route, model
) -> None:
    router = start_router()
    client = dict(_CLIENT_BODIES[route])
    if model == "configured":
        client["model"] = MODEL
    elif model == "alias":
        client["model"] = "llama-3.1-8b"
    else:
        client.pop("model", None)
    content = json.dumps(client).encode()
    client = exact_json(content)  # numbers as exact decimals, as the engines' bodies are read
    answer = http.post(router.url + route, content=content, headers={"content-type": "application/json"},
                        timeout=10)
    assert answer.status_code == 200, answer.text
    if client.get("stream"):
        sse_chunks(answer)
    record = journal_terminal(journal_path, rid_of(answer))
    assert record["terminal"] == "completed"
    prefill_rec, decode_rec = _legs(fleet)

    prefill = exact_json(prefill_rec["body"])
    assert prefill == _expected_prefill(client, set()), prefill
    # Other fields keep their order (docs/contract.md, "Prefill and decode legs"): the client's keys appear in
    # the client's order.
    kept = [k for k in client if k not in ("min_completion_tokens", "stream_options")]
    assert _is_subsequence(kept, list(prefill)), (kept, list(prefill))
    assert "max_completion_tokens" not in prefill or "max_completion_tokens" in client

    decode = exact_json(decode_rec["body"])
    kv = decode["kv_transfer_params"]
    assert decode == _expected_decode(client, set(), kv), decode
    assert _is_subsequence([k for k in client if k != "model"], list(decode)), (list(client), list(decode))
    # The decode leg carries the prefill answer's KV params: its owner key, engine and address.
    engine = fleet.prefill[0]
    assert kv["do_remote_prefill"] is True
    assert kv["remote_engine_id"] == engine.engine_id
    assert kv["remote_request_id"] == prefill_rec["kv"]["owner"] == record["legs"][0]["kv"]["owner"]
    assert (kv["remote_host"], kv["remote_port"]) == (engine.host, engine.port)
    assert record["legs"][0]["kv"]["outcome"] == "pulled"


@each_route
def test_model_is_set_to_the_configured_name_on_both_legs(start_router, fleet, route) -> None:
    router = start_router()
    for model in ("llama-3.1-8b", None, MODEL):
        for engine in fleet.all():
            engine.reset()
        body = {COMPLETIONS: {"prompt": "hi"}, CHAT: {"messages": [{"role": "user", "content": "hi"}]}}[route]
        if model is not None:
            body = {"model": model, **body}
        assert http.post(router.url + route, json=body, timeout=10).status_code == 200
        for leg in _legs(fleet):
            assert exact_json(leg["body"])["model"] == MODEL


class _VendorPrefill:
    """A prefill engine answering with extra, exactly-written ``kv_transfer_params`` fields."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._send(200, b"{}")

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path.split("?")[0] not in COMPLETION_PATHS:
                    self._send(404, b'{"error": {"message": "no", "type": "NotFound", "param": null, "code": 404}}')
                    return
                outer.bodies.append(body)
                self._send(200, outer.answer(self.headers.get("x-request-id", "")))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), name="vendor-prefill",
                                       daemon=True)

    def kv_text(self, request_id: str) -> str:
        return (
            '{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"vendor-engine-7",'
            f'"remote_request_id":"{request_id}-v1","remote_block_ids":[7,8,9],"remote_host":"127.0.0.1",'
            f'"remote_port":{self.port},"tp_size":1,'
            '"x_vendor":{"score":0.30000000000000000000000001,"big":123456789012345678901234567890,'
            '"tiny":1e-300,"note":"\\u00fcn\\u00ef \\ud83d\\udc33","list":[1,2.50,-0.0,null,true]}}'
        )

    def answer(self, request_id: str) -> bytes:
        return (
            '{"id":"cmpl-v","object":"text_completion","created":1,"model":"' + MODEL + '",'
            '"choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":"length"}],'
            '"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,'
            '"prompt_tokens_details":{"cached_tokens":2}},'
            '"kv_transfer_params":' + self.kv_text(request_id) + "}"
        ).encode()

    def __enter__(self) -> _VendorPrefill:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def vendor_prefill() -> Iterator[_VendorPrefill]:
    with _VendorPrefill() as engine:
        yield engine


@each_route
def test_decode_leg_gets_the_prefill_kv_params_verbatim(
    start_router, fleet, journal_path, vendor_prefill, route
) -> None:
    """docs/contract.md, "Prefill and decode legs": ``kv_transfer_params`` copied verbatim, vendor fields and
    exact numbers included."""
    vendor_fleet = Fleet(prefill=[vendor_prefill], decode=fleet.decode)
    router = start_router(fleet_=vendor_fleet)
    body = {COMPLETIONS: {"prompt": "hi there"}, CHAT: {"messages": [{"role": "user", "content": "hi"}]}}[route]
    answer = http.post(router.url + route, json={**body, "max_tokens": 3}, timeout=10)
    assert answer.status_code == 200, answer.text
    record = journal_terminal(journal_path, rid_of(answer))
    prefill_bid = record["legs"][0]["backend_id"]
    decode_rec = completion_records(fleet.decode)[-1]
    sent = exact_json(decode_rec["body"])["kv_transfer_params"]
    assert sent == exact_json(vendor_prefill.kv_text(prefill_bid)), sent
    assert list(sent) == list(exact_json(vendor_prefill.kv_text(prefill_bid)))
    assert record["legs"][0]["kv"]["owner"] == f"{prefill_bid}-v1"
    # The client's cached_tokens is the prefill's figure (2), not the decode engine's.
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2


# ----------------------------------------------------------------- stripped


@each_route
def test_router_owned_fields_are_stripped_and_journaled(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    client = {
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "203.0.113.9", "remote_port": 1,
                               "remote_engine_id": "evil", "remote_request_id": "victim", "remote_block_ids": [0]},
        **{COMPLETIONS: {"prompt": "hi"}, CHAT: {"messages": [{"role": "user", "content": "hi"}]}}[route],
        "request_id": "client-chosen-id",
        "max_tokens": 3,
        "bootstrap_host": "203.0.113.9",
        "bootstrap_port": 8998,
        "bootstrap_room": 12345,
    }
    answer = http.post(router.url + route, json=client, timeout=10)
    assert answer.status_code == 200, answer.text
    client = exact_json(json.dumps(client))
    record = journal_terminal(journal_path, rid_of(answer))
    owned = ["kv_transfer_params", "request_id", "bootstrap_host", "bootstrap_port", "bootstrap_room"]
    assert sorted(record["stripped"]) == sorted(owned), record["stripped"]
    prefill_rec, decode_rec = _legs(fleet)
    prefill, decode = exact_json(prefill_rec["body"]), exact_json(decode_rec["body"])
    for leg in (prefill, decode):
        assert not {"request_id", "bootstrap_host", "bootstrap_port", "bootstrap_room"} & set(leg), leg
    assert prefill["kv_transfer_params"] == PREFILL_KV_REQUEST
    assert decode["kv_transfer_params"]["remote_engine_id"] == fleet.prefill[0].engine_id
    assert "203.0.113.9" not in prefill_rec["body"] + decode_rec["body"]
    assert prefill == _expected_prefill(client, set(owned))
    assert decode == _expected_decode(client, set(owned), decode["kv_transfer_params"])


def test_nothing_stripped_means_an_empty_list(start_router, journal_path) -> None:
    router = start_router()
    answer = http.post(router.url + COMPLETIONS, json={"prompt": "hi"}, timeout=10)
    assert journal_terminal(journal_path, rid_of(answer))["stripped"] == []


# ------------------------------------------------------------- pass-through


def test_fields_outside_the_validation_set_pass_through_exactly(start_router, fleet, journal_path) -> None:
    """docs/contract.md, "Request rules": numbers by exact decimal value, strings by code point, on both legs."""
    router = start_router()
    text = (
        '{"prompt": "hi", "max_tokens": 3,'
        ' "temperature": 0.1000000000000000000000000001,'
        ' "seed": 123456789012345678901234567890,'
        ' "neg": -987654321098765432109876543210,'
        ' "tiny": 1e-320, "exp": 1.5E+300, "frac": 2.50, "zero": -0.0,'
        ' "user": "\\u00fcn\\u00efc\\u00f8d\\u00e9 \\ud83d\\udc33 \\u2028 \\u0000 e\\u0301 \\"q\\" \\\\",'
        ' "raw_utf8": "Narwhal \xf0\x9f\x90\xb3 Qaanaaq \xc3\xa6\xc3\xb8\xc3\xa5",'
        ' "metadata": {"nested": [1, 2.0, 3.14159265358979323846264338327950288, {"deep": "\\t"}], "empty": {}},'
        ' "logit_bias": {"50256": -100, "13": 1e2}}'
    ).encode("latin-1").decode("utf-8").encode("utf-8")
    answer = http.post(router.url + COMPLETIONS, content=text, headers={"content-type": "application/json"},
                        timeout=10)
    assert answer.status_code == 200, answer.text
    journal_terminal(journal_path, rid_of(answer))
    sent = exact_json(text)
    for leg in _legs(fleet):
        got = exact_json(leg["body"])
        for key in ("temperature", "seed", "neg", "tiny", "exp", "frac", "zero", "user", "raw_utf8", "metadata",
                    "logit_bias"):
            assert got[key] == sent[key], (key, got[key], sent[key])
            assert type(got[key]) is type(sent[key]), key
        assert "Infinity" not in leg["body"] and "NaN" not in leg["body"]


def test_huge_exponent_reaches_the_engine_exactly(start_router, fleet, journal_path) -> None:
    """``1e400`` is a JSON number: it reaches the engine as written, never as Infinity.

    The simulator parses with orjson, which refuses a number beyond a double's range: its 400 is relayed
    (the engine's message, ``param`` null) and journalled ``invalid``, naming the prefill leg, never retried.
    """
    router = start_router()
    text = b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e400, "top_p": -1E-400}'
    answer = http.post(router.url + COMPLETIONS, content=text, headers={"content-type": "application/json"},
                        timeout=10)
    error = assert_envelope(answer, 400, type="invalid_request_error", code=None, param=None)
    assert error["message"] == "request body is not valid JSON", error
    record = journal_terminal(journal_path, rid_of(answer))
    assert record["terminal"] == "invalid" and record["status"] == 400, record
    assert record["error"]["leg"] == "prefill" and record["error"]["engine"] == fleet.prefill_urls[0], record
    assert [(leg["phase"], leg["outcome"]) for leg in record["legs"]] == [("prefill", "refused")], record
    received = completion_records(fleet.prefill)
    assert received, "the request never reached the prefill engine"
    got = exact_json(received[0]["body"])
    assert got["temperature"] == exact_json(b"1e400") and got["top_p"] == exact_json(b"-1E-400")
    assert "Infinity" not in received[0]["body"]
    if answer.status_code != 200:
        # The engine's refusal is relayed with its status, in the envelope (docs/contract.md, "Responses and errors").
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert answer.status_code == received[0]["status"]


# ------------------------------------------------------------------ headers


@each_route
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_legs_carry_only_narwhal_headers_and_the_engine_credential(
    start_secure_router, secure_fleet, engine_key, journal_path, route, stream
) -> None:
    router = start_secure_router()
    body = {COMPLETIONS: {"prompt": "hi"}, CHAT: {"messages": [{"role": "user", "content": "hi"}]}}[route]
    answer = http.post(router.url + route, json={**body, "stream": stream, "max_tokens": 3},
                        headers=HOSTILE_HEADERS, timeout=10)
    assert answer.status_code == 200, answer.text
    rid = rid_of(answer)
    assert rid != HOSTILE_HEADERS["X-Request-Id"]
    record = journal_terminal(journal_path, rid)
    assert record["client_rid"] == HOSTILE_HEADERS["X-Request-Id"]
    assert record["client"] != "impostor"
    prefill_rec, decode_rec = _legs(secure_fleet)
    prefill_leg, decode_leg = record["legs"]
    _check_leg_headers(prefill_rec, prefill_leg["backend_id"], engine_key)
    _check_leg_headers(decode_rec, decode_leg["backend_id"], engine_key)
    # Distinct, well-formed backend IDs per leg, none of them the client's ID or the bare rid.
    ids = {prefill_leg["backend_id"], decode_leg["backend_id"], rid, HOSTILE_HEADERS["X-Request-Id"]}
    assert len(ids) == 4, ids
    assert all(BACKEND_ID_RE.match(b) for b in (prefill_leg["backend_id"], decode_leg["backend_id"]))
    # The decode engine pulled the KV from the prefill engine: the handoff worked with credentials.
    assert secure_fleet.prefill[0].stats()["kv_pulled"] == 1


def test_without_an_engine_credential_legs_carry_no_authorization(start_router, fleet, journal_path) -> None:
    router = start_router()
    answer = http.post(router.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2},
                        headers=HOSTILE_HEADERS, timeout=10)
    assert answer.status_code == 200, answer.text
    record = journal_terminal(journal_path, rid_of(answer))
    prefill_rec, decode_rec = _legs(fleet)
    _check_leg_headers(prefill_rec, record["legs"][0]["backend_id"], None)
    _check_leg_headers(decode_rec, record["legs"][1]["backend_id"], None)


def test_health_probes_carry_the_engine_credential(start_secure_router, secure_fleet, engine_key) -> None:
    router = start_secure_router()
    for engine in secure_fleet.all():
        probes = poll(lambda e=engine: e.requests("/health"), timeout=10, what="a health probe")
        for probe in probes:
            assert probe["method"] == "GET"
            assert header_values(probe, "authorization") == [f"Bearer {engine_key}"], probe["headers"]
            assert probe["status"] == 200
    assert router.statistics().ready
    assert http.get(router.url + "/ready", timeout=10).status_code == 200


def test_probes_without_the_credential_would_fail(start_router, secure_fleet) -> None:
    """Control: a router lacking the credential sees the secure engines as down (so probes above prove it)."""
    router = start_router(fleet_=secure_fleet, health={"probe_interval_s": 0.05, "unhealthy_after": 1})
    poll(lambda: http.get(router.url + "/ready", timeout=10).status_code == 503, timeout=10, what="/ready 503")
    assert all(p["status"] == 401 for e in secure_fleet.all() for p in e.requests("/health"))


@pytest.mark.parametrize("mode", ["decode_pull", "abort_endpoint", "decode_abort"])
def test_kv_release_requests_carry_the_engine_credential(
    start_secure_router, secure_fleet, engine_key, journal_path, mode
) -> None:
    """A decode leg refused by its engine: the prefilled KV is released, with the engine credential."""
    router = start_secure_router(engine={"kv_release": mode})
    prefill, decode = secure_fleet.prefill[0], secure_fleet.decode[0]
    decode.set_faults(error_rate=1.0, error_status=400)
    answer = http.post(router.url + COMPLETIONS, json={"prompt": "release me", "max_tokens": 3}, timeout=10)
    # The engine's 4xx is relayed with its status, in the envelope (docs/contract.md, "Responses and errors").
    assert answer.status_code == 400, answer.text
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    record = journal_terminal(journal_path, rid_of(answer))
    kv = record["legs"][0]["kv"]
    assert kv is not None and kv["owner"] == completion_records([prefill])[0]["kv"]["owner"]
    if mode == "abort_endpoint":
        releases = poll(lambda: prefill.requests("/abort_request"), timeout=10, what="an abort request")
        assert len(releases) == 1
        assert header_values(releases[0], "authorization") == [f"Bearer {engine_key}"]
        assert json.loads(releases[0]["body"]) == {"rid": kv["owner"], "request_id": kv["owner"]}
        assert releases[0]["status"] == 200
        assert kv["outcome"] == "released" and kv["error"] is None
        assert prefill.stats()["kv_released"] == 1
    elif mode == "decode_pull":
        # A whole one-token decode request; this decode engine refuses every request (400), so
        # nothing confirms the release (and no vLLM before 0.21 tells the prefill engine).
        sent = poll(lambda: len(completion_records([decode])) >= 2 and completion_records([decode]), timeout=10,
                    what="a decode_pull request")
        release = sent[1]
        assert header_values(release, "authorization") == [f"Bearer {engine_key}"]
        # A control request goes out through the HTTP client, with its own default headers; none is client state.
        assert set(n for n, _ in header_pairs(release)) <= LEG_HEADERS | {"accept", "accept-encoding", "connection",
                                                                           "user-agent"}
        assert header_values(release, "accept-encoding") == ["identity"]
        body = exact_json(release["body"])
        assert (body["max_tokens"], body["stream"]) == (1, False)
        assert body["kv_transfer_params"]["remote_request_id"] == kv["owner"]
        assert (kv["outcome"], kv["method"], kv["error"]) == (
            "release_sent", "decode_pull", "the decode engine answered 400",
        )
    else:
        sent = poll(lambda: len(completion_records([decode])) >= 2 and completion_records([decode]), timeout=10,
                    what="a decode_abort request")
        release = sent[1]
        assert header_values(release, "authorization") == [f"Bearer {engine_key}"]
        assert set(n for n, _ in header_pairs(release)) <= LEG_HEADERS
        (bid,) = header_values(release, "x-request-id")
        assert BACKEND_ID_RE.match(bid)
        assert bid not in {leg["backend_id"] for leg in record["legs"]}, "a release needs its own backend ID"
        assert exact_json(release["body"])["kv_transfer_params"]["remote_request_id"] == kv["owner"]
        # Nothing comes back from a decode_abort: never "released" (docs/operate.md).
        assert kv["outcome"] == "release_sent", kv
        assert kv["method"] == "decode_abort"


def test_a_release_that_finds_the_kv_already_pulled_says_so(start_router, fleet, journal_path) -> None:
    """The decode engine pulls the KV, then drops the connection before its answer's head.

    Narwhal cannot know the pull happened, so it releases; the prefill
    engine's abort endpoint answers that it held nothing, and the journal
    says so instead of claiming Narwhal freed the blocks.
    """
    router = start_router(engine={"kv_release": "abort_endpoint"}, retry={"max_attempts": 1})
    prefill, decode = fleet.prefill[0], fleet.decode[0]
    decode.set_faults(drop_after_chunks=0)
    answer = http.post(router.url + COMPLETIONS, json={"prompt": "pull then fail", "max_tokens": 3}, timeout=10)
    assert answer.status_code == 502, answer.text
    record = journal_terminal(journal_path, rid_of(answer))
    assert [(leg["phase"], leg["outcome"]) for leg in record["legs"]] == [("prefill", "ok"), ("decode", "dropped")]
    kv = record["legs"][0]["kv"]
    assert (kv["outcome"], kv["method"], kv["error"]) == ("released", "abort_endpoint", NOTHING_HELD)
    (release,) = prefill.requests("/abort_request")
    assert json.loads(release["body"]) == {"rid": kv["owner"], "request_id": kv["owner"]}
    stats = prefill.stats()
    assert (stats["kv_pulled"], stats["kv_released"], stats["kv_held"]) == (1, 0, 0)


# ---------------------------------------------------------------- client rid


@pytest.mark.parametrize(
    ("sent", "check"),
    [
        (b"A" * 300, lambda got: got == "A" * 128),
        (b"trace-\x01\x7f\xff-end", lambda got: got.startswith("trace-") and got != "trace-\x01\x7f\xff-end"),
        (b"ok-id-42", lambda got: got == "ok-id-42"),
    ],
    ids=["long", "non-printable", "plain"],
)
def test_client_request_id_is_kept_sanitised_as_client_rid(start_router, fleet, journal_path, sent, check) -> None:
    router = start_router()
    answer = http.post(router.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2},
                        headers=[(b"x-request-id", sent)], timeout=10)
    assert answer.status_code == 200, answer.text
    rid = rid_of(answer)
    assert rid.encode() != sent
    records = [r for r in read_journal(journal_path) if r["rid"] == rid]
    terminal = journal_terminal(journal_path, rid)
    for record in [*records, terminal]:
        got = record["client_rid"]
        assert isinstance(got, str) and len(got) <= 128, got
        assert all(" " <= ch <= "~" for ch in got), got
        assert check(got), got
    for leg in completion_records(fleet):
        assert header_values(leg, "x-request-id") != [sent.decode("latin-1")]


def test_no_client_request_id_means_null_client_rid(start_router, journal_path) -> None:
    router = start_router()
    answer = http.post(router.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert journal_terminal(journal_path, rid_of(answer))["client_rid"] is None
