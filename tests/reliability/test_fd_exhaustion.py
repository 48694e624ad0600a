"""Fault matrix: Narwhal runs out of file descriptors (docs/contract.md, "Admission, capacity and retries",
"The journal").

``narwhal serve`` runs as a subprocess with a small ``RLIMIT_NOFILE``; idle
client connections use up its descriptors, so its next leg cannot open a
socket (``EMFILE``). That is the router's own shortage, not the engines':
the request ends 503 ``router_resources_exhausted`` (with ``Retry-After``)
and a terminal record whose legs say ``local_error``; no engine leaves
rotation (``/ready`` stays 200, no ``engine_down`` line), and once the idle
connections go the next request is served at once. Accepting the fillers it
has no descriptor for fails too: one ``accept_failed`` line marked a
shortage per pause of ``ACCEPT_RETRY_S``, the same on both runtimes
(docs/operate.md, "Ingress requirements").
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from typing import Any

from narwhal_runtime.listening import ACCEPT_RETRY_S

from ..helpers import COMPLETIONS, MODEL, poll, read_journal
from .support import ServeProcess, write_config

#: The router's soft RLIMIT_NOFILE: room for start-up, a handful of clients and engine sockets.
NOFILE = 160


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _request(conn: http.client.HTTPConnection, method: str, target: str, payload: Any = None) -> tuple[int, dict[str, str], Any]:
    body = None if payload is None else json.dumps(payload).encode()
    headers = {} if body is None else {"content-type": "application/json"}
    conn.request(method, target, body=body, headers=headers)
    answer = conn.getresponse()
    data = answer.read()
    return answer.status, {k.lower(): v for k, v in answer.getheaders()}, json.loads(data) if data else None


def test_out_of_file_descriptors_fails_the_request_not_the_engines(runtime, sims, tmp_path) -> None:
    prefill, decode = sims("prefill"), sims("decode")
    journal = tmp_path / "journal.jsonl"
    config = write_config(
        tmp_path / "narwhal.toml", journal, prefill=[prefill.url], decode=[decode.url],
        # One charged failure would take an engine out: the test sees any.
        health={"unhealthy_after": 1, "healthy_after": 1, "probe_interval_s": 0.2},
        retry={"max_attempts": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.01},
    )
    server = ServeProcess(config, runtime, nofile=NOFILE).start(listening_timeout=20)
    control = http.client.HTTPConnection(*server.address, timeout=10)  # type: ignore[misc]
    fillers: list[socket.socket] = []
    try:
        # /ready turns 200 once the first probes, sent at start, have been answered.
        assert poll(lambda: _request(control, "GET", "/ready")[0] == 200, timeout=10), server.lines[-30:]
        # Use up the router's descriptors with idle connections (it accepts
        # them; those it cannot accept wait in the backlog).
        for _ in range(NOFILE):
            fillers.append(socket.create_connection(server.address, timeout=10))  # type: ignore[arg-type]
        assert poll(lambda: _fds(server.pid) >= NOFILE - 1, timeout=10), _fds(server.pid)

        status, headers, answer = _request(control, "POST", COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert status == 503, answer
        assert answer["error"]["code"] == "router_resources_exhausted", answer
        assert "retry-after" in headers
        rid = headers["x-request-id"]
        # The engines are as healthy as before.
        status, _, ready = _request(control, "GET", "/ready")
        assert status == 200 and ready["ready"] is True, (ready, server.lines[-30:])

        for filler in fillers:
            filler.close()
        fillers.clear()
        assert poll(lambda: _fds(server.pid) < NOFILE // 2, timeout=10), _fds(server.pid)
        status, _, answer = _request(control, "POST", COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert status == 200, answer
    finally:
        for filler in fillers:
            filler.close()
        control.close()
        server.stop()

    assert not [e for e in server.events() if e.get("event") == "engine_down"], server.lines
    terminal = [r for r in read_journal(journal) if r["rid"] == rid and r["terminal"] is not None]
    assert len(terminal) == 1, terminal
    record = terminal[0]
    assert record["terminal"] == "failed" and record["status"] == 503
    assert record["error"]["code"] == "router_resources_exhausted"
    assert [leg["outcome"] for leg in record["legs"]] == ["local_error", "local_error"]

    # The fillers beyond the limit waited in the backlog while accepting them failed for want of descriptors.
    failed = [e for e in server.events() if e.get("event") == "accept_failed"]
    assert failed and all(e["shortage"] is True and "Too many open files" in e["error"] for e in failed), failed
    gaps = [later["ts"] - earlier["ts"] for earlier, later in zip(failed, failed[1:])]
    assert all(gap >= ACCEPT_RETRY_S * 0.9 for gap in gaps), gaps  # one line, then a pause
