"""``narwhal sim --vllm-version``: each rule of docs/simulator.md ("vLLM versions") against every family."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

from narwhal_sim.cli import build_parser, config_from_args
from narwhal_sim.server import SimConfig
from narwhal_sim.testing import SimThread
from narwhal_sim.versions import DEFAULT_FAMILY, FAMILIES, VllmFamily, family_for, resolve_version

from ..helpers import MODEL
from .helpers import PROMPT, connect, decode_body, json_request, prefill_body

FAMILY_NAMES = list(FAMILIES)


@pytest.fixture(params=FAMILY_NAMES)
def family(request: pytest.FixtureRequest) -> VllmFamily:
    return FAMILIES[request.param]


def prefill(client: httpx.Client, url: str, rid: str, **extra: Any) -> httpx.Response:
    answer = client.post(url + "/v1/completions", json=prefill_body(**extra), headers={"X-Request-Id": rid})
    assert answer.status_code == 200, answer.text
    return answer


# ---------------------------------------------------------------------------- version strings


@pytest.mark.parametrize(
    ("version", "name"),
    [
        ("0.9", "0.9"), ("0.9.2", "0.9"), ("0.10.0", "0.9"), ("0.10.1", "0.10"), ("0.10.2", "0.10"),
        ("0.11.0", "0.10"), ("0.11.1", "0.11"), ("0.11", "0.11"), ("0.13.0", "0.11"), ("0.14.1", "0.14"),
        ("v0.16.0", "0.14"), ("0.17.1", "0.18"), ("0.18.0rc1", "0.18"), ("0.20.2", "0.18"), ("0.21.0", "lease"),
        ("0.27.1", "lease"), ("v0.27.9rc2", "lease"), ("lease", "lease"),
        ("0.28.0", "0.28"), ("0.29.0", "0.28"), ("0.33.0", "0.28"), ("1.0.0", "0.28"), ("0.28", "0.28"),
    ],
)  # fmt: skip
def test_a_release_maps_to_its_family(version: str, name: str) -> None:
    assert family_for(version).name == name


def test_bad_versions_are_refused_with_the_accepted_forms() -> None:
    for bad in ("latest", "0", "zero.14", ""):
        with pytest.raises(ValueError, match="family .* or a vLLM release like 0.14.1"):
            family_for(bad)
    args = build_parser().parse_args(["--vllm-version", "nope"])
    with pytest.raises(ValueError, match="--vllm-version"):
        config_from_args(args)


def test_default_is_the_newest_family_and_version_reports_the_string(client: httpx.Client) -> None:
    assert DEFAULT_FAMILY == "0.28" and resolve_version(None) == (FAMILIES["0.28"], "0.33.0")
    assert config_from_args(build_parser().parse_args([])).vllm_version is None  # the command line's default
    config = config_from_args(build_parser().parse_args(["--vllm-version", "0.14.1"]))
    assert config.vllm_version == "0.14.1"
    with SimThread("prefill", speed=0, vllm_version="0.14.1") as p:
        answer = client.get(p.url + "/version")
        assert answer.status_code == 200 and answer.json() == {"version": "0.14.1"}
        assert p.stats()["vllm_family"] == "0.14"
    with SimThread("prefill", speed=0) as p:
        assert client.get(p.url + "/version").json() == {"version": "0.33.0"}
        assert p.stats()["vllm_family"] == "0.28"


# ---------------------------------------------------------------------------- routes


def test_routes_exist_as_in_vllm(client: httpx.Client, family: VllmFamily) -> None:
    with SimThread("prefill", speed=0, vllm_version=family.name, abort_request_route=False) as p:
        prefill(client, p.url, "r1")
        # SGLang's route: never on vLLM.
        assert client.post(p.url + "/abort_request", json={"rid": "cmpl-r1-0"}).status_code == 404
        # /abort_requests only with --tokens-only (or dev mode).
        assert client.post(p.url + "/abort_requests", json={"request_ids": ["cmpl-r1-0"]}).status_code == 404
        assert p.stats()["kv_held"] == 1
    with SimThread("prefill", speed=0, vllm_version=family.name, tokens_only=True) as p:
        kv = prefill(client, p.url, "r2").json()["kv_transfer_params"]
        answer = client.post(p.url + "/abort_requests", json={"request_ids": ["cmpl-r2-0", kv.get("remote_request_id")]})
        if not family.abort_requests_route:
            assert answer.status_code == 404
            return
        # Fire and forget: 200, empty body; a finished prefill's held blocks are no live request.
        assert answer.status_code == 200 and answer.content == b""
        stats = p.stats()
        assert (stats["kv_held"], stats["kv_released"], stats["aborted"]) == (1, 0, 0)
        missing = client.post(p.url + "/abort_requests", json={})
        assert missing.status_code == 400 and "Missing 'request_ids'" in missing.text


#: The families whose servers offer ``/abort_requests`` (the others answer 404: tested above).
WITH_ABORT_REQUESTS = [name for name, f in FAMILIES.items() if f.abort_requests_route]


@pytest.mark.parametrize("family", WITH_ABORT_REQUESTS, indirect=True)
def test_abort_requests_aborts_a_live_request_by_its_external_id(client: httpx.Client, family: VllmFamily) -> None:
    with SimThread("mixed", speed=1, vllm_version=family.name, dev_mode=True) as e, \
            httpx.Client(timeout=10.0) as other:  # fmt: skip
        sock = connect(e.port)
        sock.sendall(json_request("/v1/completions", {"prompt": PROMPT, "max_tokens": 2000}, {"X-Request-Id": "long"}))
        e.wait_for(lambda s: s["running"] == 1)
        answer = other.post(e.url + "/abort_requests", json={"request_ids": ["cmpl-long-0"]})
        assert answer.status_code == 200 and answer.json() == {"status": "aborted", "aborted": 1}
        stats = e.wait_for(lambda s: s["running"] == 0 and s["aborted"] == 1)
        assert stats["free_blocks"] == stats["total_blocks"] - stats["kv_held_blocks"]
        sock.close()


# ---------------------------------------------------------------------------- IDs and params


def expected_keys(family: VllmFamily) -> list[str]:
    keys = ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id"]
    if family.connector >= 2:
        keys.append("remote_request_id")
    keys += ["remote_host", "remote_port", "tp_size"]
    if family.lease_keys:
        keys += ["dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode"]
    return keys


def test_prefill_answer_shape_and_request_ids(client: httpx.Client, family: VllmFamily) -> None:
    with SimThread("prefill", speed=0, vllm_version=family.name, seed=7) as p, \
            SimThread("prefill", speed=0, vllm_version=family.name, seed=7) as twin:  # fmt: skip
        body = prefill(client, p.url, "abc").json()
        assert body["id"] == "cmpl-abc"  # the response id: no index, no suffix
        kv = body["kv_transfer_params"]
        assert list(kv) == expected_keys(family)
        blocks = kv["remote_block_ids"]
        if family.block_groups:
            assert len(blocks) == 1 and len(blocks[0]) == 4  # one list per KV-cache group
        else:
            assert len(blocks) == 4 and all(type(b) is int for b in blocks)
        if family.lease_keys:
            assert (kv["dcp_size"], kv["pp_size"], kv["remote_num_tokens"]) == (1, 1, 50)
            assert kv["remote_blocks_expiry_time"] is None and kv["transfer_mode"] == "pull"
        (record,) = p.requests("/v1/completions")
        owner = record["kv"]["owner"]
        if family.request_id_suffix:
            assert re.fullmatch(r"cmpl-abc-0-[0-9a-f]{8}", owner)
            # Deterministic from the seed: the same request on a twin engine gets the same suffix.
            assert prefill(client, twin.url, "abc").json()["kv_transfer_params"]["remote_request_id"] == owner
        else:
            assert owner == "cmpl-abc-0"
        if family.connector >= 2:
            assert kv["remote_request_id"] == owner
        chat = client.post(p.url + "/v1/chat/completions", headers={"X-Request-Id": "xyz"}, json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1,
            "kv_transfer_params": prefill_body()["kv_transfer_params"]})  # fmt: skip
        assert chat.json()["id"] == "chatcmpl-xyz"
        chat_owner = p.requests("/v1/chat/completions")[0]["kv"]["owner"]
        pattern = r"chatcmpl-xyz-[0-9a-f]{8}" if family.request_id_suffix else r"chatcmpl-xyz"
        assert re.fullmatch(pattern, chat_owner)


def test_default_remote_host_is_localhost(client: httpx.Client, family: VllmFamily) -> None:
    with SimThread("prefill", speed=0, vllm_version=family.name, advertise_host=None) as p:
        assert prefill(client, p.url, "h1").json()["kv_transfer_params"]["remote_host"] == "localhost"
    with SimThread("prefill", speed=0, vllm_version=family.name, advertise_host="10.0.0.7") as p:
        assert prefill(client, p.url, "h2").json()["kv_transfer_params"]["remote_host"] == "10.0.0.7"
    assert config_from_args(build_parser().parse_args([])).advertise_host is None  # the command line: localhost


def test_push_mode_answers_the_push_schedulers_shape(client: httpx.Client) -> None:
    """--kv-transfer-mode push: the prefill answer's params as vLLM's push scheduler writes them (lease family only)."""
    with SimThread("prefill", speed=0, kv_transfer_mode="push") as p:
        kv = prefill(client, p.url, "push1").json()["kv_transfer_params"]
        assert list(kv) == [
            "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
            "remote_host", "remote_port", "tp_size", "pp_size", "remote_num_tokens", "transfer_mode",
        ]
        assert kv["transfer_mode"] == "push" and p.stats()["kv_held"] == 1
    assert config_from_args(build_parser().parse_args(["--kv-transfer-mode", "push"])).kv_transfer_mode == "push"
    with pytest.raises(ValueError, match="kv_transfer_mode push needs the lease family"):
        SimConfig(vllm_version="0.18", kv_transfer_mode="push").check()
    with pytest.raises(ValueError, match="kv_transfer_mode must be pull or push"):
        SimConfig(kv_transfer_mode="both").check()


@pytest.mark.parametrize("same_ids", [True, False])
def test_which_decode_frees_the_prefill_blocks(client: httpx.Client, family: VllmFamily, same_ids: bool) -> None:
    """Connector 1 frees only when the decode leg's request ID is the prefill's; connector 2 by remote_request_id."""
    with SimThread("prefill", speed=0, vllm_version=family.name) as p, \
            SimThread("decode", speed=0, vllm_version=family.name) as d:  # fmt: skip
        kv = prefill(client, p.url, "same").json()["kv_transfer_params"]
        rid = "same" if same_ids else "other-d1"
        answer = client.post(d.url + "/v1/completions", json=decode_body(kv, max_tokens=4), headers={"X-Request-Id": rid})
        assert answer.status_code == 200
        # The data was read either way: the decode counts the prompt as cached.
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 50
        stats = p.stats()
        freed = family.connector >= 2 or (same_ids and not family.request_id_suffix)
        if freed:
            assert (stats["kv_held"], stats["kv_pulled"], stats["kv_notifs_unrecognized"]) == (0, 1, 0)
        else:
            # "unrecognized request": held until the timeout
            assert (stats["kv_held"], stats["kv_pulled"], stats["kv_notifs_unrecognized"]) == (1, 0, 1)
            assert stats["kv_lease_s"] == family.hold_s


# ---------------------------------------------------------------------------- holds and leases


def test_hold_timeout_per_family(client: httpx.Client, family: VllmFamily) -> None:
    with SimThread("prefill", speed=0, vllm_version=family.name) as p:
        assert p.stats()["kv_lease_s"] == family.hold_s == {"0.9": 120, "0.10": 120, "0.11": 480, "0.14": 480,
                                                              "0.18": 480, "lease": 30, "0.28": 30}[family.name]  # fmt: skip
    with SimThread("prefill", speed=0, vllm_version=family.name, lease_s=0.2) as p:
        prefill(client, p.url, "t1")
        stats = p.wait_for(lambda s: s["kv_expired"] == 1, timeout=5)
        assert stats["kv_held"] == 0


def occupy_the_slot(d: SimThread) -> Any:
    d.set_faults(stall_after_chunks=0)
    blocker = connect(d.port)
    blocker.sendall(json_request("/v1/completions", {"prompt": "busy"}))
    d.wait_for(lambda s: s["running"] == 1)
    d.set_faults()
    return blocker


def test_lease_is_renewed_while_the_decode_request_is_queued(client: httpx.Client, family: VllmFamily) -> None:
    lease = 0.5
    with SimThread("prefill", speed=50, vllm_version=family.name, lease_s=lease) as p, \
            SimThread("decode", speed=50, vllm_version=family.name, lease_s=lease, max_num_seqs=1) as d:  # fmt: skip
        blocker = occupy_the_slot(d)
        kv = prefill(client, p.url, "queued").json()["kv_transfer_params"]
        sock = connect(d.port)
        sock.sendall(json_request("/v1/completions", decode_body(kv, max_tokens=4), {"X-Request-Id": "queued"}))
        d.wait_for(lambda s: s["waiting"] == 1)
        if family.lease_renewal:
            time.sleep(3 * lease)  # three leases long, renewed all along
            stats = p.stats()
            assert (stats["kv_held"], stats["kv_expired"]) == (1, 0)
            assert d.stats()["kv_heartbeats"] >= 2
        else:
            # Unrenewed, the KV expires one lease after its prefill (a renewal would keep it held: no expiry).
            stats = p.wait_for(lambda s: s["kv_expired"] >= 1, timeout=10 * lease)
            assert (stats["kv_held"], stats["kv_expired"]) == (0, 1)
            assert d.stats()["kv_heartbeats"] == 0
        blocker.close()
        ds = d.wait_for(lambda s: s["running"] == 0 and s["waiting"] == 0 and s["completions_ok"] == 1)
        # The late pull still reads the freed blocks: a stale read nobody is told of (vLLM issue 21570).
        stale = 0 if family.lease_renewal else 1
        assert (ds["kv_pulls"], ds["kv_stale_reads"], p.stats()["kv_stale_reads"]) == (1, stale, stale)
        sock.close()


def test_a_pull_after_the_hold_reads_stale_kv_and_answers_normally(client: httpx.Client, family: VllmFamily) -> None:
    """vLLM does not refuse a late READ: the decode engine answers 200 on blocks freed at the hold's end."""
    with SimThread("prefill", speed=0, vllm_version=family.name, lease_s=0.2) as p, \
            SimThread("decode", speed=0, vllm_version=family.name, kv_pull_grace_ms=0) as d:  # fmt: skip
        kv = prefill(client, p.url, "late").json()["kv_transfer_params"]
        p.wait_for(lambda s: s["kv_expired"] == 1, timeout=5)
        answer = client.post(d.url + "/v1/completions", json=decode_body(kv, max_tokens=3),
                             headers={"X-Request-Id": "late"})  # fmt: skip
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
        assert (d.stats()["kv_stale_reads"], d.stats()["kv_pull_failures"], p.stats()["kv_stale_reads"]) == (1, 0, 1)
        assert d.requests("/v1/completions")[0]["kv"]["stale_read"] is True
        assert p.requests("/v1/completions")[0]["kv"]["stale_read"] is True
        pull = p.requests("/kv/pull")[0]
        assert pull["status"] == 200


