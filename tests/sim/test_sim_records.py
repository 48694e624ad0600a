"""What the engine records (in memory and as JSON lines), its counters and its /metrics."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from narwhal_sim.testing import SimThread

from .helpers import PROMPT, connect, http_request, prefill_body, reader, run_prefill


def test_records_keep_requests_as_received(client: httpx.Client) -> None:
    with SimThread("mixed", speed=0) as sim:
        body = b'{"prompt": "r\xc3\xa9cord", "max_tokens": 1}'
        with connect(sim.port) as sock:
            sock.sendall(http_request("POST", "/v1/completions?x=1", body,
                                      {"X-Request-Id": "rec-1", "X-Custom": "Mixed Case", "x-custom": "dup"}))  # fmt: skip
            reader(sock).read()
        client.get(sim.url + "/sim/stats")  # control routes are not recorded
        (record,) = sim.requests()
        assert record["method"] == "POST" and record["path"] == "/v1/completions?x=1"
        assert record["headers"] == [
            ["Host", "sim"],
            ["X-Request-Id", "rec-1"],
            ["X-Custom", "Mixed Case"],
            ["x-custom", "dup"],
            ["Content-Length", str(len(body))],
        ]
        assert record["body"] == body.decode()
        assert record["request_id"] == "rec-1" and record["status"] == 200 and record["outcome"] == "ok"
        assert record["kv"] is None and record["duration_ms"] >= 0
        assert client.get(sim.url + "/sim/requests").json() == sim.requests()


def test_record_ring_is_bounded_and_reset_clears(client: httpx.Client) -> None:
    with SimThread("prefill", speed=0, record_limit=5) as sim:
        for i in range(8):
            client.get(sim.url + "/health", headers={"X-Request-Id": f"h{i}"})
        assert [r["request_id"] for r in sim.requests()] == [f"h{i}" for i in range(3, 8)]
        run_prefill(client, sim.url, "keep-p1")
        sim.reset()
        stats = sim.stats()
        assert sim.requests() == [] and stats["requests"] == 0 and stats["kv_held_total"] == 0
        assert stats["kv_held"] == 1  # reset forgets counters, not owned KV
        assert client.post(sim.url + "/sim/reset").json() == {"reset": True}


def test_json_log_lines(tmp_path: Path, client: httpx.Client) -> None:
    log = tmp_path / "sim.jsonl"
    with SimThread("prefill", speed=50, lease_s=0.2, log=str(log)) as p, \
            SimThread("decode", speed=50) as d:  # fmt: skip
        kv = run_prefill(client, p.url, "log-p1")
        client.post(d.url + "/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv})
        run_prefill(client, p.url, "log-p2")
        p.wait_for(lambda s: s["kv_expired"] == 1)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    # (the decode engine renews the lease while its request waits: heartbeats are recorded too)
    requests = [e for e in lines if e["event"] == "request" and e["path"] != "/kv/heartbeat"]
    kv_events = [e for e in lines if e["event"] == "kv"]
    assert [(e["path"], e["status"]) for e in requests] == [("/v1/completions", 200), ("/kv/pull", 200),
                                                              ("/v1/completions", 200)]  # fmt: skip
    assert requests[0]["request_id"] == "log-p1" and requests[0]["kv"]["outcome"] == "held"
    assert [(e["request_id"], e["outcome"]) for e in kv_events] == [("log-p1", "pulled"), ("log-p2", "expired")]
    assert all(e["engine_id"] == lines[0]["engine_id"] for e in lines)


def sample(text: str, series: str) -> float:
    """The value of one series in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {series} in:\n{text}")


def test_metrics_exposition(client: httpx.Client) -> None:
    with SimThread("prefill", speed=0) as sim:
        client.post(sim.url + "/v1/completions", json=prefill_body())
        answer = client.get(sim.url + "/metrics")
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = answer.text
        assert '# TYPE vllm:num_requests_running gauge' in text
        # vLLM's labels: engine and model_name (prometheus_client writes them sorted).
        assert 'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0' in text
        assert 'narwhal_sim_kv_owners_total{outcome="held"} 1' in text
        assert "narwhal_sim_kv_held_blocks 4" in text
        label = '{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"}'
        assert "# TYPE vllm:prefix_cache_queries_total counter" in text
        assert f"vllm:prefix_cache_queries_total{label} 50" in text  # the prompt's 50 tokens
        assert f"vllm:prefix_cache_hits_total{label} 0" in text
        assert sample(text, "vllm:kv_cache_usage_perc" + label) == pytest.approx(4 / 28_000)  # the held blocks
        assert f"vllm:num_requests_waiting{label} 0" in text
        client.post(sim.url + "/v1/completions", json=prefill_body())  # its 3 full blocks hit
        text = client.get(sim.url + "/metrics").text
        assert f"vllm:prefix_cache_queries_total{label} 100" in text
        assert f"vllm:prefix_cache_hits_total{label} 48" in text
        assert sample(text, "vllm:kv_cache_usage_perc" + label) == pytest.approx(5 / 28_000)  # 3 shared + 1 + 1
        assert 'narwhal_sim_faults_total{fault="error"} 0' in text


def test_reset_zeroes_the_prefix_cache_counters_but_keeps_the_cache(client: httpx.Client) -> None:
    with SimThread("mixed", speed=0) as sim:
        prompt = "r" * 200  # 50 tokens, 3 full blocks
        client.post(sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert sim.stats()["prefix_cache_queries"] == 50
        sim.reset()
        assert sim.stats()["prefix_cache_queries"] == 0
        client.post(sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        stats = sim.stats()
        assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (50, 48)
