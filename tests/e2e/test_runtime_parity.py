"""Runtime parity: the same scripted scenario journals the same records on trio and on asyncio.

One scenario — valid, invalid, streaming, unknown model, a decode engine that
fails every leg (so the router retries elsewhere), a client that leaves
mid-stream — runs once per runtime against a fresh simulated fleet. The two
journals must be identical once what legitimately differs between two runs is
masked: timestamps and durations, router IDs, engine URLs (replaced by their
role and position) and the engines' KV owner keys.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import httpx

from narwhal_sim.testing import SimThread

from ..harness import RouterThread, make_config
from ..helpers import read_journal, wait_for_terminals

_TIMES = {"ts", "received", "started", "duration_ms", "ttft_ms"}


def _scenario(router: RouterThread, journal: Path) -> int:
    """Drive the scenario; return how many completion requests it sent."""
    sent = 0
    with httpx.Client(base_url=router.url, timeout=10) as client:
        def post(path: str, body: dict[str, Any], rid: str, **kwargs: Any) -> httpx.Response:
            nonlocal sent
            sent += 1
            return client.post(path, json=body, headers={"x-request-id": rid}, **kwargs)

        answer = post("/v1/completions", {"prompt": "The narwhal is", "max_tokens": 4}, "c-plain")
        assert answer.status_code == 200, answer.text
        answer = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 3, "stream": True,
                                               "stream_options": {"include_usage": True}}, "c-stream")
        assert answer.status_code == 200 and "data: [DONE]" in answer.text
        assert post("/v1/completions", {"prompt": "x", "n": 2}, "c-n2").status_code == 400
        assert post("/v1/completions", {"prompt": "x", "model": "gpt-9"}, "c-model").status_code == 404
        assert post("/v1/chat/completions", {"messages": "hi"}, "c-type").status_code == 400
        answer = post("/v1/completions", {"prompt": "A tusk", "max_tokens": 2, "kv_transfer_params": {}},
                      "c-stripped")
        assert answer.status_code == 200, answer.text
    # A client that leaves while its stream is running (the decode engine is slow
    # enough to still be sending).
    sent += 1
    raw = json.dumps({"prompt": "Leaving early", "max_tokens": 400, "stream": True}).encode()
    with socket.create_connection(router.address, timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-request-id: c-gone\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    wait_for_terminals(journal, sent)
    router.wait_idle()
    return sent


def _masked(records: list[dict[str, Any]], urls: dict[str, str]) -> list[Any]:
    rids: dict[str, str] = {}

    def mask(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: mask(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [mask(v, key) for v in value]
        if key in _TIMES and value is not None:
            return "<time>"
        if key == "rid":
            return rids.setdefault(value, f"rid{len(rids)}")
        if key in ("backend_id", "release_id", "owner") and isinstance(value, str):
            match = re.fullmatch(r"(.+?)-([pd]\d+)(-.*)?", value)
            assert match, value
            return f"{rids.get(match.group(1), '?')}-{match.group(2)}" + ("-<suffix>" if match.group(3) else "")
        if key == "engine" and isinstance(value, str):
            return urls.get(value, value)
        return value

    return [mask(record) for record in records]


def _run(runtime: str, tmp_path: Path) -> tuple[str, list[Any]]:
    journal = tmp_path / f"journal-{runtime}.jsonl"
    with SimThread(role="prefill", speed=0) as prefill, \
            SimThread(role="decode", speed=0, faults={"error_rate": 1.0}) as failing, \
            SimThread(role="decode", speed=40) as decode:  # fmt: skip
        config = make_config(
            journal, prefill=(prefill.url,), decode=(failing.url, decode.url),
            engine={"kv_release": "abort_endpoint"},
            health={"probe_interval_s": 600.0, "unhealthy_after": 100},
        )
        with RouterThread(config, runtime) as router:
            _scenario(router, journal)
            library = router.loop_library
        urls = {prefill.url: "prefill0", failing.url: "decode0", decode.url: "decode1"}
        return str(library), _masked(read_journal(journal), urls)


def test_both_runtimes_journal_the_same_scenario_identically(tmp_path: Path) -> None:
    trio_library, on_trio = _run("trio", tmp_path)
    asyncio_library, on_asyncio = _run("asyncio", tmp_path)
    assert (trio_library, asyncio_library) == ("trio", "asyncio")
    assert len(on_trio) == 7 + 4  # seven terminal records, four admitted requests' progress records
    terminals = [r["terminal"] for r in on_trio if r["terminal"] is not None]
    assert terminals.count("completed") == 3 and terminals.count("invalid") == 3, terminals
    assert "cancelled" in terminals
    retried = [r for r in on_trio if r["terminal"] == "completed" and len(r["legs"]) > 2]
    assert retried, "the failing decode engine should have forced a retry"
    for trio_record, asyncio_record in zip(on_trio, on_asyncio, strict=True):
        assert trio_record == asyncio_record
