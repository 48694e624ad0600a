"""Engines reached, and the KV side channel host, over real sockets on both runtimes.

* ``/ready``: every engine is probed at start; until a prefill and a decode
  engine have answered, 503 naming what is missing; an engine that is not
  answering, or goes down, is logged with why (DNS failure, connection
  refused, HTTP status).
* ``remote_host`` (docs/configure.md, ``engine.kv_hosts``): the simulator
  names its KV side channel as ``--advertise-host`` says (vLLM:
  ``VLLM_NIXL_SIDE_CHANNEL_HOST``, ``localhost`` by default). Accepted:
  ``localhost`` for engines configured by a loopback address, an address
  the engines' configured name resolves to, an address inside a
  ``kv_hosts`` network; anything else fails the request with 502
  ``prefill_failed`` before any decode leg, logged once per value.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal_sim.testing import SimThread

from ..harness import Fleet, LogCapture, RouterThread, make_config
from ..helpers import COMPLETIONS, completion_records, free_port, journal_terminal, poll, rid_of
from .support import http


def events(log: LogCapture, name: str) -> list[dict[str, Any]]:
    return [e for e in log.events() if e.get("event") == name]


@pytest.fixture
def start(runtime: str, journal_path: Any) -> Iterator[Any]:
    routers: list[RouterThread] = []

    def run(prefill: tuple[str, ...], decode: tuple[str, ...], **sections: Any) -> RouterThread:
        router = RouterThread(make_config(journal_path, prefill=prefill, decode=decode, **sections), runtime).start()
        routers.append(router)
        return router

    yield run
    for router in routers:
        router.stop()


def complete(router: RouterThread) -> Any:
    return http.post(router.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 3}, timeout=10)


# ------------------------------------------------------------------ readiness


def test_ready_is_503_until_an_engine_of_each_phase_has_answered(start, fleet: Fleet, router_log) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router = start((dead,), fleet.decode_urls)
    answer = http.get(router.url + "/ready", timeout=10)
    assert answer.status_code == 503
    assert answer.json() == {"ready": False, "problems": ["no prefill engine has answered yet"]}
    (log,) = events(router_log, "engine_not_answering")
    assert (log["engine"], log["phase"], log["reason"], log["level"]) == (dead, "prefill", "connection refused",
                                                                          "warning")
    # The same fleet with its live prefill engine: ready once the first probes are back.
    other = start(fleet.prefill_urls, fleet.decode_urls)
    assert http.get(other.url + "/ready", timeout=10).json() == {"ready": True, "problems": []}


def test_a_typo_in_an_engine_host_is_a_dns_failure(start, fleet: Fleet, router_log) -> None:
    # (A resolver that must ask a slow DNS server still says so within the probe's time.)
    router = start(fleet.prefill_urls, ("http://decode-0.no-such-fleet.invalid:8200",),
                   health={"probe_timeout_s": 12.0})
    assert http.get(router.url + "/ready", timeout=10).json()["problems"] == ["no decode engine has answered yet"]
    (log,) = events(router_log, "engine_not_answering")
    assert log["engine"] == "http://decode-0.no-such-fleet.invalid:8200"
    assert log["reason"].startswith("DNS failure"), log


def test_engine_down_says_why(start, fleet: Fleet, router_log) -> None:
    decode = SimThread(role="decode", speed=0).start()
    try:
        router = start(fleet.prefill_urls, (decode.url,), health={"unhealthy_after": 2, "probe_interval_s": 0.05})
        assert http.get(router.url + "/ready", timeout=10).status_code == 200
    finally:
        decode.stop()
    poll(lambda: events(router_log, "engine_down"), timeout=10, what="engine_down")
    (down,) = events(router_log, "engine_down")
    assert (down["engine"], down["phase"], down["reason"]) == (decode.url, "decode", "connection refused")
    assert http.get(router.url + "/ready", timeout=10).json()["problems"] == ["no healthy decode engine"]


def test_engine_down_on_an_http_status_names_it(start, fleet: Fleet, router_log) -> None:
    router = start(fleet.prefill_urls, fleet.decode_urls,
                   health={"unhealthy_after": 1, "probe_interval_s": 0.05, "probe_path": "/no-such-health-route"})
    poll(lambda: len(events(router_log, "engine_down")) == 2, timeout=10, what="two engine_down lines")
    assert sorted(e["reason"] for e in events(router_log, "engine_down")) == ["HTTP 404", "HTTP 404"]
    assert http.get(router.url + "/ready", timeout=10).status_code == 503


# ------------------------------------------------------------------ remote_host


def decoded_remote_hosts(decode: SimThread) -> list[str]:
    return [json.loads(r["body"])["kv_transfer_params"]["remote_host"] for r in completion_records([decode])]


def test_localhost_names_an_engine_configured_by_a_loopback_address(start, sims, journal_path) -> None:
    # vLLM's default VLLM_NIXL_SIDE_CHANNEL_HOST is "localhost".
    prefill, decode = sims("prefill", advertise_host="localhost"), sims("decode")
    assert prefill.url.startswith("http://127.0.0.1:")
    router = start((prefill.url,), (decode.url,))
    for _ in range(2):
        answer = complete(router)
        assert answer.status_code == 200, answer.text
        assert journal_terminal(journal_path, rid_of(answer))["terminal"] == "completed"
    assert decoded_remote_hosts(decode) == ["localhost", "localhost"]


def test_an_address_the_engine_name_resolves_to_names_that_engine(start, sims, journal_path) -> None:
    # Engines configured by name; the side channel named by address (a pod IP in Kubernetes).
    prefill, decode = sims("prefill", advertise_host="127.0.0.1"), sims("decode")
    named = f"http://localhost:{prefill.port}"
    router = start((named,), (f"http://localhost:{decode.port}",))
    # The adapter resolved the prefill engine's name at its first probe and told the core.
    engine = router.call(lambda: router.server.serving.router.fleet.engines["prefill"][0])
    assert "127.0.0.1" in engine.addresses
    answer = complete(router)
    assert answer.status_code == 200, answer.text
    assert journal_terminal(journal_path, rid_of(answer))["terminal"] == "completed"
    assert decoded_remote_hosts(decode) == ["127.0.0.1"]


def test_an_address_inside_a_kv_hosts_network_is_accepted(start, sims, journal_path, router_log) -> None:
    # 0.0.0.0 is not a loopback spelling, so only the network can allow it;
    # connecting to it reaches this machine (Linux, macOS), so the decode
    # engine's KV pull from it really works.
    prefill, decode = sims("prefill", advertise_host="0.0.0.0"), sims("decode")
    refusing = start((prefill.url,), (decode.url,), retry={"max_attempts": 1})
    answer = complete(refusing)
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "prefill_failed"
    assert completion_records([decode]) == []
    refusing.stop()
    router = start((prefill.url,), (decode.url,), engine={"kv_hosts": ["0.0.0.0/8"]})
    answer = complete(router)
    assert answer.status_code == 200, answer.text
    assert journal_terminal(journal_path, rid_of(answer))["terminal"] == "completed"
    assert decoded_remote_hosts(decode) == ["0.0.0.0"]


def test_any_other_remote_host_is_refused_and_logged_once(start, sims, journal_path, router_log) -> None:
    prefill, decode = sims("prefill", advertise_host="203.0.113.9"), sims("decode")
    router = start((prefill.url,), (decode.url,), retry={"max_attempts": 1}, health={"unhealthy_after": 10})
    for _ in range(3):
        answer = complete(router)
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert error["code"] == "prefill_failed" and "not an engine of this fleet" in error["message"]
        record = journal_terminal(journal_path, rid_of(answer))
        assert record["terminal"] == "failed" and [leg["phase"] for leg in record["legs"]] == ["prefill"]
    assert completion_records([decode]) == []
    (log,) = events(router_log, "kv_host_refused")
    assert log["remote_host"] == "203.0.113.9" and "engine.kv_hosts" in log["fix"]
