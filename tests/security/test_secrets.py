"""No secret crosses its boundary, over a representative mix of traffic (docs/contract.md, "The engine
request", "The journal"; docs/security.md).

Distinctive client keys and a distinctive engine key go through valid,
invalid, streamed, unauthorised and engine-failing requests (with retries
and KV releases through ``abort_endpoint``), ``/v1/models``, ``/metrics``,
``/ready``, ``/health`` and an unknown path. Then every log line, every
journal line, every byte sent to a client and every request an engine
received is searched for the secret that must not be there:

* client keys never reach an engine, a log line or the journal (nor are
  they echoed back);
* the engine key never reaches a client, a log line or the journal -- and it
  does reach the engines, on every request Narwhal sends them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from narwhal_sim.testing import SimThread

from ..harness import Fleet
from ..helpers import CHAT, COMPLETIONS, assert_journal_consistent, body_for, header_values, poll, write_keys_file
from .support import RawClient, json_post, request_bytes


def test_no_secret_crosses_its_boundary(
    start_secure_router, engine_key, client_key, tmp_path, journal_path, router_log
) -> None:
    wrong_key = "sk-client-SECRET-wrong-" + client_key[-12:]
    other_key = "sk-client-SECRET-other-" + client_key[-12:]
    keys = tmp_path / "keys.toml"
    
    write_keys_file(keys, {"team-a": client_key, "team-b": other_key})
    client_secrets = [client_key, wrong_key, other_key]
    good = [("Authorization", f"Bearer {client_key}")]
    decoys = [("api-key", wrong_key), ("x-api-key", other_key), ("Cookie", f"session={wrong_key}")]

    with SimThread(role="prefill", speed=0, api_key=engine_key) as prefill, SimThread(
        role="decode", speed=0, api_key=engine_key, faults={"error_rate": 1.0, "error_status": 500}
    ) as failing_decode, SimThread(role="decode", speed=0, api_key=engine_key) as decode:
        fleet = Fleet(prefill=[prefill], decode=[failing_decode, decode])
        router = start_secure_router(
            fleet_=fleet,
            ingress={"auth": "api_keys", "api_keys_file": str(keys)},
            engine={"kv_release": "abort_endpoint"},
            health={"unhealthy_after": 100},
        )
        sent: list[bytes] = []

        def talk(data: bytes, *, reads: int = 1) -> list[int]:
            with RawClient(router.address) as client:
                client.send(data)
                statuses = [client.read_response().status for _ in range(reads)]
                sent.append(bytes(client.received))
            return statuses

        mix: list[tuple[bytes, int]] = [
            # Valid, both routes, whole and streamed; decoys in the credential headers.
            (json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=3), good + decoys), 200),
            (json_post(CHAT, body_for(CHAT, max_tokens=3), good), 200),
            (json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=3, stream=True), good), 200),
            (json_post(CHAT, body_for(CHAT, max_tokens=3, stream=True), good + decoys), 200),
            (json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=2), [("Authorization", f"Bearer {other_key}")]),
             200),
            # Invalid.
            (json_post(COMPLETIONS, b'{"prompt": ', good), 400),
            (json_post(CHAT, body_for(CHAT, n=2), good), 400),
            (json_post(COMPLETIONS, body_for(COMPLETIONS, model="gpt-4o"), good), 404),
            # Refused by an engine (its 4xx relayed as 400).
            (json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=10**9), good), 400),
            # Unauthorised.
            (json_post(COMPLETIONS, body_for(COMPLETIONS), []), 401),
            (json_post(COMPLETIONS, body_for(COMPLETIONS), [("Authorization", f"Bearer {wrong_key}")]), 401),
            (json_post(COMPLETIONS, body_for(COMPLETIONS), [("Authorization", f"Basic {client_key}")]), 401),
            (json_post(COMPLETIONS, body_for(COMPLETIONS), decoys), 401),
            (json_post(COMPLETIONS, body_for(COMPLETIONS), good + [("Authorization", f"Bearer {wrong_key}")]), 401),
            # The other routes.
            (request_bytes("GET", "/v1/models", headers=good), 200),
            (request_bytes("GET", "/v1/models", headers=[("Authorization", f"Bearer {wrong_key}")]), 401),
            (request_bytes("GET", "/metrics", headers=good), 200),
            (request_bytes("GET", "/ready", headers=good + decoys), 200),
            (request_bytes("GET", "/health"), 200),
            (request_bytes("GET", "/v1/unknown", headers=good + decoys), 404),
        ]
        for data, expected in mix:
            (status,) = talk(data)
            assert status == expected, (status, data[:120])

        # Every decode leg on the failing engine released its prefilled KV through the abort endpoint.
        releases = poll(lambda: prefill.requests("/abort_request"), timeout=5, what="a KV release")
        # Engine failures until retries run out: every engine fails now.
        prefill.set_faults(error_rate=1.0, error_status=503)
        (status,) = talk(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=2), good))
        assert status == 502, status
        prefill.set_faults()
        router.wait_idle()
        poll(lambda: prefill.requests("/health") and decode.requests("/health"), timeout=5, what="probes")

        engine_records: list[dict[str, Any]] = []
        for engine in fleet.all():
            engine_records.extend(engine.requests())

    journal_text = Path(journal_path).read_text()
    log_text = router_log.text()
    to_clients = b"".join(sent).decode("latin-1")
    at_engines = json.dumps(engine_records)

    terminals = assert_journal_consistent(journal_path)
    kinds = {r["terminal"] for r in terminals.values()}
    assert {"completed", "invalid", "denied", "failed"} <= kinds, kinds
    assert any(
        leg["kv"] and leg["kv"]["outcome"] == "released" and leg["kv"]["method"] == "abort_endpoint"
        for r in terminals.values() for leg in r["legs"]
    ), "no KV release was journaled"
    assert any(len([leg for leg in r["legs"] if leg["phase"] == "prefill"]) > 1 for r in terminals.values()), (
        "no request was retried"
    )

    # Client secrets: never at an engine, in a log line, in the journal (nor echoed back).
    for secret in client_secrets:
        assert secret not in at_engines, secret
        assert secret not in log_text, secret
        assert secret not in journal_text, secret
        assert secret not in to_clients, secret
    # The engine key: never to a client, a log line or the journal...
    assert engine_key not in to_clients
    assert engine_key not in log_text
    assert engine_key not in journal_text
    # ...but on every request Narwhal sent an engine: legs, probes and KV releases.
    assert engine_key in at_engines
    narwhal_sent = [
        r for r in engine_records if r["path"].split("?")[0] != "/kv/pull"  # sim-to-sim pulls are the sims' own
    ]
    assert len([r for r in engine_records if r["path"] in (COMPLETIONS, CHAT)]) >= 10 and releases
    for record in narwhal_sent:
        assert header_values(record, "authorization") == [f"Bearer {engine_key}"], record
