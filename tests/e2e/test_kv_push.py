"""engine.protocol = "vllm-nixl-push" against the simulator's push family, on both runtimes.

vLLM's push mode (docs/operate.md, "vLLM compatibility"): the decode leg carries the prefill
engine's coordinates and the prefill leg's X-Request-Id, the decode engine registers its
blocks, the prefill engine writes the KV and frees its own. Every test reads the simulators'
own counters: no KV left held, none freed only by the lease (``kv_expired``: the leaks).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_sim.testing import SimThread

from ..harness import Fleet, RouterThread, make_config
from ..helpers import COMPLETIONS, MODEL, poll

PUSH = {"kv_transfer_mode": "push"}


@pytest.fixture
def routers() -> Iterator[list[RouterThread]]:
    started: list[RouterThread] = []
    yield started
    for router in started:
        router.stop()


def start(routers: list[RouterThread], journal: Path, fleet: Fleet, runtime: str, **sections: Any) -> RouterThread:
    engine = {"protocol": "vllm-nixl-push", **sections.pop("engine", {})}
    config = make_config(journal, prefill=fleet.prefill_urls, decode=fleet.decode_urls, engine=engine, **sections)
    router = RouterThread(config, runtime).start()
    routers.append(router)
    return router


def records(journal: Path, count: int) -> list[dict[str, Any]]:
    def read() -> list[dict[str, Any]] | None:
        if not journal.exists():
            return None
        found = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
        terminal = [r for r in found if r.get("terminal")]
        return terminal if len(terminal) >= count else None

    return poll(read, timeout=10)


def no_kv_left(prefill: SimThread) -> dict[str, Any]:
    stats = prefill.wait_for(lambda s: s["kv_held"] == 0, timeout=10)
    assert stats["kv_expired"] == 0, stats  # nothing freed only by the lease
    return stats


def test_a_push_fleet_answers_whole_and_streamed_and_every_block_is_written(
    routers: list[RouterThread], tmp_path: Path, runtime: str,
) -> None:
    journal = tmp_path / "journal.jsonl"
    with SimThread("prefill", speed=0, **PUSH) as p, SimThread("decode", speed=0, **PUSH) as d:
        router = start(routers, journal, Fleet(prefill=[p], decode=[d]), runtime)
        for i in range(4):
            body = {"model": MODEL, "prompt": f"push {i} " * 20, "max_tokens": 3, "stream": i % 2 == 1}
            answer = httpx.post(router.url + COMPLETIONS, json=body, timeout=10)
            assert answer.status_code == 200, answer.text
            assert "kv_transfer_params" not in answer.text
        stats = no_kv_left(p)
        assert stats["kv_pushes"] == 4 and stats["kv_push_unmatched"] == 0
        assert d.stats()["kv_push_registrations"] == 4
        for sent in d.requests(COMPLETIONS):
            params = json.loads(sent["body"])["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and "remote_block_ids" not in params
        for record in records(journal, 4):
            prefill, decode = record["legs"]
            assert decode["request_id"] == prefill["backend_id"]  # the engines pair the legs by it
            assert (prefill["kv"]["outcome"], prefill["kv"]["method"]) == ("pulled", "decode")


def test_a_decode_engine_that_never_registers_leaves_nothing_held(
    routers: list[RouterThread], tmp_path: Path, runtime: str,
) -> None:
    # The first decode engine refuses every request (it never registers): the retry on the
    # other registers, and the prefill engine writes and frees the blocks.
    journal = tmp_path / "journal.jsonl"
    with SimThread("prefill", speed=0, **PUSH) as p, \
            SimThread("decode", speed=0, faults={"error_rate": 1.0}, **PUSH) as bad, \
            SimThread("decode", speed=0, **PUSH) as good:  # fmt: skip
        router = start(routers, journal, Fleet(prefill=[p], decode=[bad, good]), runtime,
                       routing={"policy": "round_robin"}, retry={"max_attempts": 3})  # fmt: skip
        for i in range(4):
            answer = httpx.post(router.url + COMPLETIONS, json={"model": MODEL, "prompt": f"never {i} " * 20,
                                                                "max_tokens": 2}, timeout=10)  # fmt: skip
            assert answer.status_code == 200, answer.text
        stats = no_kv_left(p)
        assert stats["kv_pushes"] == stats["kv_held_total"] >= 4  # every block held was written, none left
        assert bad.stats()["kv_push_registrations"] == 0


def test_a_client_gone_mid_pair_leaves_nothing_held(routers: list[RouterThread], tmp_path: Path, runtime: str) -> None:
    # The decode leg is on its engine, not yet admitted (its serving layer's work), when the client
    # leaves: the decode engine never registers, and tells the prefill engine to free the blocks
    # (push_scheduler.py, request_finished: a request aborted before it was scheduled).
    journal = tmp_path / "journal.jsonl"
    with SimThread("prefill", speed=0, **PUSH) as p, SimThread("decode", speed=0, pre_admission_ms=1500, **PUSH) as d:
        router = start(routers, journal, Fleet(prefill=[p], decode=[d]), runtime)
        host, port = router.url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"model": MODEL, "prompt": "gone " * 20, "max_tokens": 3}).encode()
        with socket.create_connection((host, int(port)), timeout=5) as client:
            client.sendall(b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: "
                           b"application/json\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            poll(lambda: d.requests(COMPLETIONS) or None, timeout=10)  # the decode leg is on its engine
        (record,) = records(journal, 1)
        assert record["terminal"] == "cancelled", record
        stats = no_kv_left(p)
        assert stats["kv_released"] + stats["kv_pushes"] == stats["kv_held_total"] == 1
