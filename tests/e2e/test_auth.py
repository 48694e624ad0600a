"""docs/security.md end to end: each ``ingress.auth`` mode, and ``auth = "none"`` refused off loopback."""

from __future__ import annotations

import json

import httpx
import pytest

from ..helpers import (
    CHAT,
    COMPLETIONS,
    assert_envelope,
    completion_records,
    header_values,
    journal_terminal,
    read_journal,
    rid_of,
)
from .support import BASE_BODY, RawClient, ServeProcess, http, request_bytes, serve_config


def _denied(answer: httpx.Response, journal_path, fleet, before) -> dict:
    """A 401 in the envelope, journaled ``denied``, nothing sent to any engine."""
    assert_envelope(answer, 401, type="authentication_error")
    record = journal_terminal(journal_path, rid_of(answer))
    assert record["terminal"] == "denied" and record["status"] == 401, record
    assert record["legs"] == []
    assert record["error"]["type"] == "authentication_error"
    assert completion_records(fleet) == before
    assert not [r for r in read_journal(journal_path) if r["rid"] == record["rid"] and r["terminal"] is None]
    return record


# ------------------------------------------------------------------------ none


def test_auth_none_admits_everyone(start_router, fleet, journal_path) -> None:
    router = start_router(ingress={"auth": "none"})
    answer = http.post(router.url + COMPLETIONS, json=BASE_BODY[COMPLETIONS],
                        headers={"authorization": "Bearer whatever"}, timeout=10)
    assert answer.status_code == 200, answer.text
    record = journal_terminal(journal_path, rid_of(answer))
    assert record["terminal"] == "completed"
    assert isinstance(record["client"], str) and record["client"]
    # The client's Authorization is a client credential: never forwarded.
    for leg in completion_records(fleet):
        assert header_values(leg, "authorization") == []


# -------------------------------------------------------------------- api_keys


@pytest.fixture
def keyed_router(start_router, api_keys):
    return start_router(ingress={"auth": "api_keys", "api_keys_file": str(api_keys.path)})


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_api_key_names_the_client(keyed_router, api_keys, fleet, journal_path, route, stream) -> None:
    for client, key in api_keys.keys.items():
        answer = http.post(keyed_router.url + route, json={**BASE_BODY[route], "stream": stream},
                            headers={"authorization": f"Bearer {key}"}, timeout=10)
        assert answer.status_code == 200, answer.text
        rid = rid_of(answer)
        record = journal_terminal(journal_path, rid)
        assert record["terminal"] == "completed" and record["client"] == client
        progress = [r for r in read_journal(journal_path) if r["rid"] == rid and r["terminal"] is None]
        assert progress and all(r["client"] == client for r in progress)
    for leg in completion_records(fleet):
        assert not any(key in json.dumps(leg) for key in api_keys.keys.values())


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer sk-wrong-key"},
        {"authorization": "Basic dGVhbS1hOnNlY3JldA=="},
        {"authorization": "Bearer"},
        {"authorization": "Bearer KEYx"},
        {"authorization": "Bearer KEY extra"},
        {"x-api-key": "KEY"},
        {"api-key": "KEY"},
        {"authorization": "KEY"},
    ],
    ids=["missing", "wrong", "basic", "bearer-only", "key-plus-one", "two-tokens", "x-api-key", "api-key",
         "no-scheme"],
)
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT], ids=["completions", "chat"])
def test_missing_or_wrong_api_key_is_401_denied(keyed_router, api_keys, fleet, journal_path, headers, route) -> None:
    real = api_keys.keys["team-a"]
    headers = {name: value.replace("KEY", real) for name, value in headers.items()}
    before = completion_records(fleet)
    answer = http.post(keyed_router.url + route, json=BASE_BODY[route], headers=headers, timeout=10)
    record = _denied(answer, journal_path, fleet, before)
    assert record["client"] is None, record
    assert real not in answer.text


def test_unauthenticated_request_gets_401_whatever_its_body(keyed_router, fleet, journal_path) -> None:
    """docs/contract.md, "Request rules": authentication runs before the contract checks."""
    before = completion_records(fleet)
    for content in (b"{not json", b"[]", b'{"prompt": "hi", "n": 2}', b'{"prompt": "hi", "model": "gpt-4o"}'):
        answer = http.post(keyed_router.url + COMPLETIONS, content=content,
                            headers={"authorization": "Bearer nope"}, timeout=10)
        _denied(answer, journal_path, fleet, before)


