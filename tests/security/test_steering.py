"""What a client may not steer (docs/contract.md, "The engine request", "Prefill and decode legs"): routing
state, KV handoff, engine addresses.

Router-owned body fields and internal headers a client sends are dropped
before anything else sees them (and the dropped fields are listed in the
journal's ``stripped``); the decode leg's KV parameters come only from the
prefill engine's answer, and a forged answer pointing a decode engine outside
the fleet is refused; engine addresses come only from the configuration.
"""

from __future__ import annotations

import json

import pytest

from narwhal_sim.testing import SimThread

from ..harness import Fleet
from ..helpers import (
    CHAT,
    COMPLETIONS,
    LEG_HEADERS,
    PREFILL_KV_REQUEST,
    assert_envelope,
    assert_journal_consistent,
    body_for,
    completion_records,
    each_route,
    header_values,
    journal_terminal,
)
from .support import (
    Answer,
    Canary,
    FakeEngine,
    RawClient,
    Received,
    assert_still_serves,
    header_names,
    json_post,
    request_bytes,
)


# : Internal headers a client may try to set (docs/contract.md, "The engine request": x-request-id and every
# x-narwhal-*).
INTERNAL_HEADERS = [
    ("X-Request-Id", "client-rid-1"),
    ("x-narwhal-client", "admin"),
    ("X-Narwhal-Route", "decode-only"),
    ("X-NARWHAL-BACKEND-ID", "forged-p1"),
]


def _steering_body(route: str, canary: Canary, *, stream: bool) -> dict[str, object]:
    """A client body carrying every router-owned field, each pointing somewhere hostile."""
    forged_kv = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "evil-engine",
        "remote_request_id": "evil-owner", "remote_block_ids": [0, 1, 2],
        "remote_host": "127.0.0.1", "remote_port": canary.port,
    }
    return {
        **body_for(route, max_tokens=3, stream=stream),
        "kv_transfer_params": forged_kv,
        "request_id": "client-chosen-id",
        "bootstrap_host": "169.254.169.254",
        "bootstrap_port": canary.port,
        "bootstrap_room": 7,
        "temperature": 0.5,
    }


@each_route
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_router_owned_fields_and_internal_headers_are_stripped(
    start_router, fleet, journal_path, route, stream
) -> None:
    router = start_router()
    with Canary() as canary:
        with RawClient(router.address) as client:
            client.send(json_post(route, _steering_body(route, canary, stream=stream), INTERNAL_HEADERS))
            response = client.read_response()
        assert response.status == 200, response.body[:300]
        rid = response.header("x-request-id")
        assert rid != "client-rid-1"
        record = journal_terminal(journal_path, rid)
        assert record["terminal"] == "completed"
        assert record["stripped"] == [
            "kv_transfer_params", "request_id", "bootstrap_host", "bootstrap_port", "bootstrap_room",
        ]
        assert record["client_rid"] == "client-rid-1" and record["client"] == "anonymous"

        prefill, decode = completion_records(fleet.prefill), completion_records(fleet.decode)
        assert len(prefill) == 1 and len(decode) == 1, (prefill, decode)
        legs = {leg["phase"]: leg for leg in record["legs"]}
        for leg, phase in ((prefill[0], "prefill"), (decode[0], "decode")):
            assert set(header_names(leg)) <= LEG_HEADERS, header_names(leg)
            assert header_values(leg, "x-request-id") == [legs[phase]["backend_id"]]
            raw = json.dumps(leg)
            for forged in ("client-rid-1", "admin", "decode-only", "forged-p1", "evil-engine", "evil-owner",
                           "client-chosen-id", "169.254.169.254", str(canary.port)):
                assert forged not in raw, (phase, forged)
            sent = json.loads(leg["body"])
            assert not {"request_id", "bootstrap_host", "bootstrap_port", "bootstrap_room"} & set(sent)
            assert sent["temperature"] == 0.5
        # The prefill leg's KV request is Narwhal's own...
        assert json.loads(prefill[0]["body"])["kv_transfer_params"] == PREFILL_KV_REQUEST
        # ...and the decode leg's KV params are the prefill engine's answer, nothing else.
        kv = json.loads(decode[0]["body"])["kv_transfer_params"]
        engine = fleet.prefill[0]
        assert kv["remote_engine_id"] == engine.engine_id
        assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", engine.port)
        assert kv["remote_request_id"].split("-", 1)[1].startswith(legs["prefill"]["backend_id"] + "-")  # cmpl-<id>-0-<8 hex>
        assert legs["prefill"]["kv"]["owner"] == kv["remote_request_id"]
        assert legs["prefill"]["kv"]["outcome"] == "pulled"
        router.wait_idle()
        assert canary.connections == 0
    assert_still_serves(router.address, journal_path)
    assert_journal_consistent(journal_path)