def test_the_lease_reaper_keeps_entries_behind_a_renewed_one(client: httpx.Client, family: VllmFamily) -> None:
    """vLLM issue 58222 (lease family): the reaper stops at the first unexpired entry."""
    lease = 0.3
    with SimThread("prefill", speed=0, vllm_version=family.name, lease_s=lease) as p:
        first = prefill(client, p.url, "head").json()["kv_transfer_params"]
        prefill(client, p.url, "behind")
        owner = first.get("remote_request_id") or "none"
        deadline = time.monotonic() + 3 * lease
        while time.monotonic() < deadline:  # heartbeats for the head only, as a decode engine sends them
            client.post(p.url + "/kv/heartbeat", json={"remote_request_ids": [owner]})
            time.sleep(lease / 6)
        stats = p.stats()
        if family.reaper_stops_at_first_live:
            assert (stats["kv_held"], stats["kv_expired"]) == (2, 0)  # "behind" ran out long ago, still held
        else:
            assert stats["kv_expired"] >= 1 and stats["kv_held"] <= 1


# ---------------------------------------------------------------------------- dropped decode requests


def test_client_gone_while_queued_frees_by_the_connector_rule(client: httpx.Client, family: VllmFamily) -> None:
    """Reached the decode engine, then the client left: the decode engine notifies (PR #19223)."""
    with SimThread("prefill", speed=50, vllm_version=family.name) as p, \
            SimThread("decode", speed=50, vllm_version=family.name, max_num_seqs=1) as d:  # fmt: skip
        blocker = occupy_the_slot(d)
        for rid in ("gone", "gone-d1"):
            kv = prefill(client, p.url, rid if rid == "gone" else "gone-p1").json()["kv_transfer_params"]
            sock = connect(d.port)
            sock.sendall(json_request("/v1/completions", decode_body(kv, max_tokens=4), {"X-Request-Id": rid}))
            d.wait_for(lambda s: s["waiting"] == 1)
            sock.close()
            d.wait_for(lambda s: s["waiting"] == 0 and s["kv_releases_sent"] >= 1)
        # Same leg IDs ("gone"): freed everywhere but where the suffix makes IDs differ under connector 1;
        # different leg IDs: freed only with connector 2.
        expected = 2 if family.connector >= 2 else 1
        stats = p.wait_for(lambda s: s["kv_released"] + s["kv_notifs_unrecognized"] == 2)
        assert stats["kv_released"] == expected and stats["kv_held"] == 2 - expected
        blocker.close()