def test_unauthenticated_expect_100_continue_is_401(keyed_router, fleet, journal_path) -> None:
    body = json.dumps(BASE_BODY[COMPLETIONS]).encode()
    with RawClient(keyed_router.address) as conn:
        conn.send(request_bytes("POST", COMPLETIONS, None, headers=[
            ("content-type", "application/json"), ("content-length", str(len(body))), ("expect", "100-continue")]))
        response = conn.read_response()
        if response.status == 100:
            conn.send(body)
            response = conn.read_response()
    assert response.status == 401
    assert response.json()["error"]["type"] == "authentication_error"
    record = journal_terminal(journal_path, response.header("x-request-id"))
    assert record["terminal"] == "denied"
    assert completion_records(fleet) == []


def test_authenticated_expect_100_continue_is_served(keyed_router, api_keys, journal_path) -> None:
    body = json.dumps(BASE_BODY[COMPLETIONS]).encode()
    with RawClient(keyed_router.address) as conn:
        conn.send(request_bytes("POST", COMPLETIONS, None, headers=[
            ("content-type", "application/json"), ("content-length", str(len(body))), ("expect", "100-continue"),
            ("authorization", "Bearer " + api_keys.keys["team-a"])]))
        assert conn.read_response().status == 100
        conn.send(body)
        response = conn.read_response()
    assert response.status == 200, response.body
    record = journal_terminal(journal_path, response.header("x-request-id"))
    assert record["terminal"] == "completed" and record["client"] == "team-a"


# -------------------------------------------------------------- trusted_header


def test_trusted_header_from_a_trusted_proxy_names_the_client(start_router, fleet, journal_path) -> None:
    router = start_router(ingress={"auth": "trusted_header", "trusted_proxies": ("127.0.0.0/8",)})
    answer = http.post(router.url + COMPLETIONS, json=BASE_BODY[COMPLETIONS],
                        headers={"x-narwhal-client": "tenant-42"}, timeout=10)
    assert answer.status_code == 200, answer.text
    record = journal_terminal(journal_path, rid_of(answer))
    assert record["terminal"] == "completed" and record["client"] == "tenant-42"
    # The identity header is Narwhal's own (x-narwhal-*): never forwarded to engines.
    for leg in completion_records(fleet):
        assert header_values(leg, "x-narwhal-client") == []
        assert "tenant-42" not in json.dumps(leg["headers"])


def test_trusted_header_with_a_custom_header_name(start_router, journal_path) -> None:
    router = start_router(ingress={"auth": "trusted_header", "trusted_proxies": ("127.0.0.1/32",),
                                   "client_header": "X-Authenticated-User"})
    answer = http.post(router.url + CHAT, json=BASE_BODY[CHAT], headers={"x-authenticated-user": "alice"},
                        timeout=10)
    assert answer.status_code == 200, answer.text
    assert journal_terminal(journal_path, rid_of(answer))["client"] == "alice"


def test_trusted_header_missing_is_401_denied(start_router, fleet, journal_path) -> None:
    router = start_router(ingress={"auth": "trusted_header", "trusted_proxies": ("127.0.0.0/8",)})
    before = completion_records(fleet)
    answer = http.post(router.url + COMPLETIONS, json=BASE_BODY[COMPLETIONS], timeout=10)
    _denied(answer, journal_path, fleet, before)


def test_trusted_header_from_an_untrusted_peer_is_401_denied(start_router, fleet, journal_path) -> None:
    router = start_router(ingress={"auth": "trusted_header", "trusted_proxies": ("10.0.0.0/8",)})
    before = completion_records(fleet)
    answer = http.post(router.url + COMPLETIONS, json=BASE_BODY[COMPLETIONS],
                        headers={"x-narwhal-client": "tenant-42"}, timeout=10)
    record = _denied(answer, journal_path, fleet, before)
    assert record["client"] != "tenant-42"


# ------------------------------------------------- auth = "none" off loopback


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0"])
def test_auth_none_on_a_non_loopback_address_refuses_to_start(tmp_path, runtime, listen) -> None:
    config = tmp_path / "narwhal.toml"
    config.write_text(serve_config(tmp_path / "journal.jsonl", prefill=["http://127.0.0.1:9"],
                                   decode=["http://127.0.0.1:10"], ingress={"listen": listen, "auth": "none"}))
    process = ServeProcess(config, runtime).start()
    try:
        status = process.wait(30)
        stderr = process.stderr_text()
    finally:
        process.stop()
    assert status != 0
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "ingress.auth" in lines[0], lines[0]
    assert not any(e.get("event") == "listening" for e in process.events())
    assert not (tmp_path / "journal.jsonl").exists()
