"""Graceful shutdown of ``narwhal serve`` (docs/contract.md, "Admission, capacity and retries";
docs/operate.md): a signal while requests run.

The router runs as a real process (``python -m narwhal.cli serve``) in front
of simulated engines in this process. The decode engine is slow enough that
requests take about a second; a signal arrives while several (streamed and
whole) are in flight. They must all finish well, with their terminal
records in the journal; a new connection is refused or answered 503; and the
process exits 0 within the grace period.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from narwhal_sim.testing import SimThread

from ..helpers import CHAT, COMPLETIONS, poll, read_journal, terminals_by_rid
from .support import RawClient, ServeProcess, http, request_bytes, serve_config, sse_chunks, streamed_text

#: Output tokens per request: ~7 ms each at speed 1, so a decode leg takes about a second.
TOKENS = 150
GRACE_S = 20.0


def _run(url: str, route: str, stream: bool, results: dict[int, Any], index: int) -> None:
    body: dict[str, Any] = {"max_tokens": TOKENS, "stream": stream}
    if route == COMPLETIONS:
        body["prompt"] = f"In flight number {index}"
    else:
        body["messages"] = [{"role": "user", "content": f"In flight number {index}"}]
    try:
        with httpx.Client(timeout=30, verify=False) as client:
            results[index] = client.post(url + route, json=body)
    except Exception as exc:  # reported by the test
        results[index] = exc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_in_flight_requests_and_exits_0(tmp_path, runtime, signum) -> None:
    journal = tmp_path / "journal.jsonl"
    with SimThread(role="prefill", speed=1) as prefill, SimThread(role="decode", speed=1) as decode:
        config = tmp_path / "narwhal.toml"
        config.write_text(serve_config(journal, prefill=[prefill.url], decode=[decode.url],
                                       shutdown={"grace_s": GRACE_S}))
        process = ServeProcess(config, runtime).start()
        try:
            listening = process.wait_for_event("listening", timeout=20)
            assert listening["runtime"] == runtime
            url = f"http://127.0.0.1:{listening['port']}"
            assert http.get(url + "/health", timeout=10).status_code == 200

            plan = [(COMPLETIONS, False), (COMPLETIONS, True), (CHAT, False), (CHAT, True), (COMPLETIONS, False)]
            results: dict[int, Any] = {}
            threads = [threading.Thread(target=_run, args=(url, route, stream, results, i), daemon=True)
                       for i, (route, stream) in enumerate(plan)]
            for thread in threads:
                thread.start()
            # Every request is in its decode leg, generating.
            decode.wait_for(lambda s: s["running"] >= len(plan), timeout=15)
            assert not results, results
            # An idle keep-alive connection, opened before the signal.
            idle = RawClient(("127.0.0.1", listening["port"]))
            idle.send(request_bytes("GET", "/health"))
            assert idle.read_response().status == 200

            signalled = time.monotonic()
            os.kill(process.proc.pid, signum)
            process.wait_for_event("draining", timeout=10)
            late = _new_request_after_signal(url)
            late_idle = _request_on_idle_connection(idle)

            for thread in threads:
                thread.join(GRACE_S)
            assert not any(t.is_alive() for t in threads), "an in-flight request did not finish"
            status = process.wait(GRACE_S)
            elapsed = time.monotonic() - signalled
        finally:
            process.stop()
    assert status == 0, process.stderr_text()
    assert elapsed < GRACE_S, elapsed
    events = [e["event"] for e in process.events()]
    assert "stopped" in events, events

    rids = []
    for i, (route, stream) in enumerate(plan):
        answer = results[i]
        assert isinstance(answer, httpx.Response), answer
        assert answer.status_code == 200, answer.text[:500]
        if stream:
            chunks = sse_chunks(answer)  # ends with data: [DONE], no error event
            assert not any("error" in c for c in chunks)
            assert len(streamed_text(chunks, chat=route == CHAT).split()) == TOKENS
        else:
            assert answer.json()["usage"]["completion_tokens"] == TOKENS
        rids.append(answer.headers["x-request-id"])

    terminals = terminals_by_rid(read_journal(journal))
    for rid in rids:
        assert terminals[rid]["terminal"] == "completed", terminals[rid]
    for rid in (late, late_idle):
        if rid is not None:
            assert terminals[rid]["terminal"] == "rejected"


def _request_on_idle_connection(conn: RawClient) -> str | None:
    """A request on a connection left idle across the signal: closed unanswered, or a 503."""
    try:
        with conn:
            conn.send(request_bytes("POST", COMPLETIONS, b'{"prompt": "late", "max_tokens": 2}',
                                    headers=[("content-type", "application/json")]))
            response = conn.read_response()
    except (EOFError, ConnectionResetError, BrokenPipeError):
        return None
    assert response.status == 503, response.body
    assert response.json()["error"]["type"] == "server_error"
    return response.header("x-request-id")


def _new_request_after_signal(url: str) -> str | None:
    """A new connection once draining began: refused (or closed unanswered), or a 503. Its rid if answered."""
    try:
        answer = http.post(url + COMPLETIONS, json={"prompt": "too late", "max_tokens": 2}, timeout=10)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        return None
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["type"] == "server_error"
    return answer.headers["x-request-id"]


def test_signal_with_nothing_in_flight_exits_0_at_once(tmp_path, runtime) -> None:
    journal = tmp_path / "journal.jsonl"
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode:
        config = tmp_path / "narwhal.toml"
        config.write_text(serve_config(journal, prefill=[prefill.url], decode=[decode.url]))
        process = ServeProcess(config, runtime).start()
        try:
            listening = process.wait_for_event("listening", timeout=20)
            url = f"http://127.0.0.1:{listening['port']}"
            answer = http.post(url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}, timeout=10)
            assert answer.status_code == 200
            poll(lambda: any(r.get("terminal") for r in read_journal(journal)), timeout=10, what="a terminal record")
            signalled = time.monotonic()
            process.proc.send_signal(signal.SIGTERM)
            status = process.wait(10)
        finally:
            process.stop()
    assert status == 0
    assert time.monotonic() - signalled < 5
    assert terminals_by_rid(read_journal(journal))[answer.headers["x-request-id"]]["terminal"] == "completed"
