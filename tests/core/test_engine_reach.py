"""Engines reached, and the KV side channel host (docs/operate.md "Engines in rotation", docs/configure.md).

* Readiness: every engine is probed at start; ``/ready`` answers 503 until
  one prefill engine (when the fleet has any) and one decode engine have
  answered; an engine that goes down is logged with the reason.
* ``remote_host``: a prefill answer may name its KV side channel by a
  prefill engine's host, a loopback name or address when that host is
  loopback (they are one host), an address the engine's name resolved to
  (fed by the adapter as ``EngineResolved``), or a ``kv_hosts`` host or
  network. Anything else fails the prefill leg, and each refused value is
  logged once, with the fix.
"""

from __future__ import annotations

from typing import Any

import pytest

from narwhal_core import ConfigError, config_from_dict
from narwhal_core.config import EngineConfig, is_loopback_host
from narwhal_core.events import EngineResolved
from narwhal_core.fleet import Fleet

from .router_driver import (
    COMPLETIONS,
    DECODE_URLS,
    PREFILL_URLS,
    Driver,
    completion_body,
)


def ready(d: Driver) -> tuple[int, list[str]]:
    client = d.connect()
    client.request("GET", "/ready")
    return client.last.status, client.last.json()["problems"]


def answer_probes(d: Driver, urls: tuple[str, ...], *, status: int | None = 200, error: str | None = None) -> None:
    for control in d.pending_controls("probe"):
        if control.cmd.engine.url in urls:
            d.complete_control(control.cmd.key, status=status, error=error)


# ------------------------------------------------------------------ readiness


def test_every_engine_is_probed_at_start_and_ready_waits_for_one_answer_per_phase() -> None:
    d = Driver(auto_probe=None)
    # At start, before any time has passed: one probe per engine.
    probes = d.pending_controls("probe")
    assert sorted(c.cmd.engine.url for c in probes) == sorted(PREFILL_URLS + DECODE_URLS)
    assert all(c.step == 0 for c in probes)
    assert not d.router.statistics().engines_probed
    assert ready(d) == (503, ["no prefill engine has answered yet", "no decode engine has answered yet"])
    answer_probes(d, PREFILL_URLS[:1])
    assert ready(d) == (503, ["no decode engine has answered yet"])
    answer_probes(d, DECODE_URLS[1:])
    assert ready(d) == (200, [])
    assert d.router.statistics().ready
    # The others' first probes fail: still ready (one of each phase answered).
    answer_probes(d, (PREFILL_URLS[1], DECODE_URLS[0]), status=None, error="connection refused")
    assert d.router.statistics().engines_probed
    assert ready(d) == (200, [])


def test_a_failed_first_probe_is_logged_with_its_reason_and_not_ready() -> None:
    d = Driver(auto_probe=None, prefill=PREFILL_URLS[:1], decode=DECODE_URLS[:1])
    answer_probes(d, PREFILL_URLS, status=None, error="DNS failure: Name or service not known")
    answer_probes(d, DECODE_URLS, status=503)
    logs = [log for log in d.logs if log.event == "engine_not_answering"]
    assert [(log.fields["engine"], log.fields["phase"], log.fields["reason"]) for log in logs] == [
        (PREFILL_URLS[0], "prefill", "DNS failure: Name or service not known"),
        (DECODE_URLS[0], "decode", "HTTP 503"),
    ]
    assert d.router.statistics().engines_probed
    assert ready(d)[0] == 503
    # Logged once per engine: later failures are counted toward engine_down.
    d.advance(5)
    answer_probes(d, PREFILL_URLS, status=None, error="DNS failure: Name or service not known")
    assert [log.event for log in d.logs].count("engine_not_answering") == 2


@pytest.mark.parametrize(
    ("status", "error", "reason"),
    [(None, "connection refused", "connection refused"), (None, "timeout", "timeout"),
     (None, "DNS failure: Name or service not known", "DNS failure: Name or service not known"),
     (500, None, "HTTP 500"), (None, None, "no answer")],
)
def test_engine_down_says_why(status: int | None, error: str | None, reason: str) -> None:
    d = Driver(auto_probe=None, health={"unhealthy_after": 2, "probe_interval_s": 5.0})
    answer_probes(d, PREFILL_URLS + DECODE_URLS)
    assert ready(d)[0] == 200
    for _ in range(2):
        d.advance(5)
        answer_probes(d, PREFILL_URLS + DECODE_URLS[1:])
        answer_probes(d, DECODE_URLS[:1], status=status, error=error)
    down = [log for log in d.logs if log.event == "engine_down"]
    assert [(log.fields["engine"], log.fields["reason"], log.fields["failures"]) for log in down] == [
        (DECODE_URLS[0], reason, 2)
    ]


