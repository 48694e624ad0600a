"""The engine credential (--api-key-env): required everywhere but /sim/*, sent on sim-to-sim calls."""

from __future__ import annotations

import httpx
import pytest

from narwhal_sim.testing import SimThread

from .helpers import PROMPT, connect, json_request, prefill_body

KEY = "s3cret-engine-key"
GOOD = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("POST", "/abort_request"),
        ("POST", "/kv/pull"),
        ("GET", "/no/such/route"),
    ],
)
def test_every_engine_route_needs_the_key(client: httpx.Client, method: str, path: str) -> None:
    with SimThread("mixed", speed=0, api_key=KEY) as sim:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            answer = client.request(method, sim.url + path, json={}, headers=headers)
            assert answer.status_code == 401
            error = answer.json()["error"]
            assert error["code"] == 401 and error["type"] == "AuthenticationError"
        assert client.request(method, sim.url + path, json={}, headers=GOOD).status_code != 401
        assert sim.stats()["auth_failures"] == 3


def test_control_routes_need_no_key(client: httpx.Client) -> None:
    with SimThread("mixed", speed=0, api_key=KEY) as sim:
        assert client.get(sim.url + "/sim/stats").status_code == 200
        assert client.get(sim.url + "/sim/requests").status_code == 200
        assert client.post(sim.url + "/sim/faults", json={}).status_code == 200
        assert client.post(sim.url + "/sim/reset").status_code == 200


def test_pd_exchange_sends_the_key(client: httpx.Client) -> None:
    with SimThread("prefill", speed=50, api_key=KEY) as p, \
            SimThread("decode", speed=50, api_key=KEY, kv_pull_grace_ms=200) as d:  # fmt: skip
        kv = client.post(p.url + "/v1/completions", json=prefill_body(), headers=GOOD).json()["kv_transfer_params"]
        answer = client.post(d.url + "/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv},
                             headers=GOOD)  # fmt: skip
        assert answer.status_code == 200
        assert p.stats()["kv_pulled"] == 1
        (pull,) = p.requests("/kv/pull")
        assert ["authorization", f"Bearer {KEY}"] in [[n.lower(), v] for n, v in pull["headers"]]
        # The release after an abort-before-pull carries it too.
        kv = client.post(p.url + "/v1/completions", json=prefill_body(), headers=GOOD).json()["kv_transfer_params"]
        sock = connect(d.port)
        sock.sendall(json_request("/v1/completions", {"prompt": PROMPT, "kv_transfer_params": kv}, GOOD))
        sock.close()
        assert p.wait_for(lambda s: s["kv_released"] == 1)["kv_held"] == 0
        (abort,) = p.requests("/kv/notify")
        assert abort["status"] == 200


def test_pull_with_a_wrong_key_fails_and_recomputes(client: httpx.Client) -> None:
    with SimThread("prefill", speed=50, api_key=KEY) as p, SimThread("decode", speed=50, api_key="other") as d:
        kv = client.post(p.url + "/v1/completions", json=prefill_body(), headers=GOOD).json()["kv_transfer_params"]
        answer = client.post(d.url + "/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv},
                             headers={"Authorization": "Bearer other"})  # fmt: skip
        assert answer.status_code == 200
        assert d.stats()["kv_pull_failures"] == 1 and p.stats()["kv_held"] == 1
        assert p.requests("/kv/pull")[0]["status"] == 401
