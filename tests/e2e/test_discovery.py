"""Engines that come and go, on real sockets (docs/operate.md): DNS discovery against a real DNS server, and a watched file.

The DNS server (tests/dns_server.py) is authoritative for the test's names
and runs on loopback; Narwhal asks it (``discovery.nameserver``) every
0.1 s. The engines are simulators on loopback addresses of their own
(127.0.0.2, 127.0.0.3...) sharing one port, as the pods of a Kubernetes
headless Service do. While requests run, a decode engine's record is
removed and another's added: no request fails, the removed engine's
requests finish, the prefill engine's KV is all released, and the new
engine gets legs once its probe answered.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_core import api_key_digest
from narwhal_sim.testing import SimThread

from ..dns_server import DnsServer
from ..harness import RouterThread, make_config
from ..helpers import body_for, free_port, keys_file_text, poll

COMPLETIONS = "/v1/completions"


def discovering(journal: Path, **discovery: Any) -> Any:
    mode = "file" if "file" in discovery else "dns"
    return make_config(journal, engine={"discovery": mode}, health={"probe_interval_s": 0.1, "probe_timeout_s": 1.0},
                       discovery={"interval_s": 0.1, **discovery})


def engines_seen(router: RouterThread) -> dict[tuple[str, str], bool]:
    return dict(router.statistics().engine_healthy)


class Traffic:
    """Clients sending completions back to back until stopped; every answer kept."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._pool = ThreadPoolExecutor(clients)
        self._futures = [self._pool.submit(self._client) for _ in range(clients)]

    def _client(self) -> None:
        with httpx.Client(base_url=self.url, timeout=20) as client:
            while not self.stop.is_set():
                try:
                    r = client.post(COMPLETIONS, json=body_for(COMPLETIONS, max_tokens=8))
                    self.statuses.append(r.status_code)
                    if r.status_code != 200:
                        self.errors.append(r.text[:300])
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def finish(self) -> None:
        self.stop.set()
        for future in self._futures:
            future.result(timeout=30)
        self._pool.shutdown()


@pytest.fixture
def loopback_port() -> int:
    return free_port()


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    with DnsServer() as server:
        yield server


def test_dns_discovery_adds_and_drains_decode_engines_during_traffic(
    tmp_path: Path, runtime: str, dns: DnsServer, loopback_port: int,
) -> None:
    port = loopback_port
    dns.set("prefill.narwhal.test", A=["127.0.0.4"])
    dns.set("decode.narwhal.test", A=["127.0.0.2", "127.0.0.3"])
    config = discovering(tmp_path / "journal.jsonl", prefill="prefill.narwhal.test", decode="decode.narwhal.test",
                         port=port, nameserver=dns.nameserver)
    with SimThread(role="prefill", host="127.0.0.4", port=port) as prefill, \
            SimThread(role="decode", host="127.0.0.2", port=port, speed=0.2) as leaving, \
            SimThread(role="decode", host="127.0.0.3", port=port) as staying, \
            SimThread(role="decode", host="127.0.0.5", port=port) as joining, \
            RouterThread(config, runtime) as router:  # fmt: skip
        poll(lambda: httpx.get(f"{router.url}/ready").status_code == 200, what="ready with discovered engines")
        assert set(engines_seen(router)) == {
            (prefill.url, "prefill"), (leaving.url, "decode"), (staying.url, "decode"),
        }
        traffic = Traffic(router.url)
        try:
            # A request running on the engine about to leave.
            poll(lambda: leaving.stats()["running"] > 0, what="a request on the leaving engine")
            dns.set("decode.narwhal.test", A=["127.0.0.3", "127.0.0.5"])
            poll(lambda: (leaving.url, "decode") not in engines_seen(router), what="the leaving engine forgotten")
            served_by_leaving = len(leaving.requests(COMPLETIONS))
            poll(lambda: len(joining.requests(COMPLETIONS)) >= 2, what="legs on the new engine")
            assert engines_seen(router)[(joining.url, "decode")]
            # Its first leg came after its first (successful) health probe.
            first_probe = min(r["seq"] for r in joining.requests("/health") if r["status"] == 200)
            assert min(r["seq"] for r in joining.requests(COMPLETIONS)) > first_probe
        finally:
            traffic.finish()
        assert traffic.errors == [] and traffic.statuses and set(traffic.statuses) == {200}
        # Nothing more went to the engine once it was gone; what ran there finished (no failed request).
        assert len(leaving.requests(COMPLETIONS)) == served_by_leaving > 0
        # Every KV the prefill engine held for Narwhal's requests was pulled or released.
        prefill.wait_for(lambda s: s["kv_held"] == 0, timeout=10)
        # A DNS hiccup keeps the fleet as it is.
        asked = dns.questions
        dns.failing = True
        poll(lambda: dns.questions > asked + 4, what="lookups during the hiccup")
        assert set(engines_seen(router)) == {(prefill.url, "prefill"), (staying.url, "decode"), (joining.url, "decode")}
        assert httpx.post(f"{router.url}{COMPLETIONS}", json=body_for(COMPLETIONS, max_tokens=4)).status_code == 200
        dns.failing = False