def test_engine_down_after_failed_legs_names_the_leg() -> None:
    d = Driver(health={"unhealthy_after": 1}, retry={"max_attempts": 1})
    client = d.post(COMPLETIONS, completion_body())
    d.fail_leg(d.leg("prefill").bid, "connect_failed")
    assert client.last.status == 503
    down = [log for log in d.logs if log.event == "engine_down"]
    assert len(down) == 1 and down[0].fields["reason"] == "prefill leg: connect_failed"


def test_a_successful_leg_counts_as_an_answer() -> None:
    # Probes that never come back (a slow health route) do not keep a router
    # that serves requests unready forever.
    d = Driver(auto_probe=None, prefill=(), decode=DECODE_URLS[:1])
    assert ready(d) == (503, ["no decode engine has answered yet"])
    client = d.post(COMPLETIONS, completion_body())
    d.answer_decode(d.leg("decode").bid)
    assert client.last.status == 200
    assert ready(d) == (200, [])


def test_single_leg_fleet_waits_for_a_decode_engine_only() -> None:
    d = Driver(auto_probe=None, prefill=(), decode=DECODE_URLS)
    assert ready(d) == (503, ["no decode engine has answered yet"])
    answer_probes(d, DECODE_URLS[:1])
    assert ready(d) == (200, [])


def test_only_prefill_engines_named_by_a_name_are_resolved() -> None:
    named = ("http://prefill-0.fleet.svc:8100", "http://10.0.0.2:8100", "http://[fd00::5]:8100")
    d = Driver(auto_probe=None, prefill=named, decode=("http://decode-0.fleet.svc:8200",))
    resolve = {c.cmd.engine.url: c.cmd.resolve for c in d.pending_controls("probe")}
    assert resolve == {
        "http://prefill-0.fleet.svc:8100": True, "http://10.0.0.2:8100": False, "http://[fd00::5]:8100": False,
        "http://decode-0.fleet.svc:8200": False,
    }
    # ... at every probe, not only the first.
    for control in d.pending_controls("probe"):
        d.complete_control(control.cmd.key, status=200)
    d.advance(d.config.health.probe_interval_s)
    later = {c.cmd.engine.url: c.cmd.resolve for c in d.pending_controls("probe")}
    assert later == resolve


# ------------------------------------------------------------------ remote_host: the configured rule


def engine_config(**values: Any) -> EngineConfig:
    return EngineConfig(**{"decode": ("http://10.0.1.1:8200",), **values})


@pytest.mark.parametrize("prefill", ["http://127.0.0.1:8100", "http://localhost:8100", "http://[::1]:8100",
                                     "http://127.0.0.9:8100"])
@pytest.mark.parametrize("host", ["localhost", "LOCALHOST", "localhost.", "127.0.0.1", "127.0.0.2",
                                  "127.255.255.254", "::1", "[::1]", "0:0:0:0:0:0:0:1"])
def test_loopback_names_and_addresses_are_one_host(prefill: str, host: str) -> None:
    assert engine_config(prefill=(prefill,)).kv_host_allowed(host)


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f.0.0.1", "127.0.0.01", "::ffff:127.0.0.1",
                                  "[127.0.0.1]", " 127.0.0.1", "localhost.evil.example", "0.0.0.0", "",
                                  "128.0.0.1", "10.0.0.1"])
def test_only_canonical_loopback_spellings_count(host: str) -> None:
    assert not engine_config(prefill=("http://127.0.0.1:8100",)).kv_host_allowed(host)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1"])
def test_loopback_is_not_allowed_when_no_prefill_engine_is_loopback(host: str) -> None:
    assert not engine_config(prefill=("http://10.0.0.1:8100",)).kv_host_allowed(host)
    # ... unless kv_hosts says so.
    assert engine_config(prefill=("http://10.0.0.1:8100",), kv_hosts=("localhost",)).kv_host_allowed(host)


def test_kv_hosts_take_networks() -> None:
    config = engine_config(prefill=("http://prefill.fleet.svc:8100",),
                           kv_hosts=("10.244.0.0/16", "fd00:1::/64", "rdma-0.example", "192.0.2.7/32"))
    for host in ["10.244.0.0", "10.244.3.17", "10.244.255.255", "fd00:1::9", "FD00:1:0:0::A", "192.0.2.7",
                 "rdma-0.example", "prefill.fleet.svc"]:
        assert config.kv_host_allowed(host), host
    for host in ["10.245.0.1", "10.243.255.255", "fd00:2::1", "192.0.2.8", "localhost", "127.0.0.1",
                 "10.244.0.0/16", "10.244.3.17:22", "evil.example"]:
        assert not config.kv_host_allowed(host), host
    assert config.allowed_kv_hosts == {"prefill.fleet.svc", "rdma-0.example"}


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "10.0.0.0/", "/8", "fd00::/129", "host/8", "10.0.0.0/8:80"])
def test_a_bad_network_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"model": {"name": "m"}, "engine": {"decode": ["http://10.0.0.1:8200"],
                                                             "kv_hosts": ["10.1.1.1", bad]}}, env={})
    assert caught.value.key == "engine.kv_hosts[1]"
    assert "CIDR" in str(caught.value)


