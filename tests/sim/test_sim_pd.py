"""The PD protocol (docs/simulator.md) between two real engines, and KV ownership (held → pulled/released/expired)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal_sim.testing import SimProcess, SimThread

from ..helpers import MODEL, PREFILL_KV_REQUEST
from .helpers import PROMPT, connect, decode_body, json_request, prefill_body, run_prefill


@pytest.fixture
def pair() -> Iterator[tuple[SimThread, SimThread]]:
    with SimThread("prefill", speed=50, lease_s=30) as p, SimThread("decode", speed=50) as d:
        yield p, d


def send_and_close(port: int, payload: dict[str, Any], rid: str) -> None:
    """Send a whole decode request and close at once, as a router's decode_abort release does."""
    sock = connect(port)
    sock.sendall(json_request("/v1/completions", payload, {"X-Request-Id": rid}))
    sock.close()


def test_prefill_answers_kv_transfer_params(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    p, _ = pair
    answer = client.post(p.url + "/v1/completions", json=prefill_body(), headers={"X-Request-Id": "abc-p1"})
    assert answer.status_code == 200
    body = answer.json()
    assert body["usage"]["completion_tokens"] == 1
    assert len(body["choices"][0]["text"].split()) == 1
    kv = body["kv_transfer_params"]
    assert list(kv) == [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "transfer_mode",
    ]  # the default family: current vLLM (docs/simulator.md, "vLLM versions")
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_engine_id"] == p.engine_id
    assert re.fullmatch(r"cmpl-abc-p1-0-[0-9a-f]{8}", kv["remote_request_id"])
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == p.port  # SimThread advertises its listen host
    assert kv["tp_size"] == 1 and kv["dcp_size"] == 1 and kv["pp_size"] == 1
    assert kv["remote_num_tokens"] == 50 and kv["remote_blocks_expiry_time"] is None and kv["transfer_mode"] == "pull"
    assert len(kv["remote_block_ids"]) == 1 and len(kv["remote_block_ids"][0]) == 4  # one group, 50 tokens / 16
    stats = p.stats()
    assert stats["kv_held"] == 1 and stats["kv_held_blocks"] == 4 and stats["kv_held_total"] == 1
    assert stats["free_blocks"] == stats["total_blocks"] - 4
    (record,) = p.requests("/v1/completions")
    assert record["kv"] == {"role": "prefill", "owner": kv["remote_request_id"], "blocks": 4, "outcome": "held"}


def test_streaming_prefill_is_refused(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    p, _ = pair
    answer = client.post(p.url + "/v1/completions", json=prefill_body(stream=True))
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "stream"
    assert p.stats()["kv_held_total"] == 0


def test_two_engine_exchange(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    p, d = pair
    first = client.post(p.url + "/v1/completions", json=prefill_body(), headers={"X-Request-Id": "r-p1"}).json()
    kv = first["kv_transfer_params"]
    answer = client.post(d.url + "/v1/completions", json=decode_body(kv), headers={"X-Request-Id": "r-d1"})
    assert answer.status_code == 200
    body = answer.json()
    assert body["kv_transfer_params"] is None
    # The decode engine counts every pulled prompt token as cached (the router corrects this).
    assert body["usage"] == {
        "prompt_tokens": 50,
        "total_tokens": 56,
        "completion_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 50},
    }
    assert body["choices"][0]["text"].startswith(first["choices"][0]["text"])

    ps, ds = p.stats(), d.stats()
    assert (ps["kv_held_total"], ps["kv_pulled"], ps["kv_released"], ps["kv_expired"]) == (1, 1, 0, 0)
    assert ps["kv_held"] == 0 and ps["kv_pulled_blocks"] == 4 and ps["free_blocks"] == ps["total_blocks"]
    assert (ds["kv_pulls"], ds["kv_pull_failures"], ds["recomputed"], ds["kv_releases_sent"]) == (1, 0, 0, 0)
    assert ds["free_blocks"] == ds["total_blocks"]
    # The pull went to the prefill engine's own listener, at the internal endpoint.
    (pull,) = p.requests("/kv/pull")
    assert pull["status"] == 200 and kv["remote_request_id"] in pull["body"]
    assert p.requests("/v1/completions")[0]["kv"]["outcome"] == "pulled"
    assert d.requests("/v1/completions")[0]["kv"] == {
        "role": "decode",
        "owner": kv["remote_request_id"],
        "outcome": "pulled",
        "blocks": 4,
    }


def test_pd_stream(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    p, d = pair
    kv = run_prefill(client, p.url, "s-p1")
    body = decode_body(kv, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", d.url + "/v1/completions", json=body) as r:
        text = r.read().decode()
    assert text.endswith("data: [DONE]\n\n")
    assert text.count("data: ") == 6 + 2
    assert '"cached_tokens":50' in text
    assert p.stats()["kv_pulled"] == 1


def test_decode_without_kv_recomputes(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    _, d = pair
    answer = client.post(d.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stats = d.stats()
    assert stats["recomputed"] == 1 and stats["kv_pulls"] == 0 and stats["prompt_tokens"] == 50


def test_recompute_is_slower_than_pull() -> None:
    long_prompt = "y" * 4 * 16_000  # 16,000 tokens: prefill 2 chunks, 14 + 1280 ms; pull 2 + 50 ms + a step
    with SimThread("prefill", speed=10) as p, SimThread("decode", speed=10, kv_pull_grace_ms=0) as d, \
            httpx.Client(timeout=10) as client:  # fmt: skip
        kv = run_prefill(client, p.url, "slow-p1", long_prompt)
        client.post(d.url + "/v1/completions", json=decode_body(kv, long_prompt, max_tokens=1))
        pulled = d.stats()
        started = time.perf_counter()
        # Another prompt: the decode engine caches the blocks it pulled, as vLLM does.
        other_prompt = "w" * 4 * 16_000
        client.post(d.url + "/v1/completions", json={"prompt": other_prompt, "max_tokens": 1})
        recomputed = time.perf_counter() - started
        after = d.stats()
    # The pulled leg prefilled nothing; the recomputed one paid the whole prompt
    # (a lower bound on wall time: sleeps never end early, whatever the load).
    assert pulled["kv_pulls"] == 1 and pulled["prompt_tokens"] == 0
    assert after["recomputed"] == 1 and after["prompt_tokens"] == 16_000
    assert recomputed > 0.129


def test_abort_releases_and_is_idempotent(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    p, _ = pair
    kv = run_prefill(client, p.url, "ab-p1")
    owner = kv["remote_request_id"]
    answer = client.post(p.url + "/abort_request", json={"request_id": owner})
    assert answer.status_code == 200 and answer.json() == {"request_id": owner, "released": True, "num_blocks": 4}
    again = client.post(p.url + "/abort_request", json={"request_id": owner})
    assert again.status_code == 200 and again.json()["released"] is False
    unknown = client.post(p.url + "/abort_request", json={"request_id": "never-held"})
    assert unknown.status_code == 200 and unknown.json()["released"] is False
    stats = p.stats()
    assert (stats["kv_held"], stats["kv_released"], stats["kv_released_blocks"]) == (0, 1, 4)
    assert stats["free_blocks"] == stats["total_blocks"]
    bad = client.post(p.url + "/abort_request", json={"id": owner})  # neither request_id nor SGLang's rid
    assert bad.status_code == 400 and "error" in bad.json()


def test_lease_expiry_counts_expired() -> None:
    with SimThread("prefill", speed=50, lease_s=0.3) as p, httpx.Client(timeout=10) as client:
        kv = run_prefill(client, p.url, "lease-p1")
        assert p.stats()["kv_held"] == 1
        stats = p.wait_for(lambda s: s["kv_expired"] == 1, timeout=5)
        assert (stats["kv_held"], stats["kv_pulled"], stats["kv_released"]) == (0, 0, 0)
        assert stats["kv_expired_blocks"] == 4 and stats["free_blocks"] == stats["total_blocks"]
        assert p.requests("/v1/completions")[0]["kv"]["outcome"] == "expired"
        # An expired owner can no longer be released or pulled.
        assert client.post(p.url + "/abort_request", json={"request_id": kv["remote_request_id"]}).json()[
            "released"
        ] is False


def test_aborted_decode_releases_on_prefill(client: httpx.Client) -> None:
    # A generous grace: this thread must get the GIL (and a CPU) back to close its socket.
    with SimThread("prefill", speed=50) as p, SimThread("decode", speed=50, kv_pull_grace_ms=200) as d:
        check_aborted_decodes(client, p, d)


def test_aborted_decode_in_another_process_releases(client: httpx.Client) -> None:
    with SimThread("prefill", speed=50) as p, SimProcess("decode", speed=50) as d:
        check_aborted_decodes(client, p, d)


def check_aborted_decodes(client: httpx.Client, p: SimThread, d: SimThread | SimProcess) -> None:
    for i in range(5):
        kv = run_prefill(client, p.url, f"da-p{i}")
        send_and_close(d.port, decode_body(kv), f"da-d{i}")
    stats = p.wait_for(lambda s: s["kv_held"] == 0, timeout=5)
    assert (stats["kv_released"], stats["kv_pulled"], stats["kv_expired"]) == (5, 0, 0)
    ds = d.wait_for(lambda s: s["kv_releases_sent"] == 5, timeout=5)
    assert ds["kv_pulls"] == 0 and ds["client_gone"] == 5
    assert {r["kv"]["outcome"] for r in d.requests("/v1/completions")} == {"released"}


def test_aborted_decode_while_queued_releases() -> None:
    with SimThread("prefill", speed=50) as p, SimThread("decode", speed=50, max_num_seqs=1) as d, \
            httpx.Client(timeout=10) as client:  # fmt: skip
        d.set_faults(stall_after_chunks=0)  # occupy the only sequence slot
        blocker = connect(d.port)
        blocker.sendall(json_request("/v1/completions", {"prompt": "busy"}))
        d.wait_for(lambda s: s["running"] == 1)
        d.set_faults()
        kv = run_prefill(client, p.url, "q-p1")
        sock = connect(d.port)
        sock.sendall(json_request("/v1/completions", decode_body(kv)))
        d.wait_for(lambda s: s["waiting"] == 1)
        sock.close()
        assert p.wait_for(lambda s: s["kv_released"] == 1)["kv_pulled"] == 0
        blocker.close()
        d.wait_for(lambda s: s["running"] == 0 and s["waiting"] == 0)


def test_pull_of_released_kv_fails_and_recomputes(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    p, d = pair
    kv = run_prefill(client, p.url, "gone-p1")
    client.post(p.url + "/abort_request", json={"request_id": kv["remote_request_id"]})
    answer = client.post(d.url + "/v1/completions", json=decode_body(kv))
    assert answer.status_code == 200
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stats = d.stats()
    assert (stats["kv_pull_failures"], stats["recomputed"], stats["kv_pulls"]) == (1, 1, 0)
    assert p.requests("/kv/pull")[0]["status"] == 404
    record = d.requests("/v1/completions")[0]
    assert record["kv"]["outcome"] == "pull_failed" and "404" in record["kv"]["error"]


def test_load_failure_policy_fail() -> None:
    with SimThread("decode", speed=50, kv_load_failure="fail") as d, httpx.Client(timeout=10) as client:
        kv = {**PREFILL_KV_REQUEST, "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "e",
              "remote_request_id": "nobody", "remote_block_ids": [1], "remote_host": "127.0.0.1",
              "remote_port": 1}  # fmt: skip
        answer = client.post(d.url + "/v1/completions", json=decode_body(kv))
        assert answer.status_code == 500 and answer.json()["error"]["code"] == 500
        assert d.stats()["kv_pull_failures"] == 1


def test_pull_checks_engine_blocks_and_prompt(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    p, d = pair
    kv = run_prefill(client, p.url, "m-p1")
    wrong_blocks = {**kv, "remote_block_ids": [9999]}
    client.post(d.url + "/v1/completions", json=decode_body(wrong_blocks))
    wrong_engine = {**kv, "remote_engine_id": "someone-else"}
    client.post(d.url + "/v1/completions", json=decode_body(wrong_engine))
    assert [r["status"] for r in p.requests("/kv/pull")] == [409, 409]
    assert p.stats()["kv_held"] == 1  # a refused pull leaves the KV with its owner
    client.post(d.url + "/v1/completions", json=decode_body(kv, prompt=PROMPT + " changed"))
    stats = d.stats()
    assert stats["kv_prompt_mismatch"] == 1 and stats["kv_pull_failures"] == 2 and stats["recomputed"] == 3
    assert p.stats()["kv_pulled"] == 1


def test_roles_refuse_the_other_leg(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    p, d = pair
    kv = run_prefill(client, p.url, "role-p1")
    refused = client.post(p.url + "/v1/completions", json=decode_body(kv))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
    refused = client.post(d.url + "/v1/completions", json=prefill_body())
    assert refused.status_code == 400
    # Plain requests are served by every role.
    assert client.post(p.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_mixed_engines_do_both_legs(client: httpx.Client) -> None:
    with SimThread("mixed", speed=50) as a, SimThread("mixed", speed=50) as b:
        kv = run_prefill(client, a.url, "mx-p1")
        answer = client.post(b.url + "/v1/completions", json=decode_body(kv))
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 50
        assert a.stats()["kv_pulled"] == 1 and b.stats()["kv_pulls"] == 1


def test_prefill_reports_prefix_cache_hits(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    p, _ = pair
    first = client.post(p.url + "/v1/completions", json=prefill_body()).json()
    second = client.post(p.url + "/v1/completions", json=prefill_body()).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert first["kv_transfer_params"]["remote_request_id"] != second["kv_transfer_params"]["remote_request_id"]


def test_leaked_kv_blocks_capacity_until_freed(client: httpx.Client) -> None:
    with SimThread("prefill", speed=50, num_gpu_blocks=8) as p:
        # Distinct prompts (4 blocks each): identical ones would share their cached blocks.
        prompts = [f"{i}".ljust(200, "c") for i in range(3)]
        owners = [run_prefill(client, p.url, f"cap-p{i}", prompts[i])["remote_request_id"] for i in range(2)]
        result: dict[str, httpx.Response] = {}
        third = threading.Thread(
            target=lambda: result.setdefault(
                "r", httpx.post(p.url + "/v1/completions", json=prefill_body(prompts[2]), timeout=10)
            )
        )
        third.start()
        p.wait_for(lambda s: s["waiting"] == 1)
        client.post(p.url + "/abort_request", json={"request_id": owners[0]})
        third.join(5)
        assert result["r"].status_code == 200
        assert p.stats()["kv_held"] == 2
        too_big = client.post(p.url + "/v1/completions", json=prefill_body("z" * 64 * 9))
        assert too_big.status_code == 400


def test_chat_pd_exchange(client: httpx.Client, pair: tuple[SimThread, SimThread]) -> None:
    p, d = pair
    messages = [{"role": "user", "content": PROMPT}]
    first = client.post(p.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 1, "kv_transfer_params": PREFILL_KV_REQUEST})  # fmt: skip
    kv = first.json()["kv_transfer_params"]
    assert first.json()["object"] == "chat.completion" and kv["do_remote_prefill"] is True
    answer = client.post(d.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 5, "kv_transfer_params": kv,
        "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    text = answer.text
    assert text.endswith("data: [DONE]\n\n") and "chat.completion.chunk" in text
    usage = [line for line in text.split("\n\n") if '"usage"' in line][0]
    assert '"cached_tokens":%d' % first.json()["usage"]["prompt_tokens"] in usage
    assert p.stats()["kv_pulled"] == 1 and d.stats()["kv_prompt_mismatch"] == 0
