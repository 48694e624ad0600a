"""KV events as newer vLLM sends them, end to end: map batches, data-parallel ranks, either side binding.

(docs/routing.md, "KV events"; docs/configure.md, ``engine.kv_events_socket``
and ``engine.data_parallel_size``; docs/simulator.md, "KV events".) Real
sockets on both runtimes: simulated prefill engines that publish vLLM's KV
events, a decode engine, and Narwhal with ``routing.policy = "kv"``. As in
tests/e2e/test_kv_routing.py, a prompt is sent to an engine DIRECTLY, so
that only its events can tell Narwhal where it is; Narwhal's choice is read
from its journal's ``routing`` record, what the engines did and published
from the simulators' ``/sim/stats``.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import narwhal_sim.server
from narwhal_runtime.tokenizer import EngineTokenizer
from narwhal_sim.testing import SimThread

from ..harness import LogCapture, RouterThread, make_config
from ..helpers import poll
from .test_kv_routing import (
    BLOCK, GPU_BLOCKS, PROMPT_TOKENS, BoundPublisher, candidate, hashes_of, held, indexed, prompt, start_prefills,
    straight_to, streams_up, through, tok, tokenizer_dir,
)  # fmt: skip

__all__ = ["tok", "tokenizer_dir"]  # (fixtures, imported for this module's tests)

#: A rank-0 engine's address, its rank 1's, and the decode engine's.
RANK_HOSTS = ("127.0.0.25", "127.0.0.26")
DECODE_HOST = "127.0.0.27"


def free_ports(host: str, count: int) -> int:
    """A port P such that P .. P + count - 1 are free on ``host``."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        try:
            with contextlib.ExitStack() as stack:
                for candidate_port in range(port, port + count):
                    stack.enter_context(socket.socket()).bind((host, candidate_port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {count} free ports in a row on {host}")


def kv_router(runtime: str, tmp_path: Path, tokenizer: Path, prefill: list[str], decode: str,
              **engine: Any) -> RouterThread:  # fmt: skip
    config = make_config(
        tmp_path / "journal.jsonl", prefill=tuple(prefill), decode=(decode,), model={"tokenizer": str(tokenizer)},
        engine=engine, routing={"policy": "kv", "kv_block_size": BLOCK, "kv_speculative_ttl_s": 0.0},
    )
    return RouterThread(config, runtime).start()


def routed_by_events(router: RouterThread, engine_url: str, holder: SimThread, text: str) -> dict[str, Any]:
    """``text``, which ``holder`` caches, goes through Narwhal to ``engine_url``, weighed from the events."""
    hits = holder.stats()["prefix_cache_hits"]
    routing = through(router, text)
    assert routing["prefill"] == engine_url and routing["index"] == "kv", routing
    assert candidate(routing, engine_url)["matched_tokens"] == PROMPT_TOKENS, routing
    assert holder.stats()["prefix_cache_hits"] > hits  # the engine did reuse its cache
    return routing


def delivers(router: RouterThread, tok: EngineTokenizer, url: str, rank: SimThread) -> None:
    """``rank``'s stream delivers to ``url``'s index: small prompts sent to it until one is indexed.

    (A batch published before the subscription reached the PUB socket is
    lost to it; the subscriber asks the replay socket for it at the next.)
    """
    sent: list[int] = []

    def seen() -> bool:
        if sent and any(h in held(router, url) for h in sent):
            return True
        text = prompt(20_000 + len(sent), tokens=BLOCK)
        straight_to(rank, text)
        sent.extend(hashes_of(tok, text))
        return False

    poll(seen, interval=0.1, what=f"rank's first batch indexed under {url}")


@pytest.fixture
def decode(tokenizer_dir: Path) -> Iterator[SimThread]:
    with SimThread("decode", speed=0, host=DECODE_HOST, tokenizer=str(tokenizer_dir)) as sim:
        yield sim


def test_map_batches_route_by_kv(
    runtime: str, tmp_path: Path, tokenizer_dir: Path, tok: EngineTokenizer, decode: SimThread,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Map events (vLLM PR #42892) in a map batch (EventBatch without array_like, vLLM commit 0181ea3173e5).
    port, prefills = start_prefills(tokenizer_dir, monkeypatch, kv_events_batch_map=True)
    try:
        first, second = prefills
        router = kv_router(runtime, tmp_path, tokenizer_dir, [p.url for p in prefills], decode.url,
                           kv_events=f"tcp://{{host}}:{port}", kv_events_replay=f"tcp://{{host}}:{port + 1}")
        try:
            streams_up(router, tok, (first, second))
            a = prompt(1)
            straight_to(second, a)
            indexed(router, second, hashes_of(tok, a))
            routing = routed_by_events(router, second.url, second, a)
            assert (candidate(routing, first.url)["matched_tokens"], candidate(routing, first.url)["index"]) == \
                (0, "kv")
            # What the engines sent: map batches of map events, every one read (none malformed).
            stats = second.stats()
            assert stats["kv_events_encoding"] == {"data_parallel_rank": 0, "events": "map", "batch": "map"}
            assert stats["kv_events_published"] >= 2
            assert router.server.serving.kv_subscriber.counters.malformed == 0
        finally:
            router.stop()
    finally:
        for sim in prefills:
            sim.stop()


def test_a_second_data_parallel_rank_reaches_the_index(
    runtime: str, tmp_path: Path, tokenizer_dir: Path, tok: EngineTokenizer, decode: SimThread,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One engine URL, two ranks: rank r publishes on the port + r, its replay on the replay port + r."""
    host = RANK_HOSTS[0]
    port = free_ports(host, 4)  # events P, P + 1; replay P + 2, P + 3
    with monkeypatch.context() as patch:
        patch.setattr(narwhal_sim.server, "KvEventPublisher", BoundPublisher)
        ranks = [
            SimThread("prefill", speed=0, host=rank_host, tokenizer=str(tokenizer_dir), num_gpu_blocks=GPU_BLOCKS,
                      block_size=BLOCK, data_parallel_rank=rank, kv_events_endpoint=f"tcp://{host}:{port}",
                      kv_events_replay_endpoint=f"tcp://{host}:{port + 2}").start()
            for rank, rank_host in enumerate(RANK_HOSTS)
        ]  # fmt: skip
    try:
        engine, rank1 = ranks
        assert rank1.stats()["kv_events_endpoint"] == f"tcp://{host}:{port + 1}"
        with LogCapture() as log:
            router = kv_router(runtime, tmp_path, tokenizer_dir, [engine.url], decode.url,
                               kv_events=f"tcp://{{host}}:{port}", kv_events_replay=f"tcp://{{host}}:{port + 2}",
                               data_parallel_size=2)  # fmt: skip
            try:
                poll(lambda: router.statistics().kv_events_live == {engine.url: True}, what="the engine live")
                delivers(router, tok, engine.url, rank1)
                subscribed = {(e.get("rank"), e["endpoint"], e["replay"]) for e in log.events()
                              if e["event"] == "kv_events_subscribed"}  # fmt: skip
                assert subscribed == {(0, f"tcp://{host}:{port}", f"tcp://{host}:{port + 2}"),
                                      (1, f"tcp://{host}:{port + 1}", f"tcp://{host}:{port + 3}")}  # fmt: skip
                # A prompt only rank 1 holds: its events reach the engine's index, and the engine is chosen.
                a = prompt(2)
                straight_to(rank1, a)
                indexed(router, engine, hashes_of(tok, a))
                assert engine.stats()["kv_events_published"] == 0  # (none of it came from rank 0)
                assert rank1.stats()["kv_events_encoding"]["data_parallel_rank"] == 1
                routing = through(router, a)
                assert routing["prefill"] == engine.url and routing["index"] == "kv", routing
                assert candidate(routing, engine.url)["matched_tokens"] == PROMPT_TOKENS
                assert router.statistics().kv_events_live == {engine.url: True}
                assert not [e for e in log.events() if e["event"] == "kv_events_lost"]
                # One rank's stream lost is the engine's stream lost: what that rank holds can no longer be told.
                rank1.engine.publisher.close()
                poll(lambda: [e for e in log.events() if e["event"] == "kv_events_lost" and e["engine"] == engine.url],
                     what="kv_events_lost for the engine")  # fmt: skip
            finally:
                router.stop()
    finally:
        for sim in ranks:
            sim.stop()


def test_an_engine_that_connects_reaches_narwhal_bound(
    runtime: str, tmp_path: Path, tokenizer_dir: Path, tok: EngineTokenizer, decode: SimThread
) -> None:
    """vLLM connects for an endpoint without ``*`` or ``::``: Narwhal binds it (``kv_events_socket = "bind"``)."""
    host = RANK_HOSTS[0]
    port = free_ports(host, 2)
    # The simulator's own rule, as vLLM's: tcp://HOST:PORT connects (and retries until Narwhal binds);
    # its replay socket binds the port + 1.
    with SimThread("prefill", speed=0, host=host, tokenizer=str(tokenizer_dir), num_gpu_blocks=GPU_BLOCKS,
                   block_size=BLOCK, kv_events_endpoint=f"tcp://{host}:{port}") as engine, \
            LogCapture() as log:  # fmt: skip
        router = kv_router(runtime, tmp_path, tokenizer_dir, [engine.url], decode.url,
                           kv_events=f"tcp://{host}:{port}", kv_events_replay=f"tcp://{host}:{port + 1}",
                           kv_events_socket="bind")  # fmt: skip
        try:
            streams_up(router, tok, (engine,))
            (line,) = [e for e in log.events() if e["event"] == "kv_events_subscribed"]
            assert line["socket"] == "bind" and line["endpoint"] == f"tcp://{host}:{port}"
            assert [e["engine"] for e in log.events() if e["event"] == "kv_events_connected"] == [engine.url]
            a = prompt(3)
            straight_to(engine, a)
            indexed(router, engine, hashes_of(tok, a))
            routed_by_events(router, engine.url, engine, a)
            assert engine.stats()["kv_events_published"] >= 2
        finally:
            router.stop()
