"""Narwhal against each vLLM version family the simulator models (docs/operate.md, "vLLM compatibility").

The connector-version warning and metric, the prefill answer's KV params passed on byte for byte and
refused when a decode engine could not use them, vLLM's error types as OpenAI's, ``cached_tokens`` 0
rather than ``null``, and a streamed decode leg's KV counted ``pulled`` only at its first data event.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_sim.testing import SimThread
from narwhal_sim.versions import FAMILIES

from ..harness import Fleet, LogCapture, RouterThread, make_config
from ..helpers import COMPLETIONS, MODEL, completion_records, poll, rid_of
from .support import exact_json

VERSIONS = tuple(FAMILIES)


def journal_record(path: Path, rid: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        if not path.exists():
            return None
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("rid") == rid and rec.get("terminal"):
                return rec
        return None

    return poll(find, what=f"terminal record of {rid}")  # type: ignore[no-any-return]


def metric_value(router: RouterThread, name: str, **labels: str) -> float | None:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    return tmp_path / "journal.jsonl"


@pytest.fixture
def routers() -> Iterator[list[RouterThread]]:
    started: list[RouterThread] = []
    yield started
    for router in started:
        router.stop()


def start(routers: list[RouterThread], journal: Path, fleet: Fleet, runtime: str = "trio",
          **sections: Any) -> RouterThread:  # fmt: skip
    config = make_config(journal, prefill=fleet.prefill_urls, decode=fleet.decode_urls, **sections)
    router = RouterThread(config, runtime).start()
    routers.append(router)
    return router


# ---------------------------------------------------------------------------- item 4: connector version


@pytest.mark.parametrize("version", VERSIONS)
def test_connector_version_is_detected_said_once_and_exposed(
    routers: list[RouterThread], journal: Path, version: str
) -> None:
    family = FAMILIES[version]
    with SimThread("prefill", speed=0, vllm_version=version) as p, \
            SimThread("decode", speed=0, vllm_version=version) as d, LogCapture() as log:  # fmt: skip
        router = start(routers, journal, Fleet(prefill=[p], decode=[d]))
        for _ in range(3):
            answer = httpx.post(router.url + COMPLETIONS, json={"model": MODEL, "prompt": "hello " * 20,
                                                                "max_tokens": 3}, timeout=10)  # fmt: skip
            assert answer.status_code == 200, answer.text
        assert metric_value(router, "narwhal_engine_kv_connector", engine=p.url) == family.connector
        notes = [e for e in log.events() if e.get("event") == "kv_connector_v1"]
        if family.connector == 1:
            (note,) = notes  # once per engine, not per request
            assert note["engine"] == p.url and note["level"] == "info"
            assert "prefill leg's X-Request-Id" in note["consequence"]
        else:
            assert notes == []
        # Every version: the decode engine named blocks the prefill engine held, and they are free.
        stats = p.stats()
        assert (stats["kv_held"], stats["kv_held_blocks"], stats["kv_notifs_unrecognized"]) == (0, 0, 0)


# ---------------------------------------------------------------------------- connector 1 frees its KV


def _connector_1_request(router: RouterThread, stream: bool) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 3, "stream": stream}
    answer = httpx.post(router.url + COMPLETIONS, json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    if stream:
        assert answer.text.rstrip().endswith("data: [DONE]")
    return answer


def _nothing_held(prefill: SimThread) -> None:
    """The prefill engine's own counters: no blocks held, no notification naming a request it never had."""
    stats = prefill.stats()
    assert (stats["kv_held"], stats["kv_held_blocks"], stats["kv_notifs_unrecognized"]) == (0, 0, 0), stats


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("version", ["0.9", "0.11"])
def test_a_connector_1_fleet_frees_every_requests_kv(
    routers: list[RouterThread], journal: Path, version: str, stream: bool
) -> None:
    """vLLM before 0.14: the decode leg carries the prefill leg's X-Request-Id, so its pull frees the blocks."""
    with SimThread("prefill", speed=0, vllm_version=version) as p, \
            SimThread("decode", speed=0, vllm_version=version) as d:  # fmt: skip
        router = start(routers, journal, Fleet(prefill=[p], decode=[d]), engine={"kv_release": "lease"})
        answers = [_connector_1_request(router, stream) for _ in range(2)]
        _nothing_held(p)
        prefill_ids = []
        for answer in answers:
            prefill_leg, decode_leg = journal_record(journal, rid_of(answer))["legs"]
            # The journal keeps each attempt's backend ID and says what the decode leg was sent.
            assert decode_leg["backend_id"] == rid_of(answer) + "-d1"
            assert decode_leg["request_id"] == prefill_leg["backend_id"] == rid_of(answer) + "-p1"
            assert prefill_leg["kv"]["outcome"] == "pulled"
            prefill_ids.append(prefill_leg["backend_id"])
        sent = [dict((n.lower(), v) for n, v in r["headers"])["x-request-id"] for r in completion_records([d])]
        assert sent == prefill_ids


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("version", ["0.9", "0.11"])
def test_a_connector_1_decode_retry_leaves_nothing_held(
    routers: list[RouterThread], journal: Path, version: str, stream: bool
) -> None:
    """The first decode attempt fails (503 before admission); the release and the retry both free what they carry."""
    with SimThread("prefill", speed=0, vllm_version=version) as p, \
            SimThread("decode", speed=0, vllm_version=version, faults={"error_rate": 1.0}) as bad, \
            SimThread("decode", speed=0, vllm_version=version) as good:  # fmt: skip
        # The first decode leg goes to the first engine (turn order); the retry and the release avoid it.
        router = start(routers, journal, Fleet(prefill=[p], decode=[bad, good]),
                       engine={"kv_release": "decode_pull"}, retry={"max_attempts": 2})  # fmt: skip
        answer = _connector_1_request(router, stream)
        record = journal_record(journal, rid_of(answer))  # (written once every release is settled)
        _nothing_held(p)
        rid = rid_of(answer)
        legs = [(leg["phase"], leg["backend_id"], leg.get("request_id"), leg["outcome"]) for leg in record["legs"]]
        assert legs == [
            ("prefill", f"{rid}-p1", None, "ok"), ("decode", f"{rid}-d1", f"{rid}-p1", "http_error"),
            ("prefill", f"{rid}-p2", None, "ok"), ("decode", f"{rid}-d2", f"{rid}-p2", "ok"),
        ]
        first, second = record["legs"][0]["kv"], record["legs"][2]["kv"]
        assert (first["outcome"], first["method"], first["release_id"]) == ("released", "decode_pull", f"{rid}-p1")
        assert second["outcome"] == "pulled"
        assert bad.stats()["faults_error"] == 1
