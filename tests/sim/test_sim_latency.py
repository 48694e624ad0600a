"""The latency model and the scheduler, observed from outside (coarse bounds; the calibration benchmark is exact)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from narwhal_sim.testing import SimThread

from .helpers import connect, json_request


def ttft(client: httpx.Client, url: str, prompt: str) -> float:
    """Seconds to the first streamed token."""
    started = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": 2, "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                return time.perf_counter() - started
    raise AssertionError("no token")


def test_speed_zero_never_sleeps(client: httpx.Client) -> None:
    with SimThread("mixed", speed=0) as sim:
        started = time.perf_counter()
        answer = client.post(sim.url + "/v1/completions", json={"prompt": "z" * 4 * 100_000, "max_tokens": 500})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 500
        # At speed 1 this is 8 s of prefill and 3.5 s of decode; at speed 0 only
        # CPU work (the bound is loose: a loaded machine must not fail it).
        assert time.perf_counter() - started < 3.0


def test_ttft_grows_with_prompt_and_shrinks_on_prefix_hits(client: httpx.Client) -> None:
    # Wall-clock checks are lower bounds only (a sleep never ends early; a loaded
    # machine can make anything slower): the model's figures are tested exactly
    # in test_sim_model.py, and the prefix hit is read from the counters.
    with SimThread("mixed", speed=20) as sim:
        long_prompt = "l" * 4 * 40_000
        long = ttft(client, sim.url, long_prompt)  # (15 + 3200) / 20 = 161 ms
        assert long >= 0.16
        before = sim.stats()["cached_tokens"]
        ttft(client, sim.url, long_prompt)  # 39,984 tokens hit: charged ~1 ms of prefill
        assert sim.stats()["cached_tokens"] - before >= 39_984


def test_itl_grows_with_the_running_batch() -> None:
    # Steps of 2 ms + 1 ms per decoding sequence: 3 ms per token alone, 22 ms with 20 running.
    with SimThread("mixed", speed=1, step_base_ms=2, decode_per_seq_ms=1,
                   prefill_per_token_ms=0) as sim, httpx.Client(timeout=30) as client:  # fmt: skip

        def run(_: int) -> float:
            started = time.perf_counter()
            client.post(sim.url + "/v1/completions", json={"prompt": "b", "max_tokens": 21})
            return time.perf_counter() - started

        alone = run(0)
        with ThreadPoolExecutor(20) as pool:
            together = sorted(pool.map(run, range(20)))
        # Sleeps follow deadlines, so the model's times are lower bounds; the upper bounds are loose.
        assert 0.06 <= alone < 2.0  # a 2 ms prefill step and 20 steps of 3 ms (a loose upper bound: load)
        assert together[10] > 0.3  # median of 20 concurrent: ~20 steps of ~21 ms (0.42 s)


def test_max_num_seqs_queues_the_rest() -> None:
    with SimThread("mixed", speed=50, max_num_seqs=2, faults={"stall_after_chunks": 0}) as sim:
        socks = [connect(sim.port) for _ in range(3)]
        for sock in socks:
            sock.sendall(json_request("/v1/completions", {"prompt": "hold"}))
        stats = sim.wait_for(lambda s: s["running"] == 2 and s["waiting"] == 1)
        assert stats["free_blocks"] == stats["total_blocks"] - 4  # 1 + 16 tokens: 2 blocks each
        socks[0].close()
        sim.wait_for(lambda s: s["running"] == 2 and s["waiting"] == 0)
        for sock in socks[1:]:
            sock.close()
        sim.wait_for(lambda s: s["running"] == 0 and s["free_blocks"] == s["total_blocks"])
