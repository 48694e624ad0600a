"""The simulator's push family, decode side (docs/simulator.md, "vLLM versions", "Push mode, the decode side")."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from narwhal_sim import kv_pull
from narwhal_sim.testing import SimThread

from ..helpers import COMPLETIONS, poll

PUSH = {"kv_transfer_mode": "push"}
PROMPT = "early bird " * 20


def early_decode_body(p: SimThread, prompt: str = PROMPT) -> dict[str, Any]:
    """A push decode leg naming the prefill engine's coordinates, sent before its prefill leg exists.

    ``remote_request_id`` is any string: vLLM's decode side needs the key (``add_new_req_to_recv``)
    but pairs by its own request ID, not by it.
    """
    return {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": p.stats()["engine_id"], "remote_request_id": "not-yet",
        "remote_host": "127.0.0.1", "remote_port": p.port, "tp_size": 1}}


def send_raw(port: int, rid: str, body: dict[str, Any]) -> socket.socket:
    """A decode leg on a socket of its own, left open (the test closes it: the client leaving)."""
    data = json.dumps(body).encode()
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    client.sendall(b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nhost: x\r\nx-request-id: " + rid.encode()
                   + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
    return client


def prefill(p: SimThread, rid: str, prompt: str = PROMPT) -> dict[str, Any]:
    answer = httpx.post(p.url + COMPLETIONS, headers={"x-request-id": rid}, timeout=10, json={
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["kv_transfer_params"])


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
            assert p.stats()["kv_push_parked"] == 1  # parked on the prefill engine, never paired
            assert d.stats()["completions_ok"] == 0  # still waiting: no answer
        poll(lambda: d.stats()["client_gone"] == 1 or None, timeout=10)


def test_a_registration_before_its_prefill_is_parked_and_written_when_the_prefill_is_held() -> None:
    # push_worker.py's _handle_push_reg_notif parks it; _pop_matching_registration pairs it with
    # the prefill request when that finishes (suffixes stripped from both engines' IDs).
    with SimThread("prefill", speed=0, **PUSH) as p, SimThread("decode", speed=0, **PUSH) as d, \
            ThreadPoolExecutor(1) as pool:  # fmt: skip
        decode = pool.submit(httpx.post, d.url + COMPLETIONS, json=early_decode_body(p),
                             headers={"x-request-id": "early-1"}, timeout=10)  # fmt: skip
        p.wait_for(lambda s: s["kv_push_parked"] == 1, timeout=10)
        assert not decode.done() and d.stats()["completions_ok"] == 0  # waiting for the write
        prefill(p, "early-1")
        answer = decode.result(timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # written, not recomputed
        stats = p.wait_for(lambda s: s["kv_held"] == 0, timeout=10)
        assert (stats["kv_pushes"], stats["kv_push_parked_paired"], stats["kv_push_unmatched"]) == (1, 1, 0)
        assert (stats["kv_expired"], d.stats()["kv_push_registration_timeouts"]) == (0, 0)


def test_a_write_after_the_registration_timeout_still_completes_the_request() -> None:
    # The watchdog (push_scheduler.py, build_connector_meta) drops only the registration: the
    # receive stays tracked, so a late write still finishes the request.
    with SimThread("prefill", speed=0, **PUSH) as p, \
            SimThread("decode", speed=0, decoder_kv_blocks_ttl_s=0.1, **PUSH) as d, \
            ThreadPoolExecutor(1) as pool:  # fmt: skip
        decode = pool.submit(httpx.post, d.url + COMPLETIONS, json=early_decode_body(p),
                             headers={"x-request-id": "late-1"}, timeout=10)  # fmt: skip
        d.wait_for(lambda s: s["kv_push_registration_timeouts"] == 1, timeout=10)
        prefill(p, "late-1")
        answer = decode.result(timeout=10)
        assert answer.status_code == 200, answer.text
        assert p.wait_for(lambda s: s["kv_held"] == 0, timeout=10)["kv_pushes"] == 1


def test_a_parked_registration_whose_decode_left_is_still_written_and_frees_the_blocks() -> None:
    # vLLM's prefill side is not told the decode request ended: it writes, then frees its blocks.
    with SimThread("prefill", speed=0, **PUSH) as p, SimThread("decode", speed=0, **PUSH) as d:
        client = send_raw(d.port, "gone-1", early_decode_body(p))
        p.wait_for(lambda s: s["kv_push_parked"] == 1, timeout=10)
        client.close()
        d.wait_for(lambda s: s["client_gone"] == 1, timeout=10)
        prefill(p, "gone-1")
        stats = p.wait_for(lambda s: s["kv_held"] == 0, timeout=10)
        assert (stats["kv_pushes"], stats["kv_push_parked_paired"], stats["kv_expired"]) == (1, 1, 0)


def test_parked_registrations_past_the_bound_answer_the_oldest_404(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_pull, "MAX_PARKED_PUSHES", 1)
    with SimThread("prefill", speed=0, **PUSH) as p, SimThread("decode", speed=0, **PUSH) as d:
        first = send_raw(d.port, "first", early_decode_body(p, "first " * 20))
        p.wait_for(lambda s: s["kv_push_parked"] == 1, timeout=10)
        second = send_raw(d.port, "second", early_decode_body(p, "second " * 20))
        p.wait_for(lambda s: s["kv_push_parked"] == 2 and s["kv_push_unmatched"] == 1, timeout=10)
        prefill(p, "second", "second " * 20)  # the one still parked is written
        assert p.wait_for(lambda s: s["kv_held"] == 0, timeout=10)["kv_push_parked_paired"] == 1
        d.wait_for(lambda s: s["completions_ok"] == 1, timeout=10)  # the second is answered
        assert d.stats()["kv_push_registration_timeouts"] == 0 and p.stats()["kv_pushes"] == 1  # the first waits
        first.close()
        second.close()


def test_a_lost_registration_leaves_the_blocks_to_the_lease_and_the_request_to_its_client() -> None:
    # The push_reg_lost fault (push_worker.py, _do_send_reg_notif: push_reg_notif_failed is logged
    # and the receive kept pending): nothing is written; the prefill's lease frees its blocks.
    with SimThread("prefill", speed=0, lease_s=0.2, **PUSH) as p, \
            SimThread("decode", speed=0, faults={"push_reg_lost_rate": 1.0}, **PUSH) as d:  # fmt: skip
        params = prefill(p, "lost-1")
        keys = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")
        body = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True,
                                                                         **{k: params[k] for k in keys}}}  # fmt: skip
        client = send_raw(d.port, "lost-1", body)
        d.wait_for(lambda s: s["faults_push_reg_lost"] == 1, timeout=10)
        stats = p.wait_for(lambda s: s["kv_expired"] == 1, timeout=10)
        assert (stats["kv_pushes"], stats["kv_push_parked"], d.stats()["kv_push_registrations"]) == (0, 0, 0)
        assert d.stats()["completions_ok"] == 0
        client.close()
        d.wait_for(lambda s: s["client_gone"] == 1, timeout=10)
