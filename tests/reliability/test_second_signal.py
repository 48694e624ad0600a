"""A second SIGINT (or SIGTERM) while ``narwhal serve`` drains: it stops now, cleanly.

The router runs as a real process on both runtimes in front of a decode
engine slow enough that the requests in flight would run for seconds. After
the first signal it keeps accepting connections until the drain ends, each
new request answered 503 ``shutting_down`` (journal ``rejected``). The second
signal cuts the drain short: every request still running gets 503
``shutting_down`` (a stream its final error event) and a ``failed`` terminal
record that blames no engine, and the process exits 128 + the signal's
number (130 for Ctrl-C) with no traceback.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from ..helpers import CHAT, COMPLETIONS, assert_envelope, only_terminals
from .support import ServeProcess, StreamClient, assert_error_stream, assert_failed, body, write_config

#: At speed 1 a token takes ~7 ms: 2,000 tokens keep a leg busy far longer than the test.
TOKENS = 2000


def _post(url: str, results: dict[str, Any]) -> None:
    try:
        results["answer"] = httpx.post(url + COMPLETIONS, json=body(max_tokens=TOKENS), timeout=30)
    except Exception as exc:  # reported by the test
        results["answer"] = exc


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_second_signal_cancels_the_drain_at_once(runtime, sims, tmp_path, signum) -> None:
    prefill = sims("prefill")
    decode = sims("decode", speed=1.0)
    journal = tmp_path / "journal.jsonl"
    config = write_config(tmp_path / "narwhal.toml", journal, prefill=[prefill.url], decode=[decode.url],
                          shutdown={"grace_s": 60.0})
    server = ServeProcess(config, runtime).start(listening_timeout=20)
    streams: list[StreamClient] = []
    results: dict[str, Any] = {}
    whole = threading.Thread(target=_post, args=(server.url, results), daemon=True)
    try:
        for route in (COMPLETIONS, CHAT):
            streams.append(StreamClient(server, route, max_tokens=TOKENS, timeout=30))  # type: ignore[arg-type]
        for stream in streams:
            assert stream.status == 200
            stream.read_events(1)
        whole.start()
        decode.wait_for(lambda s: s["running"] >= 3, timeout=15)

        os.kill(server.pid, signum)
        draining = server.wait_for_event("draining")
        assert draining["requests"] == 3, draining
        # A new connection while draining: answered, not refused.
        late = httpx.post(server.url + COMPLETIONS, json=body(), timeout=10)
        assert_envelope(late, 503, type="server_error", code="shutting_down", retry_after=True)
        assert late.headers["connection"] == "close"
        assert server.proc is not None and server.proc.poll() is None  # still draining

        signalled = time.monotonic()
        os.kill(server.pid, signum)
        code = server.wait(15)
        elapsed = time.monotonic() - signalled
        texts = [stream.read_all() for stream in streams]
        rids = [stream.rid for stream in streams]
        whole.join(15)
    finally:
        for stream in streams:
            stream.close()
        server.kill()

    stderr = server.stderr_text()
    assert code == 128 + signum, (code, stderr)
    assert elapsed < 5, elapsed  # not the 60 s grace period
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    signals = [e for e in server.events() if e.get("event") == "signal"]
    assert [e["signal"] for e in signals] == [signal.Signals(signum).name] * 2, signals
    assert "stopped" in {e.get("event") for e in server.events()}

    for text in texts:
        chunks, error = assert_error_stream(text)
        assert chunks and error["code"] == "shutting_down", error
    answer = results["answer"]
    assert isinstance(answer, httpx.Response), answer
    assert_envelope(answer, 503, type="server_error", code="shutting_down")
    rids.append(answer.headers["x-request-id"])

    records = only_terminals(journal, 4)
    assert records[late.headers["x-request-id"]]["terminal"] == "rejected"
    for rid in rids:
        record = records[rid]
        # The router stopped them: no engine is blamed, every leg it ran was cancelled or done.
        assert_failed(record, code="shutting_down", leg=None, engine=None,
                      status=200 if rid != answer.headers["x-request-id"] else 503)
        assert [leg["outcome"] for leg in record["legs"]] == ["ok", "cancelled"], record["legs"]
    assert prefill.stats()["kv_held"] == 0
