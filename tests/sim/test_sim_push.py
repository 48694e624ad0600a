"""The simulator's push family, decode side (docs/simulator.md, "vLLM versions", "Push mode, the decode side")."""

from __future__ import annotations

import json
import socket

import httpx

from narwhal_sim.testing import SimThread

from ..helpers import COMPLETIONS, poll

PUSH = {"kv_transfer_mode": "push"}


def test_a_registration_the_prefill_engine_writes_frees_its_blocks() -> None:
    with SimThread("prefill", speed=0, **PUSH) as p, SimThread("decode", speed=0, **PUSH) as d:
        prefill = httpx.post(p.url + COMPLETIONS, headers={"x-request-id": "pair-1"}, timeout=10, json={
            "prompt": "push me " * 20, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        params = prefill.json()["kv_transfer_params"]
        assert params["transfer_mode"] == "push" and p.stats()["kv_held"] == 1
        keys = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")
        decode = httpx.post(d.url + COMPLETIONS, headers={"x-request-id": "pair-1"}, timeout=10, json={
            "prompt": "push me " * 20, "max_tokens": 2,
            "kv_transfer_params": {"do_remote_prefill": True, **{k: params[k] for k in keys}}})
        assert decode.status_code == 200, decode.text
        assert decode.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # written, not recomputed
        stats = p.stats()
        assert (stats["kv_held"], stats["kv_pushes"], stats["kv_expired"]) == (0, 1, 0)
        assert d.stats()["kv_push_registrations"] == 1


def test_a_registration_nothing_pairs_with_waits_past_its_timeout_until_the_client_leaves() -> None:
    # vLLM's watchdog drops the registration after push_registration_timeout; the request waits on.
    with SimThread("prefill", speed=0, **PUSH) as p, \
            SimThread("decode", speed=0, decoder_kv_blocks_ttl_s=0.2, **PUSH) as d:  # fmt: skip
        body = json.dumps({"prompt": "nobody holds this " * 10, "max_tokens": 2, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_engine_id": p.stats()["engine_id"], "remote_request_id": "nobody",
            "remote_host": "127.0.0.1", "remote_port": p.port, "tp_size": 1}}).encode()
        with socket.create_connection(("127.0.0.1", d.port), timeout=5) as client:
            client.sendall(b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nhost: x\r\nx-request-id: lost\r\n"
                           b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            d.wait_for(lambda s: s["kv_push_registration_timeouts"] == 1, timeout=10)
            assert p.stats()["kv_push_unmatched"] == 1
            assert d.stats()["completions_ok"] == 0  # still waiting: no answer
        poll(lambda: d.stats()["client_gone"] == 1 or None, timeout=10)