# ---------------------------------------------------------------------------- item 6: shapes


class FakePrefill:
    """A prefill engine answering exactly-written ``kv_transfer_params`` (lease-era shape unless told)."""

    def __init__(self) -> None:
        self.params_text = ""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                self._send(200, b"{}")

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length", "0")))
                rid = self.headers.get("x-request-id", "")
                self._send(200, outer.answer(rid))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)

    def lease_params(self, rid: str) -> str:
        # nixl/pull_scheduler.py's keys and order; one block list per KV-cache group (two groups here).
        return (
            '{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[11,12,13],[40,41]],'
            f'"remote_engine_id":"4f6c1d2e-aa","remote_request_id":"cmpl-{rid}-0-9c0e51a2",'
            f'"remote_host":"127.0.0.1","remote_port":{self.port},"tp_size":2,"dcp_size":1,"pp_size":1,'
            '"remote_num_tokens":50,"remote_blocks_expiry_time":null,"transfer_mode":"pull"}'
        )

    def answer(self, rid: str) -> bytes:
        params = self.params_text.replace("{rid}", rid) if self.params_text else self.lease_params(rid)
        return (
            '{"id":"cmpl-x","object":"text_completion","created":1,"model":"' + MODEL + '",'
            '"choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":"length","stop_reason":null}],'
            '"usage":{"prompt_tokens":50,"completion_tokens":1,"total_tokens":51,"prompt_tokens_details":null},'
            '"kv_transfer_params":' + params + "}"
        ).encode()

    def __enter__(self) -> FakePrefill:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_prefill() -> Iterator[FakePrefill]:
    with FakePrefill() as engine:
        yield engine