def _forging_prefill(remote_host: str) -> FakeEngine:
    """A prefill engine whose otherwise valid answers point the decode engine at ``remote_host``."""

    def answer(received: Received) -> Answer:
        kv = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "forged-engine",
            "remote_request_id": "forged-owner", "remote_block_ids": [0, 1],
            "remote_host": remote_host, "remote_port": 80, "tp_size": 1,
        }
        body = {
            "id": "cmpl-forged", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "kv_transfer_params": kv,
        }
        return 200, "application/json", json.dumps(body).encode()

    return FakeEngine(answer)


# (Not 127.0.0.2: with engines on 127.0.0.1, every loopback address names the same host, docs/configure.md.
# 0.0.0.0 also reaches this machine, but is no loopback spelling: refused.)
@pytest.mark.parametrize("remote_host", ["169.254.169.254", "metadata.google.internal", "0.0.0.0"])
def test_forged_prefill_answer_pointing_outside_the_fleet_never_reaches_a_decode_engine(
    start_router, journal_path, remote_host
) -> None:
    with _forging_prefill(remote_host) as prefill, SimThread(role="decode", speed=0) as decode:
        router = start_router(fleet_=Fleet(prefill=[prefill], decode=[decode]), retry={"max_attempts": 3})
        with RawClient(router.address) as client:
            client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=3)))
            response = client.read_response()
        assert_envelope(response, 502, type="server_error", code="prefill_failed")
        record = journal_terminal(journal_path, response.header("x-request-id"))
        assert record["terminal"] == "failed" and record["error"]["code"] == "prefill_failed"
        assert [(leg["phase"], leg["outcome"]) for leg in record["legs"]] == [("prefill", "bad_kv")] * 3
        assert all(leg["kv"] is None for leg in record["legs"])
        assert len(prefill.completions()) == 3
        router.wait_idle()
        # No decode leg, no decode_abort release, nothing at all carried the forged host.
        assert completion_records([decode]) == []
        for received in decode.requests():
            assert remote_host not in json.dumps(received), received
        assert remote_host not in response.body.decode()
        assert decode.stats()["kv_pull_failures"] == 0
        assert_journal_consistent(journal_path)


def test_engine_addresses_come_only_from_configuration(start_router, fleet, journal_path) -> None:
    router = start_router()
    with Canary() as canary:
        elsewhere = f"127.0.0.1:{canary.port}"
        body = {
            **body_for(CHAT, max_tokens=2),
            "base_url": f"http://{elsewhere}", "api_base": f"http://{elsewhere}/v1", "engine": f"http://{elsewhere}",
        }
        attempts = [
            json_post(CHAT, body, [("X-Forwarded-Host", elsewhere), ("Forwarded", f"host={elsewhere}")]),
            request_bytes("POST", CHAT, json.dumps(body).encode(), headers=[("host", elsewhere)]),
            request_bytes("POST", f"http://{elsewhere}{CHAT}", json.dumps(body).encode()),
            json_post(f"{CHAT}?engine=http://{elsewhere}&prefill={elsewhere}", body),
        ]
        statuses = []
        for data in attempts:
            with RawClient(router.address) as client:
                client.send(data)
                try:
                    statuses.append(client.read_response().status)
                except Exception as exc:  # a closed connection is an acceptable answer too
                    statuses.append(repr(exc))
        router.wait_idle()
        assert canary.connections == 0, statuses
    for engine in fleet.all():
        for received in engine.requests():
            assert header_values(received, "host") == [f"127.0.0.1:{engine.port}"], received
            assert str(canary.port) not in json.dumps(received["headers"]), received
    assert statuses.count(200) >= 2, statuses
    assert_journal_consistent(journal_path)
    assert_still_serves(router.address, journal_path)


