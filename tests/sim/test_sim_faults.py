"""Fault injection: by settings at start and through POST /sim/faults, deterministic under the seed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from narwhal_sim.model import fault_draw
from narwhal_sim.testing import SimThread

from .helpers import connect, is_closed, json_request, prefill_body, read_until_closed, sse_values

STREAM = {"prompt": "stream me", "max_tokens": 6, "stream": True}


@pytest.fixture
def sim() -> Iterator[SimThread]:
    with SimThread("mixed", speed=0, seed=3) as s:
        yield s


def complete(client: httpx.Client, sim: SimThread, rid: str = "f-1", **body: object) -> httpx.Response:
    return client.post(sim.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **body},
                       headers={"X-Request-Id": rid})  # fmt: skip


def test_error_rate_and_status(client: httpx.Client, sim: SimThread) -> None:
    sim.set_faults(error_rate=1.0)
    answer = complete(client, sim)
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] == "ServiceUnavailableError"
    sim.set_faults(error_rate=1.0, error_status=429)
    assert complete(client, sim).status_code == 429
    assert sim.stats()["faults_error"] == 2
    # Faults apply to completion routes only.
    for path in ("/health", "/v1/models", "/metrics"):
        assert client.get(sim.url + path).status_code == 200


def test_faults_set_at_start() -> None:
    with SimThread("mixed", speed=0, faults={"error_rate": 1.0, "error_status": 500}) as s:
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "x"}).status_code == 500


def test_drop_closes_without_answer(sim: SimThread) -> None:
    sim.set_faults(drop_rate=1.0)
    with connect(sim.port) as sock:
        sock.sendall(json_request("/v1/completions", {"prompt": "x"}))
        assert read_until_closed(sock) == b""
    assert sim.stats()["faults_drop"] == 1
    assert sim.requests("/v1/completions")[0]["outcome"] == "dropped"


def test_delay(client: httpx.Client, sim: SimThread) -> None:
    sim.set_faults(delay_s=0.3)
    started = time.perf_counter()
    assert complete(client, sim).status_code == 200
    assert time.perf_counter() - started >= 0.29
    assert sim.stats()["faults_delay"] == 1


def test_stall_after_chunks_keeps_connection_open(sim: SimThread) -> None:
    sim.set_faults(stall_after_chunks=2)
    with connect(sim.port) as sock:
        sock.sendall(json_request("/v1/completions", STREAM))
        data = b""
        sock.settimeout(5)
        while data.count(b"data: ") < 2:
            data += sock.recv(65536)
        assert not is_closed(sock, within=0.3)  # nothing more, but still open
        assert data.count(b"data: ") == 2 and b"[DONE]" not in data
        assert sim.stats()["running"] == 1
    stats = sim.wait_for(lambda s: s["running"] == 0)
    assert stats["faults_stall"] == 1


def test_drop_after_chunks_truncates_stream(sim: SimThread) -> None:
    sim.set_faults(drop_after_chunks=3)
    with connect(sim.port) as sock:
        sock.sendall(json_request("/v1/completions", STREAM))
        data = read_until_closed(sock)
    assert data.count(b"data: ") == 3 and not data.endswith(b"0\r\n\r\n")
    sim.set_faults(drop_after_chunks=0)
    with connect(sim.port) as sock:
        sock.sendall(json_request("/v1/completions", {"prompt": "x"}))
        assert read_until_closed(sock) == b""  # a non-streaming answer is one chunk
    assert sim.stats()["faults_drop_after_chunks"] == 2


def test_omitted_kv_params(client: httpx.Client) -> None:
    with SimThread("prefill", speed=0, faults={"omit_kv_params_rate": 1.0}) as p:
        answer = client.post(p.url + "/v1/completions", json=prefill_body())
        assert answer.status_code == 200 and answer.json()["kv_transfer_params"] is None
        stats = p.stats()
        assert stats["faults_omit_kv_params"] == 1 and stats["kv_held_total"] == 0
        assert stats["free_blocks"] == stats["total_blocks"]


def test_malformed_json(client: httpx.Client, sim: SimThread) -> None:
    sim.set_faults(malformed_json_rate=1.0)
    answer = complete(client, sim)
    assert answer.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(answer.content)
    with client.stream("POST", sim.url + "/v1/completions", json=STREAM) as r:
        text = r.read().decode()
    with pytest.raises(json.JSONDecodeError):
        sse_values(text)
    assert sim.stats()["faults_malformed_json"] == 2


def test_unhealthy(client: httpx.Client, sim: SimThread) -> None:
    sim.set_faults(unhealthy=True)
    assert client.get(sim.url + "/health").status_code == 503
    assert complete(client, sim).status_code == 200
    sim.set_faults()
    assert client.get(sim.url + "/health").status_code == 200


def test_decisions_depend_on_seed_and_request_id_only(client: httpx.Client, sim: SimThread) -> None:
    rids = [f"det-{i}" for i in range(40)]
    sim.set_faults(error_rate=0.5)
    failed = [complete(client, sim, rid).status_code == 503 for rid in rids]
    assert failed == [fault_draw(3, rid, "error") < 0.5 for rid in rids]
    assert 5 < sum(failed) < 35
    with SimThread("mixed", speed=0, seed=3, faults={"error_rate": 0.5}) as twin:
        assert [complete(client, twin, rid).status_code == 503 for rid in reversed(rids)] == failed[::-1]


def test_control_endpoint_replaces_settings(client: httpx.Client, sim: SimThread) -> None:
    answer = client.post(sim.url + "/sim/faults", json={"error_rate": 1.0, "delay_s": 0.01})
    assert answer.status_code == 200 and answer.json()["error_rate"] == 1.0
    assert client.get(sim.url + "/sim/faults").json()["delay_s"] == 0.01
    client.post(sim.url + "/sim/faults", json={"unhealthy": False})
    current = client.get(sim.url + "/sim/faults").json()
    assert current["error_rate"] == 0.0 and current["delay_s"] == 0.0
    bad = client.post(sim.url + "/sim/faults", json={"error_rate": "high"})
    assert bad.status_code == 400 and "error_rate" in bad.json()["error"]["message"]
    assert client.post(sim.url + "/sim/faults", json={"typo": 1}).status_code == 400
    assert client.post(sim.url + "/sim/faults", content=b"nope").status_code == 400
    assert set(sim.faults()) == {
        "error_rate", "error_status", "drop_rate", "delay_s", "delay_rate", "stall_after_chunks", "stall_rate",
        "drop_after_chunks", "drop_after_chunks_rate", "omit_kv_params_rate", "malformed_json_rate", "eos_rate", "pull_fail_rate",
        "push_reg_lost_rate", "unhealthy",
        "reasoning_only",
    }  # fmt: skip