@pytest.mark.parametrize("runtime", ["trio", "asyncio"])
def test_lease_era_params_reach_the_decode_leg_byte_for_byte(
    routers: list[RouterThread], journal: Path, fake_prefill: FakePrefill, runtime: str
) -> None:
    with SimThread("decode", speed=0) as d:
        router = start(routers, journal, Fleet(prefill=[fake_prefill], decode=[d]), runtime)
        answer = httpx.post(router.url + COMPLETIONS, json={"model": MODEL, "prompt": "hi " * 40, "max_tokens": 2},
                            timeout=10)  # fmt: skip
        assert answer.status_code == 200, answer.text
        record = journal_record(journal, rid_of(answer))
        prefill_bid = record["legs"][0]["backend_id"]
        (decode_rec,) = completion_records([d])
        expected = fake_prefill.lease_params(prefill_bid)
        # The decode leg's body ends with the prefill engine's params, the same bytes.
        assert decode_rec["body"].endswith('"kv_transfer_params":' + expected + "}"), decode_rec["body"]
        assert record["legs"][0]["kv"]["owner"] == f"cmpl-{prefill_bid}-0-9c0e51a2"
        # Connector 2 seen (remote_request_id): no warning, metric 2.
        assert metric_value(router, "narwhal_engine_kv_connector", engine=fake_prefill.url) == 2
        # The prefill engine reported no cached_tokens (prompt_tokens_details: null): 0, not null.
        assert answer.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert record["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


LEASE_KEYS = ('"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":50,"remote_blocks_expiry_time":null,'
              '"transfer_mode":"pull"')  # fmt: skip


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ('{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],'
         '"remote_request_id":"cmpl-{rid}-0-aa","remote_host":"127.0.0.1","remote_port":PORT,' + LEASE_KEYS + "}",
         "remote_engine_id"),
        ('{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],"remote_engine_id":"e",'
         '"remote_host":"127.0.0.1","remote_port":PORT,' + LEASE_KEYS + "}", "remote_request_id"),
        ('{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],"remote_engine_id":"e",'
         '"remote_request_id":"cmpl-{rid}-0-aa","remote_port":PORT,' + LEASE_KEYS + "}", "remote_host"),
        ('{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],"remote_engine_id":"e",'
         '"remote_request_id":"cmpl-{rid}-0-aa","remote_host":"127.0.0.1",' + LEASE_KEYS + "}", "remote_port"),
        ('{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e",'
         '"remote_request_id":"cmpl-{rid}-0-aa","remote_host":"127.0.0.1","remote_port":PORT,' + LEASE_KEYS + "}",
         "remote_block_ids"),
        ('{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,"2"]],"remote_engine_id":"e",'
         '"remote_request_id":"cmpl-{rid}-0-aa","remote_host":"127.0.0.1","remote_port":PORT,' + LEASE_KEYS + "}",
         "remote_block_ids"),
        # A list per group without remote_request_id is a later connector's answer, not connector 1's.
        ('{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],"remote_engine_id":"e",'
         '"remote_host":"127.0.0.1","remote_port":PORT,"tp_size":1}', "remote_request_id"),
    ],
    ids=["no-engine-id", "no-request-id", "no-host", "no-port", "no-blocks", "bad-blocks", "groups-no-request-id"],
)
def test_params_a_decode_engine_cannot_use_are_refused_never_forwarded(
    routers: list[RouterThread], journal: Path, fake_prefill: FakePrefill, params: str, why: str
) -> None:
    fake_prefill.params_text = params.replace("PORT", str(fake_prefill.port))
    with SimThread("decode", speed=0, incomplete_kv_params="crash") as d:
        router = start(routers, journal, Fleet(prefill=[fake_prefill], decode=[d]))
        answer = httpx.post(router.url + COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                            timeout=10)  # fmt: skip
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["code"] == "prefill_failed"
        record = journal_record(journal, rid_of(answer))
        assert record["terminal"] == "failed"
        assert why in record["error"]["message"] and {leg["outcome"] for leg in record["legs"]} == {"bad_kv"}
        assert completion_records([d]) == []  # never forwarded: it could kill a vLLM decode engine
        assert d.stats()["kv_params_invalid"] == 0


def test_a_connector_1_answer_is_accepted(routers: list[RouterThread], journal: Path, fake_prefill: FakePrefill) -> None:
    fake_prefill.params_text = (
        '{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2],"remote_engine_id":"e",'
        f'"remote_host":"127.0.0.1","remote_port":{fake_prefill.port},"tp_size":1}}'
    )
    with SimThread("decode", speed=0, vllm_version="0.11") as d:
        router = start(routers, journal, Fleet(prefill=[fake_prefill], decode=[d]))
        answer = httpx.post(router.url + COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                            timeout=10)  # fmt: skip
        assert answer.status_code == 200, answer.text
        (decode_rec,) = completion_records([d])
        assert decode_rec["body"].endswith('"kv_transfer_params":' + fake_prefill.params_text + "}")
        assert metric_value(router, "narwhal_engine_kv_connector", engine=fake_prefill.url) == 1