def test_srv_records_name_host_and_port(tmp_path: Path, dns: DnsServer) -> None:
    with SimThread(role="decode") as first, SimThread(role="decode") as second:
        dns.set("engine-a.narwhal.test", A=["127.0.0.1"])
        dns.set("_http._tcp.decode.narwhal.test", SRV=[(first.port, "engine-a.narwhal.test")])
        config = discovering(tmp_path / "journal.jsonl", decode="_http._tcp.decode.narwhal.test", record="SRV",
                             nameserver=dns.nameserver)
        with RouterThread(config, "trio") as router:
            poll(lambda: httpx.get(f"{router.url}/ready").status_code == 200, what="ready")
            assert set(engines_seen(router)) == {(first.url, "decode")}
            dns.set("_http._tcp.decode.narwhal.test", SRV=[(second.port, "engine-a.narwhal.test")])
            poll(lambda: set(engines_seen(router)) == {(second.url, "decode")}, what="the second engine alone")
            poll(lambda: httpx.get(f"{router.url}/ready").status_code == 200, what="ready again")
            r = httpx.post(f"{router.url}{COMPLETIONS}", json=body_for(COMPLETIONS, max_tokens=4))
            assert r.status_code == 200 and len(second.requests(COMPLETIONS)) == 1


def test_file_discovery_follows_the_file(tmp_path: Path, runtime: str) -> None:
    listing = tmp_path / "engines.json"
    with SimThread(role="prefill") as prefill, SimThread(role="decode") as first, \
            SimThread(role="decode") as second:  # fmt: skip
        listing.write_text(json.dumps({"prefill": [prefill.url], "decode": [first.url]}))
        config = discovering(tmp_path / "journal.jsonl", file=str(listing))
        with RouterThread(config, runtime) as router:
            poll(lambda: httpx.get(f"{router.url}/ready").status_code == 200, what="ready")
            listing.write_text("not json")  # a bad file keeps the fleet
            listing.write_text(json.dumps({"prefill": [prefill.url], "decode": [second.url]}))
            poll(lambda: set(engines_seen(router)) == {(prefill.url, "prefill"), (second.url, "decode")},
                 what="the file's new fleet")
            poll(lambda: engines_seen(router)[(second.url, "decode")], what="the new engine in rotation")
            r = httpx.post(f"{router.url}{COMPLETIONS}", json=body_for(COMPLETIONS, max_tokens=4))
            assert r.status_code == 200 and len(second.requests(COMPLETIONS)) == 1
            prefill.wait_for(lambda s: s["kv_held"] == 0, timeout=10)


def test_admin_api_with_and_without_its_key(tmp_path: Path, runtime: str) -> None:
    admin_key, client_key = "sk-admin-" + "7" * 24, "sk-client-" + "3" * 24
    keys = tmp_path / "keys.toml"
    keys.write_text(keys_file_text({"alice": client_key})
                    + f'[[keys]]\nclient = "ops"\nrole = "admin"\nsha256 = "{api_key_digest(admin_key)}"\n')
    with SimThread(role="decode") as first, SimThread(role="decode") as second:
        config = make_config(tmp_path / "journal.jsonl", decode=(first.url,),
                             ingress={"auth": "api_keys", "api_keys_file": str(keys)},
                             health={"probe_interval_s": 0.1, "probe_timeout_s": 1.0})
        with RouterThread(config, runtime) as router:
            url = f"{router.url}/admin/engines"
            as_admin = {"authorization": f"Bearer {admin_key}"}
            for headers in ({}, {"authorization": f"Bearer {client_key}"}, {"authorization": "Bearer sk-nope"}):
                r = httpx.get(url, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert admin_key not in r.text and client_key not in r.text
            r = httpx.post(url, headers=as_admin, json={"url": second.url, "phase": "decode"})
            assert r.status_code == 201 and r.json()["state"] == "joining"
            r = httpx.request("DELETE", url, headers=as_admin, json={"url": first.url, "phase": "decode"})
            assert r.status_code == 200
            poll(lambda: [(e["url"], e["state"]) for e in httpx.get(url, headers=as_admin).json()["data"]]
                 == [(second.url, "in rotation")], what="the new engine alone, in rotation")
            r = httpx.post(f"{router.url}{COMPLETIONS}", json=body_for(COMPLETIONS, max_tokens=4),
                           headers={"authorization": f"Bearer {client_key}"})
            assert r.status_code == 200 and len(second.requests(COMPLETIONS)) == 1
            assert len(first.requests(COMPLETIONS)) == 0
            assert admin_key not in (tmp_path / "journal.jsonl").read_text()


def test_admin_api_is_off_without_an_admin_key(tmp_path: Path) -> None:
    with SimThread(role="decode") as engine, \
            RouterThread(make_config(tmp_path / "journal.jsonl", decode=(engine.url,)), "asyncio") as router:
        r = httpx.get(f"{router.url}/admin/engines", headers={"authorization": "Bearer anything"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
