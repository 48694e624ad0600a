"""Fault matrix: overload beyond the queue, and the per-client limit (docs/contract.md, "Admission, capacity
and retries").

A prefill engine that takes 1.5 s per leg keeps the admitted request busy;
``admission.max_inflight`` / ``queue_size`` / ``queue_timeout_s`` then decide
the others: a full queue answers 503 at once, a queued request that waits
too long answers 503, both with ``Retry-After`` and ``terminal: "rejected"``.
A client over ``per_client_max_inflight`` gets 429 while another client is
served.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import httpx

from ..helpers import MODEL, assert_envelope, only_terminals, poll, rid_of
from .support import WAIT, assert_idle, assert_kv_settled, metric, post


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # surfaced by the test
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _answer(thread: threading.Thread, box: list[Any]) -> httpx.Response:
    thread.join(15)
    assert box, "request did not finish"
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]  # type: ignore[no-any-return]


def test_overload_beyond_the_queue(start_router, make_fleet, journal_path) -> None:
    fleet = make_fleet(prefill=[{"delay_s": 1.5}], decode=[{}])
    router = start_router(fleet_=fleet, admission={"max_inflight": 1, "queue_size": 1, "queue_timeout_s": 0.3})

    first = _in_thread(lambda: post(router))
    poll(lambda: router.statistics().inflight == 1, what="first request admitted")
    queued = _in_thread(lambda: post(router))
    poll(lambda: router.statistics().queued == 1, what="second request queued")

    # The queue is full: refused at once.
    full = post(router)
    assert_envelope(full, 503, type="server_error", code="overloaded", retry_after=True)
    # The queued one waits 0.3 s for a slot that stays busy for 1.5 s.
    timed_out = _answer(*queued)
    assert_envelope(timed_out, 503, type="server_error", code="overloaded", retry_after=True)
    served = _answer(*first)
    assert served.status_code == 200, served.text

    records = only_terminals(journal_path, 3)
    for answer in (full, timed_out):
        record = records[rid_of(answer)]
        assert record["terminal"] == "rejected", record
        assert record["status"] == 503 and record["error"]["code"] == "overloaded", record
        assert record["legs"] == [], record
    assert records[rid_of(served)]["terminal"] == "completed"
    assert_idle(router)
    assert_kv_settled(fleet.prefill, None)


def test_per_client_limit_answers_429(start_router, make_fleet, journal_path) -> None:
    fleet = make_fleet(prefill=[{"delay_s": 1.5}], decode=[{}])
    router = start_router(
        fleet_=fleet,
        ingress={"auth": "trusted_header", "trusted_proxies": ("127.0.0.0/8",)},
        admission={"per_client_max_inflight": 1},
    )
    alice = {"x-narwhal-client": "alice"}
    bob = {"x-narwhal-client": "bob"}

    first = _in_thread(lambda: post(router, headers=alice))
    poll(lambda: router.statistics().inflight == 1, what="alice's first request admitted")
    other = _in_thread(lambda: post(router, headers=bob))
    poll(lambda: router.statistics().inflight == 2, what="bob's request admitted")

    limited = post(router, headers=alice)
    assert_envelope(limited, 429, code="rate_limited", type="rate_limit_error", retry_after=True)
    for answer in (_answer(*first), _answer(*other)):
        assert answer.status_code == 200, answer.text

    records = only_terminals(journal_path, 3)
    record = records[rid_of(limited)]
    assert record["terminal"] == "rejected" and record["status"] == 429, record
    assert record["client"] == "alice" and record["legs"] == [], record
    assert sorted(r["client"] for r in records.values() if r["terminal"] == "completed") == ["alice", "bob"]
    assert_idle(router)
    assert_kv_settled(fleet.prefill, None)


def _upload_head(size: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: narwhal.test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % size)


def test_slow_uploads_past_max_buffered_bytes_get_503(start_router, fleet, journal_path) -> None:
    """Unfinished request bodies are bounded across connections (``ingress.max_buffered_bytes``)."""
    router = start_router(ingress={"max_body_bytes": 100_000, "max_buffered_bytes": 150_000})
    prompt = "narwhal " * 11_000
    payload = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
    assert 80_000 < len(payload) < 100_000
    first = socket.create_connection(router.address, timeout=WAIT)  # type: ignore[arg-type]
    second = socket.create_connection(router.address, timeout=WAIT)  # type: ignore[arg-type]
    try:
        first.sendall(_upload_head(len(payload)) + payload[:-10])
        held = len(payload) - 10
        assert poll(lambda: router.statistics().buffered_bytes == held, timeout=WAIT)
        assert metric(router, "narwhal_buffered_request_bytes") == held
        second.sendall(_upload_head(len(payload)) + payload[:40_000])
        assert poll(lambda: router.statistics().buffered_bytes == held + 40_000, timeout=WAIT)
        # The next 30,000 bytes cross 150,000. One send, read whole: the router
        # closes a socket with nothing unread, so the client reads the 503
        # (closing with unread bytes would reset the connection first).
        second.sendall(payload[40_000:70_000])
        refused = _read_until_closed(second)
        assert refused.startswith(b"HTTP/1.1 503 "), refused[:200]
        head, _, text = refused.partition(b"\r\n\r\n")
        assert b"\r\nretry-after: " in head.lower() and b"\r\nconnection: close" in head.lower()
        refused_error = json.loads(text)["error"]
        assert (refused_error["type"], refused_error["code"]) == ("server_error", "overloaded")
        # A small request still fits beside the first upload, which then completes.
        assert post(router).status_code == 200
        first.sendall(payload[-10:])
        answer = _read_response(first)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    finally:
        first.close()
        second.close()
    records = only_terminals(journal_path, 3)
    assert sorted((r["terminal"], r["status"]) for r in records.values()) == [
        ("completed", 200), ("completed", 200), ("rejected", 503)
    ]
    rejected = next(r for r in records.values() if r["status"] == 503)
    # The record says what the client was told.
    assert (rejected["error"]["type"], rejected["error"]["code"]) == ("server_error", "overloaded")
    assert rejected["error"]["message"] == refused_error["message"] and rejected["route"] == "/v1/completions"
    assert_idle(router)
    assert poll(lambda: router.statistics().buffered_bytes == 0, timeout=WAIT)


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return data