# ---------------------------------------------------------------------------- item 7


@pytest.mark.parametrize("version", VERSIONS)
def test_an_engine_bad_request_reaches_the_client_as_invalid_request_error(
    routers: list[RouterThread], journal: Path, version: str
) -> None:
    with SimThread("prefill", speed=0, vllm_version=version, max_model_len=64) as p, \
            SimThread("decode", speed=0, vllm_version=version, max_model_len=64) as d:  # fmt: skip
        router = start(routers, journal, Fleet(prefill=[p], decode=[d]))
        answer = httpx.post(router.url + COMPLETIONS, json={"model": MODEL, "prompt": "x" * 400, "max_tokens": 2},
                            timeout=10)  # fmt: skip
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        # The engine said BadRequestError (flat before 0.10.1, nested after); the client gets OpenAI's type.
        assert error["type"] == "invalid_request_error"
        assert error["param"] == "max_tokens" and "maximum context length" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("version", VERSIONS)
def test_cached_tokens_is_zero_when_the_engine_reports_none(
    routers: list[RouterThread], journal: Path, version: str, stream: bool
) -> None:
    with SimThread("prefill", speed=0, vllm_version=version, enable_prompt_tokens_details=False) as p, \
            SimThread("decode", speed=0, vllm_version=version, enable_prompt_tokens_details=False) as d:  # fmt: skip
        router = start(routers, journal, Fleet(prefill=[p], decode=[d]))
        body: dict[str, Any] = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 3}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        answer = httpx.post(router.url + COMPLETIONS, json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        if stream:
            chunks = [json.loads(line[6:]) for line in answer.text.splitlines()
                      if line.startswith("data: {")]  # fmt: skip
            usage = [c["usage"] for c in chunks if c.get("usage")][-1]
        else:
            usage = answer.json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        record = journal_record(journal, rid_of(answer))
        assert record["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize("chunks", [0, 1])
def test_a_streamed_decode_leg_counts_as_pulled_only_after_a_data_event(
    routers: list[RouterThread], journal: Path, chunks: int
) -> None:
    """The decode engine's response head proves nothing; its first data event proves it had the KV."""
    with SimThread("prefill", speed=0) as p, \
            SimThread("decode", speed=0, faults={"drop_after_chunks": chunks}) as d:  # fmt: skip
        router = start(routers, journal, Fleet(prefill=[p], decode=[d]), retry={"max_attempts": 1},
                       engine={"kv_release": "lease"})  # fmt: skip
        answer = httpx.post(router.url + COMPLETIONS, json={"model": MODEL, "prompt": "hello " * 20,
                                                            "max_tokens": 5, "stream": True}, timeout=10)  # fmt: skip
        record = journal_record(journal, rid_of(answer))
        assert record["terminal"] == "failed"
        kv = record["legs"][0]["kv"]
        if chunks == 0:
            assert kv["outcome"] != "pulled", kv  # head only: not counted as pulled
        else:
            assert kv["outcome"] == "pulled", kv


def test_vllms_default_remote_host_localhost_is_accepted(routers: list[RouterThread], journal: Path) -> None:
    """vLLM advertises VLLM_NIXL_SIDE_CHANNEL_HOST, "localhost" unless set: a one-machine fleet works as is."""
    with SimThread("prefill", speed=0, advertise_host=None) as p, SimThread("decode", speed=0) as d:
        router = start(routers, journal, Fleet(prefill=[p], decode=[d]))
        answer = httpx.post(router.url + COMPLETIONS, json={"model": MODEL, "prompt": "hello " * 20, "max_tokens": 2},
                            timeout=10)  # fmt: skip
        assert answer.status_code == 200, answer.text
        (decode_rec,) = completion_records([d])
        assert exact_json(decode_rec["body"])["kv_transfer_params"]["remote_host"] == "localhost"
        assert journal_record(journal, rid_of(answer))["legs"][0]["kv"]["outcome"] == "pulled"
        assert (p.stats()["kv_pulled"], p.stats()["kv_held"]) == (1, 0)


# ---------------------------------------------------------------------------- bidirectional transfer (0.28 on)


def test_a_bidirectional_decode_engines_own_params_stay_off_the_client_and_its_blocks_held(
    routers: list[RouterThread], journal: Path
) -> None:
    # vLLM's bidirectional_kv_xfer: each decode answer names the decode engine's own blocks, held for
    # decoder_kv_blocks_ttl for a next turn that Narwhal never sends (docs/operate.md, "vLLM compatibility").
    with SimThread("prefill", speed=0, vllm_version="0.28") as p, \
            SimThread("decode", speed=0, vllm_version="0.28", bidirectional_kv=True) as d:  # fmt: skip
        router = start(routers, journal, Fleet(prefill=[p], decode=[d]))
        answer = httpx.post(router.url + COMPLETIONS, json={"model": MODEL, "prompt": "hello " * 20,
                                                            "max_tokens": 3}, timeout=10)  # fmt: skip
        assert answer.status_code == 200, answer.text
        assert "kv_transfer_params" not in answer.json()
        (engine_answer,) = d.requests("/v1/completions")
        assert engine_answer["kv"]["decoder_held_blocks"] >= 1  # the engine did answer its own params
        record = journal_record(journal, rid_of(answer))
        assert record["terminal"] == "completed" and record["legs"][0]["kv"]["outcome"] == "pulled"
        assert p.stats()["kv_held"] == 0  # the prefill engine's KV was pulled and freed as ever
        stats = d.stats()
        assert stats["decoder_kv_held"] == 1 and stats["free_blocks"] < stats["total_blocks"]


# ---------------------------------------------------------------------------- push mode refused


def test_a_push_mode_answer_is_refused_clearly_and_its_kv_journalled(routers: list[RouterThread], journal: Path) -> None:
    """vLLM's push scheduler (transfer_mode "push"): 502 naming the mode, never a decode leg, nothing unjournalled."""
    with SimThread("prefill", speed=0, kv_transfer_mode="push") as p1, \
            SimThread("prefill", speed=0, kv_transfer_mode="push") as p2, \
            SimThread("decode", speed=0) as d, LogCapture() as log:  # fmt: skip
        router = start(routers, journal, Fleet(prefill=[p1, p2], decode=[d]), retry={"max_attempts": 3})
        answers = [
            httpx.post(router.url + COMPLETIONS, json={"model": MODEL, "prompt": f"push {i} " * 20, "max_tokens": 3,
                                                       "stream": i % 2 == 1}, timeout=10)  # fmt: skip
            for i in range(4)
        ]
        for answer in answers:
            assert answer.status_code == 502, answer.text
            error = answer.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "unsupported_kv_transfer_mode")
            assert "'push'" in error["message"] and "pull" in error["message"]
        holders = {}
        for answer in answers:
            record = journal_record(journal, rid_of(answer))
            assert record["terminal"] == "failed" and record["error"]["code"] == "unsupported_kv_transfer_mode"
            (leg,) = record["legs"]  # refused at the first answer: no retry, no decode leg
            assert (leg["phase"], leg["outcome"]) == ("prefill", "bad_kv")
            kv = leg["kv"]
            assert (kv["outcome"], kv["method"]) == ("held_until_lease", "lease") and "push" in kv["error"]
            holders.setdefault(kv["engine"], set()).add(kv["owner"])
        assert len(holders) == 2  # (distinct prompts: the prefill legs went to both engines in turn)
        assert completion_records([d]) == []
        # The prefill engines' own ledgers hold exactly the KV the journal names.
        for engine in (p1, p2):
            held = {r["kv"]["owner"] for r in engine.requests() if r["kv"] is not None and r["kv"]["outcome"] == "held"}
            assert held == holders.get(engine.url, set())
            assert engine.stats()["kv_held"] == len(held)
        events = [e for e in log.events() if e.get("event") == "kv_transfer_mode_unsupported"]
        assert sorted(e["engine"] for e in events) == sorted(holders)  # one line per engine
        assert all(e["mode"] == "push" and e["level"] == "error" for e in events)
        for url, owners in holders.items():
            assert metric_value(router, "narwhal_engine_kv_transfer_mode_refused_total", engine=url,
                                mode="push") == len(owners)  # fmt: skip