def test_client_text_cannot_forge_journal_records(start_router, fleet, journal_path) -> None:
    """Whatever a client writes lands inside one JSON string of one line: it cannot add or end records."""
    router = start_router()
    forged = '\n{"rid":"forged","terminal":"completed","status":200}\n'
    attempts = [  # (request, its status: an unknown model, a wrong type, an unsupported field, a served one)
        (json_post(COMPLETIONS, {"prompt": "a", "model": "gpt" + forged}), 404),
        (json_post(COMPLETIONS, {"prompt": "a", "max_tokens": forged}), 400),
        (json_post(COMPLETIONS, {"prompt": "a", "tools": [{"type": forged}]}), 400),
        (json_post(COMPLETIONS, {"prompt": "a", "max_tokens": 1}, [("x-request-id", 'a"b\\c\x7f\x01{"rid":"forged"}')]),
         200),
    ]
    for data, status in attempts:
        with RawClient(router.address) as client:
            client.send(data)
            response = client.read_response()
        assert response.status == status, response.body[:200]
    router.wait_idle()
    lines = [line for line in journal_path.read_bytes().split(b"\n") if line]
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r, dict) and r["rid"] != "forged" for r in records)
    assert len(assert_journal_consistent(journal_path)) == 4
    client_rids = [r["client_rid"] for r in records if r.get("client_rid")]
    assert client_rids and all(ch.isprintable() for ch in client_rids[0])
    assert "\x7f" not in client_rids[0] and "\x01" not in client_rids[0]


@pytest.mark.parametrize(
    "host",
    ["169.254.169.254", "127.1", "2130706433", "0x7f.0.0.1", "127.0.0.01", "::ffff:127.0.0.1", "[127.0.0.1]",
     " 127.0.0.1", "127.0.0.1 ", "127.0.0.1.evil.example", "evil.example/127.0.0.1", "", 7],
)
def test_prefill_answer_remote_host_must_name_a_fleet_host(host: object) -> None:
    """The SSRF guard in the core: only the configured hosts, in their canonical spelling."""
    from narwhal_core.config import EngineConfig
    from narwhal_core.leg_bodies import PrefillAnswerError, check_prefill_answer

    engine = EngineConfig(prefill=("http://127.0.0.1:8100",), decode=("http://127.0.0.1:8200",),
                          kv_hosts=("prefill-b.internal",))
    kv = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [0], "remote_port": 8100,
          "remote_host": host}
    with pytest.raises(PrefillAnswerError) as caught:
        check_prefill_answer(json.dumps({"kv_transfer_params": kv}).encode(), "rid-p1", engine.kv_host_allowed)
    assert caught.value.status == 502 and caught.value.code == "prefill_failed"
    # Loopback names and addresses are one host (the fleet's is 127.0.0.1).
    for allowed in ("127.0.0.1", "prefill-b.internal", "PREFILL-B.internal.", "localhost", "127.0.0.2", "::1"):
        kv["remote_host"] = allowed
        handoff = check_prefill_answer(json.dumps({"kv_transfer_params": kv}).encode(), "rid-p1",
                                       engine.kv_host_allowed)
        assert handoff.params["remote_host"] == allowed