def test_a_network_host_part_is_allowed() -> None:
    config = engine_config(prefill=("http://10.0.0.1:8100",), kv_hosts=("10.244.1.5/16",))
    assert config.kv_host_allowed("10.244.200.1")


@pytest.mark.parametrize(("host", "loopback"), [("localhost", True), ("127.0.0.1", True), ("127.3.2.1", True),
                                                ("::1", True), ("::ffff:7f00:1", False), ("10.0.0.1", False),
                                                ("localhost.example", False), ("128.0.0.1", False)])
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


# ------------------------------------------------------------------ remote_host: resolved names


def test_fleet_takes_the_addresses_a_prefill_engine_name_resolved_to() -> None:
    config = engine_config(prefill=("http://prefill-0.fleet.svc:8100", "http://10.0.0.2:8100"))
    fleet = Fleet(config.prefill_engines, config.decode_engines, max_inflight_per_engine=1, unhealthy_after=1,
                  healthy_after=1, kv_host_allowed=config.kv_host_allowed)
    named = config.prefill_engines[0]
    assert not fleet.kv_host_allowed("10.244.3.17")
    assert fleet.resolved(named, ["10.244.3.17", "fe80::1%eth0", "not an address"])
    assert fleet.engines["prefill"][0].addresses == {"10.244.3.17", "fe80::1"}
    assert fleet.kv_host_allowed("10.244.3.17") and fleet.kv_host_allowed("fe80::1")
    assert fleet.kv_host_allowed("prefill-0.fleet.svc") and fleet.kv_host_allowed("10.0.0.2")
    assert not fleet.kv_host_allowed("10.244.3.18") and not fleet.kv_host_allowed("localhost")
    assert not fleet.resolved(named, ("10.244.3.17", "fe80::1"))  # nothing new
    # Rescheduled: the new address replaces the old one.
    assert fleet.resolved(named, ("10.244.9.9",))
    assert fleet.kv_host_allowed("10.244.9.9") and not fleet.kv_host_allowed("10.244.3.17")
    # A name resolving to loopback makes every loopback spelling that engine's.
    fleet.resolved(named, ("127.0.0.1",))
    assert fleet.kv_host_allowed("localhost") and fleet.kv_host_allowed("::1")


def driver_with_named_prefill(**sections: Any) -> Driver:
    return Driver(prefill=("http://prefill-0.fleet.svc:8100",), decode=DECODE_URLS[:1], **sections)


def prefill_then_decode(d: Driver, remote_host: str) -> Any:
    client = d.post(COMPLETIONS, completion_body())
    d.answer_prefill(d.leg("prefill").bid, remote_host=remote_host)
    return client


def test_a_remote_host_the_engine_name_resolved_to_is_that_engines() -> None:
    d = driver_with_named_prefill(retry={"max_attempts": 1})
    refused = prefill_then_decode(d, "10.244.3.17")
    assert refused.last.status == 502 and refused.last.json()["error"]["code"] == "prefill_failed"
    assert "not an engine of this fleet" in refused.last.json()["error"]["message"]
    assert not d.open_legs("decode")
    d.feed(EngineResolved(d.config.engine.prefill_engines[0], ("10.244.3.17",)))
    accepted = prefill_then_decode(d, "10.244.3.17")
    decode = d.leg("decode")
    assert decode.body["kv_transfer_params"]["remote_host"] == "10.244.3.17"
    d.answer_decode(decode.bid)
    assert accepted.last.status == 200


def test_a_refused_remote_host_is_logged_once_per_value_with_the_fix() -> None:
    d = driver_with_named_prefill(retry={"max_attempts": 1}, health={"unhealthy_after": 100})
    for host in ["203.0.113.9", "203.0.113.9", "localhost", "203.0.113.9", "localhost", "evil.example"]:
        client = prefill_then_decode(d, host)
        assert client.last.status == 502
    logs = [log for log in d.logs if log.event == "kv_host_refused"]
    assert [log.fields["remote_host"] for log in logs] == ["203.0.113.9", "localhost", "evil.example"]
    assert all("engine.kv_hosts" in log.fields["fix"] and log.fields["level"] == "warning" for log in logs)
    assert not any(leg.phase == "decode" for leg in d.leg_history)


def test_the_refusal_log_is_bounded() -> None:
    config = engine_config(prefill=("http://10.0.0.1:8100",))
    fleet = Fleet(config.prefill_engines, config.decode_engines, max_inflight_per_engine=1, unhealthy_after=1,
                  healthy_after=1, kv_host_allowed=config.kv_host_allowed)
    firsts = [fleet.first_refusal(f"host-{i}.example") for i in range(1500)]
    assert firsts == [True] * 1000 + [False] * 500
    assert not fleet.first_refusal("host-0.example")