def test_refused_before_admission_frees_only_in_the_lease_family(client: httpx.Client, family: VllmFamily) -> None:
    with SimThread("prefill", speed=0, vllm_version=family.name) as p, \
            SimThread("decode", speed=0, vllm_version=family.name) as d:  # fmt: skip
        kv = prefill(client, p.url, "rej").json()["kv_transfer_params"]
        answer = client.post(d.url + "/v1/completions", json=decode_body(kv, max_tokens=0))
        assert answer.status_code == 400
        if family.notify_on_rejection:
            assert p.wait_for(lambda s: s["kv_released"] == 1)["kv_held"] == 0
        else:
            time.sleep(0.1)
            assert (p.stats()["kv_held"], p.stats()["kv_released"]) == (1, 0)


# ---------------------------------------------------------------------------- incomplete params


@pytest.mark.parametrize("drop", ["remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                                  "remote_block_ids"])  # fmt: skip
def test_incomplete_params_are_refused(client: httpx.Client, family: VllmFamily, drop: str) -> None:
    with SimThread("prefill", speed=0, vllm_version=family.name) as p, \
            SimThread("decode", speed=0, vllm_version=family.name) as d:  # fmt: skip
        kv = prefill(client, p.url, "inc").json()["kv_transfer_params"]
        if drop == "remote_request_id" and family.connector == 1:
            kv["remote_request_id"] = None  # connector 1 never reads it: still complete
            assert client.post(d.url + "/v1/completions", json=decode_body(kv, max_tokens=4)).status_code == 200
            return
        kv.pop(drop, None)
        answer = client.post(d.url + "/v1/completions", json=decode_body(kv, max_tokens=4))
        assert answer.status_code == 400
        error = answer.json() if family.nested_errors else {"error": answer.json()}
        assert error["error"]["param"] == "kv_transfer_params" and drop in error["error"]["message"]
        assert d.stats()["kv_params_invalid"] == 1


def test_incomplete_params_can_crash_the_engine(client: httpx.Client, family: VllmFamily) -> None:
    with SimThread("decode", speed=0, vllm_version=family.name, incomplete_kv_params="crash") as d:
        kv = {"do_remote_prefill": True, "remote_block_ids": [[1]] if family.block_groups else [1]}
        assert client.post(d.url + "/v1/completions", json=decode_body(kv, max_tokens=4)).status_code == 500
        # Dead: every later completion fails too.
        assert client.post(d.url + "/v1/completions", json={"prompt": "hi"}).status_code == 500


# ---------------------------------------------------------------------------- answers


def test_error_body_shape(client: httpx.Client, family: VllmFamily) -> None:
    with SimThread("mixed", speed=0, vllm_version=family.name) as e:
        answer = client.post(e.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0})
        assert answer.status_code == 400
        body = answer.json()
        if family.nested_errors:
            assert set(body) == {"error"}
            error = body["error"]
        else:
            assert body["object"] == "error"
            error = body
        assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == "max_tokens"


def test_prompt_tokens_details_only_with_the_flag(client: httpx.Client, family: VllmFamily) -> None:
    with SimThread("mixed", speed=0, vllm_version=family.name, enable_prompt_tokens_details=False) as e:
        whole = client.post(e.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
        assert "prompt_tokens_details" in whole["usage"] and whole["usage"]["prompt_tokens_details"] is None
        streamed = client.post(e.url + "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}).text
        usage = [json.loads(line[6:]) for line in streamed.splitlines()
                 if line.startswith("data: {") and '"usage"' in line][-1]["usage"]  # fmt: skip
        assert "prompt_tokens_details" not in usage and usage["prompt_tokens"] == 50
    with SimThread("mixed", speed=0, vllm_version=family.name, enable_prompt_tokens_details=True) as e:
        whole = client.post(e.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
        assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_a_prefill_that_stops_hands_off_by_family(client: httpx.Client, family: VllmFamily) -> None:
    """FINISHED_STOPPED: null params and nothing held before the lease; held like any other after."""
    with SimThread("prefill", speed=0, vllm_version=family.name, faults={"eos_rate": 1.0}) as p:
        body = prefill(client, p.url, "eos").json()
        assert body["choices"][0]["finish_reason"] == "stop"
        if family.null_params_on_stop:
            assert body["kv_transfer_params"] is None
            assert p.stats()["kv_held"] == 0 and p.stats()["free_blocks"] == p.stats()["total_blocks"]
        else:
            assert body["kv_transfer_params"] is not None and p.stats()["kv_held"] == 1
        # min_tokens >= 1 forbids the end of sequence as the first token.
        body = prefill(client, p.url, "eos-min", min_tokens=1).json()
        assert body["choices"][0]["finish_reason"] == "length" and body["kv_transfer_params"] is not None


# ---------------------------------------------------------------------------- races and faults (H8's needs)


def test_a_client_gone_before_admission_frees_only_in_the_lease_family(client: httpx.Client,
                                                                       family: VllmFamily) -> None:  # fmt: skip
    """The disconnect wins the race: the request never reached the decode engine (PR 41269 for the notice)."""
    with SimThread("prefill", speed=0, vllm_version=family.name) as p, \
            SimThread("decode", speed=0, vllm_version=family.name, pre_admission_ms=300) as d:  # fmt: skip
        kv = prefill(client, p.url, "race").json()["kv_transfer_params"]
        sock = connect(d.port)
        sock.sendall(json_request("/v1/completions", decode_body(kv, max_tokens=4), {"X-Request-Id": "race"}))
        sock.close()
        ds = d.wait_for(lambda s: s["client_gone"] == 1)
        assert ds["kv_pulls"] == 0 and ds["running"] == 0 and ds["waiting"] == 0
        if family.notify_on_rejection:
            assert p.wait_for(lambda s: s["kv_released"] == 1)["kv_held"] == 0
        else:
            time.sleep(0.1)
            assert (p.stats()["kv_held"], p.stats()["kv_released"]) == (1, 0)


def test_an_sglang_style_bare_abort_route(client: httpx.Client) -> None:
    with SimThread("prefill", speed=0, abort_request_route="bare") as p:
        prefill(client, p.url, "bare")
        owner = p.requests("/v1/completions")[0]["kv"]["owner"]
        answer = client.post(p.url + "/abort_request", json={"rid": owner})
        assert answer.status_code == 200 and answer.content == b""
        assert p.stats()["kv_released"] == 1
    args = build_parser().parse_args(["--abort-request-route"])
    assert config_from_args(args).abort_request_route == "json"
    assert config_from_args(build_parser().parse_args([])).abort_request_route is False


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_pull_leaves_the_blocks_held(client: httpx.Client, family: VllmFamily, policy: str) -> None:
    with SimThread("prefill", speed=0, vllm_version=family.name) as p, \
            SimThread("decode", speed=0, vllm_version=family.name, kv_load_failure=policy,
                      faults={"pull_fail_rate": 1.0}) as d:  # fmt: skip
        kv = prefill(client, p.url, "pf").json()["kv_transfer_params"]
        answer = client.post(d.url + "/v1/completions", json=decode_body(kv, max_tokens=4), headers={"X-Request-Id": "pf"})
        if policy == "recompute":
            assert answer.status_code == 200  # 2xx, yet the prefill engine was never told
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        else:
            assert answer.status_code == 500
        assert d.stats()["kv_pull_failures"] == 1 and p.requests("/kv/pull") == []
        assert (p.stats()["kv_held"], p.stats()["kv_pulled"]) == (1, 0)


# ---------------------------------------------------------------------------- bidirectional transfer (0.28 on)


def test_a_bidirectional_decode_engine_answers_and_holds_its_own_kv(client: httpx.Client, family: VllmFamily) -> None:
    """``bidirectional_kv_xfer``: the decode answer names the decode engine's blocks, held for their TTL."""
    if not family.bidirectional_expiry:
        with pytest.raises(ValueError, match="bidirectional_kv is modelled from the 0.28 family on"):
            SimThread("decode", speed=0, vllm_version=family.name, bidirectional_kv=True).start()
        return
    with SimThread("prefill", speed=0, vllm_version=family.name) as p, \
            SimThread("decode", speed=0, vllm_version=family.name, bidirectional_kv=True,
                      decoder_kv_blocks_ttl_s=0.4) as d:  # fmt: skip
        kv = prefill(client, p.url, "bi").json()["kv_transfer_params"]
        answer = client.post(d.url + "/v1/completions", json=decode_body(kv, max_tokens=6),
                             headers={"X-Request-Id": "bi"})  # fmt: skip
        assert answer.status_code == 200, answer.text
        own = answer.json()["kv_transfer_params"]
        assert list(own) == expected_keys(family)
        assert (own["do_remote_prefill"], own["do_remote_decode"]) == (False, True)
        assert re.fullmatch(r"cmpl-bi-0-[0-9a-f]{8}", own["remote_request_id"])  # the decode engine's request ID
        assert own["remote_engine_id"] == d.stats()["engine_id"] and own["remote_port"] == d.port
        # 50 prompt tokens and 6 sampled (the last one's KV never computed): 4 blocks of 16.
        assert own["remote_num_tokens"] == 55 and len(own["remote_block_ids"][0]) == 4
        assert isinstance(own["remote_blocks_expiry_time"], float)
        stats = d.stats()
        assert (stats["decoder_kv_held"], stats["decoder_kv_held_blocks"]) == (1, 4)
        assert stats["free_blocks"] == stats["total_blocks"] - 4
        # A streamed decode holds its blocks the same way; nobody reads them, so they expire.
        kv = prefill(client, p.url, "bi-s").json()["kv_transfer_params"]
        streamed = client.post(d.url + "/v1/completions", json=decode_body(kv, max_tokens=6, stream=True),
                               headers={"X-Request-Id": "bi-s"})  # fmt: skip
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert d.stats()["decoder_kv_held"] == 2
        stats = d.wait_for(lambda s: s["decoder_kv_expired"] == 2, timeout=5)
        assert stats["decoder_kv_held"] == 0 and stats["free_blocks"] == stats["total_blocks"]
        assert p.stats()["kv_pulled"] == 2  # the prefill engine's own KV was pulled as ever


def test_without_bidirectional_transfer_a_decode_answer_holds_nothing(client: httpx.Client, family: VllmFamily) -> None:
    with SimThread("prefill", speed=0, vllm_version=family.name) as p, \
            SimThread("decode", speed=0, vllm_version=family.name) as d:  # fmt: skip
        kv = prefill(client, p.url, "plain").json()["kv_transfer_params"]
        answer = client.post(d.url + "/v1/completions", json=decode_body(kv), headers={"X-Request-Id": "plain"})
        assert answer.status_code == 200 and answer.json()["kv_transfer_params"] is None
        stats = d.stats()
        assert stats["decoder_kv_held"] == 0 and stats["free_blocks"] == stats["total_blocks"]


def test_the_bidirectional_options_on_the_command_line() -> None:
    args = build_parser().parse_args(["--bidirectional-kv", "--decoder-kv-blocks-ttl", "60"])
    config = config_from_args(args)
    assert (config.bidirectional_kv, config.decoder_kv_blocks_ttl_s) == (True, 60.0)
    defaults = config_from_args(build_parser().parse_args([]))
    assert (defaults.bidirectional_kv, defaults.decoder_kv_blocks_ttl_s) == (False, 480.0)  # vLLM's default TTL
    with pytest.raises(ValueError, match="bidirectional_kv is modelled from the 0.28 family on, not lease"):
        config_from_args(build_parser().parse_args(["--bidirectional-kv", "--vllm-version", "0.27.1"]))
