"""Engines that come and go (docs/operate.md): discovery's sets applied to a running router.

A new engine joins after its first successful probe; a removed one is
drained (no new legs or releases, its legs finish, its KV is released as
usual) and forgotten once nothing refers to it; the engines that stay keep
their state.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from narwhal_core import AuthenticatorChanged, EnginesChanged, FleetChanged, WriteJournal, api_key_digest, parse_api_keys
from narwhal_core.auth import Authenticator
from narwhal_core.config import config_from_dict, parse_engine_url
from narwhal_core.errors import ConfigError
from narwhal_core.fleet import EngineState
from narwhal_core.membership import SWEEP_S

from .router_driver import (
    COMPLETIONS,
    DECODE_URLS,
    MODEL,
    PREFILL_URLS,
    PROMPT,
    ClientResponse,
    Driver,
    completion_body,
)

NEW_DECODE = "http://10.0.1.3:8200"


def changed(phase: str, *urls: str) -> EnginesChanged:
    return EnginesChanged(phase, tuple(parse_engine_url(u, key="test") for u in urls), "dns")


def engine(d: Driver, phase: str, url: str) -> EngineState | None:
    return d.router.fleet.find(phase, url)  # type: ignore[arg-type]


def logs(d: Driver, event: str) -> list[dict[str, object]]:
    return [log.fields for log in d.logs if log.event == event]


def probes_to(d: Driver, url: str) -> list[object]:
    return [c for c in d.pending_controls("probe") if c.cmd.engine.url == url]


def test_a_new_engine_joins_at_its_first_successful_probe_not_before() -> None:
    d = Driver(auto_probe=None)
    for control in d.pending_controls("probe"):
        d.complete_control(control.cmd.key)
    staying = [engine(d, "decode", url) for url in DECODE_URLS]
    d.feed(changed("decode", *DECODE_URLS, NEW_DECODE))
    new = engine(d, "decode", NEW_DECODE)
    assert new is not None and new.state == "joining" and not new.healthy
    assert logs(d, "engine_added") == [{"engine": NEW_DECODE, "phase": "decode", "source": "dns"}]
    assert [engine(d, "decode", url) for url in DECODE_URLS] == staying  # the same objects
    assert new not in d.router.fleet.candidates("decode")
    (probe,) = probes_to(d, NEW_DECODE)
    d.complete_control(probe.cmd.key, status=503)  # type: ignore[attr-defined]
    assert new.state == "joining"
    d.advance(d.config.health.probe_interval_s)
    (probe,) = probes_to(d, NEW_DECODE)
    d.complete_control(probe.cmd.key)  # type: ignore[attr-defined]
    # One success is enough (health.healthy_after counts the way back of an engine that left rotation).
    assert new.state == "in rotation" and new in d.router.fleet.candidates("decode")
    assert {"engine": NEW_DECODE, "phase": "decode"} in logs(d, "engine_up")


def test_a_removed_engine_finishes_its_legs_then_is_forgotten() -> None:
    d = Driver(routing={"policy": "round_robin"})
    first = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    gone = prefill.engine.url
    stays = next(u for u in PREFILL_URLS if u != gone)
    d.feed(changed("prefill", stays))
    (draining,) = logs(d, "engine_draining")
    assert draining == {"engine": gone, "phase": "prefill", "source": "dns", "outstanding": 1, "kv_held": 0}
    state = engine(d, "prefill", gone)
    assert state is not None and state.state == "draining"
    # New requests go elsewhere.
    d.post(COMPLETIONS, completion_body())
    assert [leg.engine.url for leg in d.open_legs("prefill")] == [gone, stays]
    # Its leg finishes normally, and the request completes.
    d.answer_prefill(prefill.bid)
    decode = d.leg("decode", prefill.rid)
    d.answer_decode(decode.bid)
    assert first.last.status == 200
    assert not logs(d, "engine_removed")
    d.advance(SWEEP_S)
    assert logs(d, "engine_removed") == [{"engine": gone, "phase": "prefill"}]
    assert engine(d, "prefill", gone) is None
    # Forgotten: no more probes or scrapes to it, however long the router runs.
    d.serve_until_done()
    d.advance(60)
    assert all(c.cmd.engine.url != gone for c in d.controls.values() if c.started_at > d.now - 50)
    d.complete_releases()
    d.check_invariants(final=True)


def fleet_changes(d: Driver) -> list[tuple[str, list[str]]]:
    return [(c.phase, [a.url for a in c.engines]) for c in d.fleet_changes]


def test_a_join_and_a_forgetting_are_each_told_as_the_phase_s_engines_now() -> None:
    # What follows the fleet outside the core (the KV-event subscriber) acts on FleetChanged,
    # a value emitted beside the engine_added / engine_removed log lines, not on those lines.
    d = Driver()
    assert d.fleet_changes == []  # the configured engines are no change
    first, second = PREFILL_URLS
    new = "http://10.0.0.3:8100"
    d.feed(changed("prefill", first, second, new))
    assert fleet_changes(d) == [("prefill", [first, second, new])]  # at once, not at the first probe
    d.feed(changed("prefill", first, second, new))
    assert len(d.fleet_changes) == 1  # nothing joined
    d.feed(changed("prefill", second, new))
    assert fleet_changes(d)[1:] == [("prefill", [second, new])]  # idle, so forgotten at once
    d.feed(changed("decode", NEW_DECODE))  # the gone are drained (idle: forgotten), then the new one joins
    assert fleet_changes(d)[2:] == [("decode", [DECODE_URLS[1]]), ("decode", []), ("decode", [NEW_DECODE])]
    client = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    kept = next(u for u in (second, new) if u != prefill.engine.url)
    d.feed(changed("prefill", kept))
    d.advance(SWEEP_S)
    assert len(d.fleet_changes) == 5  # draining with a leg running: still in the fleet, no change
    d.answer_prefill(prefill.bid)
    d.answer_decode(d.leg("decode", prefill.rid).bid)
    assert client.last.status == 200
    d.advance(SWEEP_S)
    assert fleet_changes(d)[5:] == [("prefill", [kept])]  # forgotten once nothing refers to it
    assert all(type(c) is FleetChanged for c in d.fleet_changes)


def test_kv_held_by_a_draining_prefill_engine_is_released_there_before_it_is_forgotten() -> None:
    d = Driver(engine={"kv_release": "abort_endpoint", "abort_path": "/v1/abort"})
    client = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    d.answer_prefill(prefill.bid)
    gone = prefill.engine.url
    d.feed(changed("prefill", *(u for u in PREFILL_URLS if u != gone)))
    assert logs(d, "engine_draining")[0]["kv_held"] == 1
    client.leave()  # no decode leg will pull it: the KV is released on the draining engine
    (release,) = d.pending_controls("release")
    assert release.cmd.engine.url == gone and release.cmd.target == "/v1/abort"
    d.advance(SWEEP_S)
    assert engine(d, "prefill", gone) is not None  # the release is still in flight
    d.complete_releases()
    assert d.terminal(prefill.rid)["legs"][0]["kv"]["outcome"] == "released"
    d.advance(SWEEP_S)
    assert logs(d, "engine_removed") == [{"engine": gone, "phase": "prefill"}]
    d.check_invariants(final=True)


def test_no_release_goes_to_a_draining_decode_engine() -> None:
    d = Driver()
    d.feed(changed("decode", DECODE_URLS[1]))
    assert logs(d, "engine_removed") == [{"engine": DECODE_URLS[0], "phase": "decode"}]  # idle: at once
    client = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    d.answer_prefill(prefill.bid)
    decode = d.leg("decode")
    assert decode.engine.url == DECODE_URLS[1]
    d.feed(changed("decode", NEW_DECODE))  # the decode engine in use leaves, a new one joins
    d.answer_status(decode.bid, 500)  # its leg fails: the KV is released, not on the draining engine
    for control in d.pending_controls("release"):
        assert control.cmd.engine.url == NEW_DECODE
    d.complete_releases()
    d.advance(3)  # the retry's backoff
    d.serve_until_done()
    d.complete_releases()
    assert client.last.status == 200
    assert {leg.engine.url for leg in d.started_legs(prefill.rid) if leg.phase == "decode"} == {
        DECODE_URLS[1], NEW_DECODE,
    }
    d.check_invariants(final=True)


def test_a_draining_engine_found_again_rejoins_at_its_next_probe() -> None:
    d = Driver(auto_probe=None)
    for control in d.pending_controls("probe"):
        d.complete_control(control.cmd.key)
    d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    gone = prefill.engine.url
    state = engine(d, "prefill", gone)
    d.feed(changed("prefill", *(u for u in PREFILL_URLS if u != gone)))
    assert state is not None and state.state == "draining"
    d.feed(changed("prefill", *PREFILL_URLS))
    assert engine(d, "prefill", gone) is state and state.state == "joining"
    (probe,) = probes_to(d, gone)
    d.complete_control(probe.cmd.key)  # type: ignore[attr-defined]
    assert state.state == "in rotation"


def test_no_engines_of_a_phase_means_not_ready() -> None:
    d = Driver()
    assert d.router.statistics().ready
    d.feed(changed("decode"))
    assert not d.router.statistics().ready
    assert "no healthy decode engine" in d.router._ctx.ready_problems()
    d.feed(changed("decode", NEW_DECODE))
    assert d.router.statistics().ready  # (its probe answered 200 at once)


def test_the_prefix_index_forgets_a_drained_engine() -> None:
    d = Driver(routing={"policy": "prefix"})
    d.post(COMPLETIONS, completion_body(PROMPT * 4))  # (whole blocks of the index: docs/configure.md)
    prefill = d.leg("prefill")
    gone = prefill.engine.url
    policy = d.router.fleet.policy
    d.answer_prefill(prefill.bid)
    assert len(policy.indexes[gone])  # type: ignore[attr-defined]
    d.feed(changed("prefill", *(u for u in PREFILL_URLS if u != gone)))
    assert engine(d, "prefill", gone) is not None  # it holds the request's KV until the decode leg pulls it
    assert not len(policy.indexes[gone])  # type: ignore[attr-defined]  # emptied at once: it takes no legs
    d.serve_until_done()
    d.advance(SWEEP_S)
    assert engine(d, "prefill", gone) is None and gone not in policy.indexes  # type: ignore[attr-defined]
    d.check_invariants(final=True)


# ------------------------------------------------------------------ the admin API

ADMIN_KEY = "sk-admin-0123456789"
CLIENT_KEY = "sk-client-0123456789"
KEYS = (f'[[keys]]\nclient = "alice"\nsha256 = "{api_key_digest(CLIENT_KEY)}"\n\n'
        f'[[keys]]\nclient = "ops"\nrole = "admin"\nsha256 = "{api_key_digest(ADMIN_KEY)}"\n')


def with_keys(d: Driver, text: str = KEYS) -> Driver:
    d.feed(AuthenticatorChanged(Authenticator(mode="api_keys", keys=parse_api_keys(text))))
    return d


def admin(d: Driver, method: str, body: Any = None, key: str | None = ADMIN_KEY) -> ClientResponse:
    client = d.connect()
    headers = [] if key is None else [("Authorization", f"Bearer {key}")]
    if body is not None:
        headers.append(("Content-Type", "application/json"))
    client.request(method, "/admin/engines", b"" if body is None else json.dumps(body).encode(), headers)
    response = client.last
    assert response.complete
    return response


def test_without_an_admin_key_there_is_no_admin_api() -> None:
    d = Driver()
    assert admin(d, "GET").status == 404  # auth = "none": no keys at all
    with_keys(d, KEYS.split("\n\n")[0] + "\n")  # client keys only
    response = admin(d, "GET")
    assert response.status == 404 and response.json()["error"]["code"] == "not_found"


def test_the_admin_api_wants_its_own_key_and_never_echoes_it() -> None:
    d = with_keys(Driver())
    for key in (None, "sk-wrong", CLIENT_KEY):
        response = admin(d, "GET", key=key)
        assert response.status == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert (key or "Bearer").encode() not in bytes(response.body)
    # An admin key is no client key.
    client = d.post(COMPLETIONS, completion_body(), headers=[("Authorization", f"Bearer {ADMIN_KEY}")])
    assert client.last.status == 401
    assert ADMIN_KEY.encode() not in b"".join(cmd.line for _, cmd in d.commands if type(cmd) is WriteJournal)
    listed = admin(d, "GET").json()
    assert listed["object"] == "list"
    assert [(e["url"], e["phase"], e["state"], e["outstanding"]) for e in listed["data"]] == [
        (url, "prefill", "in rotation", 0) for url in PREFILL_URLS] + [
        (url, "decode", "in rotation", 0) for url in DECODE_URLS]
    assert all(set(e) == {"url", "phase", "state", "outstanding", "load", "load_age_s"} for e in listed["data"])


def test_the_admin_api_adds_and_drains_engines() -> None:
    d = with_keys(Driver(auto_probe=None))
    for control in d.pending_controls("probe"):
        d.complete_control(control.cmd.key)
    added = admin(d, "POST", {"url": NEW_DECODE + "/", "phase": "decode"})
    assert added.status == 201 and added.json()["state"] == "joining" and added.json()["url"] == NEW_DECODE
    assert logs(d, "engine_added") == [{"engine": NEW_DECODE, "phase": "decode", "source": "admin:ops"}]
    assert admin(d, "POST", {"url": NEW_DECODE, "phase": "decode"}).status == 200  # already there
    (probe,) = probes_to(d, NEW_DECODE)
    d.complete_control(probe.cmd.key)  # type: ignore[attr-defined]
    states = {(e["url"], e["phase"]): e["state"] for e in admin(d, "GET").json()["data"]}
    assert states[(NEW_DECODE, "decode")] == "in rotation"
    removed = admin(d, "DELETE", {"url": DECODE_URLS[0], "phase": "decode"})
    assert removed.status == 200 and removed.json()["state"] == "draining"
    assert logs(d, "engine_removed") == [{"engine": DECODE_URLS[0], "phase": "decode"}]  # nothing ran there
    gone = admin(d, "DELETE", {"url": DECODE_URLS[0], "phase": "decode"})
    assert gone.status == 404 and gone.json()["error"]["code"] == "engine_not_found"
    for body, code in (({"url": "ftp://x:1", "phase": "decode"}, "invalid_url"),
                       ({"url": NEW_DECODE, "phase": "mixed"}, "invalid_phase"),
                       ({"url": NEW_DECODE}, "invalid_body"), ("[1]", "invalid_body")):
        response = admin(d, "POST", body)
        assert response.status == 400 and response.json()["error"]["code"] == code, body
    response = admin(d, "PUT", {"url": NEW_DECODE, "phase": "decode"})
    assert response.status == 405 and response.header(b"allow") == b"GET, HEAD, POST, DELETE"


def test_with_discovery_the_admin_api_only_reads() -> None:
    config = config_from_dict({"model": {"name": MODEL}, "engine": {"discovery": "dns", "decode": []},
                               "discovery": {"decode": "decode.narwhal.test"}}, env={})
    d = with_keys(Driver(config))
    d.feed(changed("decode", NEW_DECODE))
    assert [e["url"] for e in admin(d, "GET").json()["data"]] == [NEW_DECODE]
    for method in ("POST", "DELETE"):
        response = admin(d, method, {"url": NEW_DECODE, "phase": "decode"})
        assert response.status == 409 and response.json()["error"]["code"] == "discovery_in_charge"


# ------------------------------------------------------------------ the config

BASE: dict[str, Any] = {"model": {"name": MODEL}, "engine": {"discovery": "dns", "decode": []}}


@pytest.mark.parametrize(("change", "key", "message"), [
    ({"engine": {"discovery": "dns", "decode": []}}, "discovery.decode", 'is required with engine.discovery = "dns"'),
    ({"engine": {"discovery": "file", "decode": []}}, "discovery.file", 'is required with engine.discovery = "file"'),
    ({"engine": {"discovery": "dns", "decode": [DECODE_URLS[0]]}, "discovery": {"decode": "d.test"}},
     "engine.decode", "must be [] with engine.discovery = 'dns' (discovery finds the engines)"),
    ({"engine": {"decode": []}}, "engine.decode", "must be a non-empty list of http:// URLs"),
    ({"discovery": {"decode": "d.test", "port": 0}}, "discovery.port", "must be between 1 and 65535, got 0"),
    ({"discovery": {"decode": "bad name!"}}, "discovery.decode", None),
    ({"discovery": {"decode": "d.test", "nameserver": "127.0.0.1"}}, "discovery.nameserver", None),
    ({"discovery": {"decode": "d.test", "record": "MX"}}, "discovery.record", 'must be one of "A", "SRV", got "MX"'),
])
def test_discovery_config_errors_name_the_key(change: dict[str, Any], key: str, message: str | None) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({**BASE, **change}, env={})
    assert info.value.key == key
    if message is not None:
        assert str(info.value) == f"{key}: {message}"


def test_dns_discovery_with_a_prefill_name_disaggregates() -> None:
    config = config_from_dict({**BASE, "discovery": {"decode": "d.test", "prefill": "p.test"}}, env={})
    assert Driver(config).router._ctx.mode == "pd"
    config = config_from_dict({**BASE, "discovery": {"decode": "d.test"}}, env={})
    assert Driver(config).router._ctx.mode == "single"
