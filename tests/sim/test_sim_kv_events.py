"""KV events on the wire, read by a subscriber written from vLLM's format (docs/simulator.md, "KV events").

The subscriber below uses only pyzmq and msgpack and vLLM's layout: frames
(topic, 8-byte big-endian sequence, payload); payload ``[ts, events, dp_rank]``;
``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]``,
``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``; replay on a
ROUTER socket: send the start sequence (8 bytes big-endian), receive
``(seq, payload)`` frames until sequence -1. Nothing of the simulator's own
event classes is used to decode.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from narwhal_sim.testing import SimThread


END = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """What a router keeps from vLLM KV events: the set of cached block hashes, and the raw events."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.events: list[list[Any]] = []
        self.last_seq = -1

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.last_seq + 1, f"sequence gap: {self.last_seq} then {seq}"
        self.last_seq = seq
        batch = msgpack.unpackb(payload, raw=False)
        ts, events = batch[0], batch[1]
        assert isinstance(ts, float) and abs(ts - time.time()) < 60
        for event in events:
            self.events.append(event)
            tag = event[0]
            if tag == "BlockStored":
                _, hashes, parent, token_ids, block_size, lora_id, medium = event[:7]
                assert len(token_ids) == len(hashes) * block_size and lora_id is None and medium == "GPU"
                self.cached.update(hashes)
            elif tag == "BlockRemoved":
                self.cached.difference_update(event[1])
            elif tag == "AllBlocksCleared":
                self.cached.clear()
            else:
                raise AssertionError(f"unknown event {event!r}")


def replay(ctx: zmq.Context[Any], endpoint: str, start: int, sub: Subscriber) -> None:
    """Ask the replay socket for every buffered batch from ``start`` on."""
    dealer = ctx.socket(zmq.DEALER)  # a DEALER takes the stream of replies (a REQ would take one)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])  # the empty delimiter a REQ would add
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == END:
                assert payload == b""
                return
            sub.apply(int.from_bytes(seq_bytes, "big"), payload)
    finally:
        dealer.close()


def pool_cached(sim: SimThread) -> set[int]:
    return sim.call(lambda: set(sim.engine.core.pool.cached))


def recipe_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The documented chained hash, written from docs/simulator.md."""
    out, parent = [], 0
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        material = parent.to_bytes(8, "big") + b"".join(t.to_bytes(4, "big") for t in token_ids[start:start + block_size])
        parent = int.from_bytes(hashlib.sha256(material).digest()[:8], "big")
        out.append(parent)
    return out


@pytest.fixture
def ctx() -> zmq.Context[Any]:
    context = zmq.Context()
    yield context
    context.term()


def test_events_replay_and_live_mirror_the_pool(ctx: zmq.Context[Any]) -> None:
    with SimThread("mixed", speed=0, num_gpu_blocks=40, kv_events_endpoint="tcp://127.0.0.1:0",
                   kv_events_replay_endpoint="tcp://127.0.0.1:0", kv_events_topic="kv") as sim, \
            httpx.Client(timeout=10) as client:  # fmt: skip
        pub = sim.engine.publisher
        assert pub is not None and pub.replay_endpoint is not None
        prompts = [f"{i:04d}".ljust(4 * 16 * 5, "abcdefgh"[i % 8]) for i in range(12)]  # 5 full blocks each
        for prompt in prompts[:6]:  # before anyone listens: only replay has them
            assert client.post(sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
        sub = Subscriber()
        live = ctx.socket(zmq.SUB)
        live.setsockopt(zmq.SUBSCRIBE, b"kv")
        live.connect(pub.endpoint)
        time.sleep(0.2)  # let the subscription reach the publisher (ZMQ's slow joiner); replay covers the rest
        replay(ctx, pub.replay_endpoint, 0, sub)
        assert sub.cached == pool_cached(sim) and sub.cached
        # More work, with evictions (40 blocks hold 6 prompts) and a cache reset, read live.
        for prompt in prompts[6:]:
            client.post(sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert client.post(sim.url + "/reset_prefix_cache").status_code == 200
        client.post(sim.url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 2})
        deadline = time.monotonic() + 5
        while sub.cached != pool_cached(sim) or not any(e[0] == "AllBlocksCleared" for e in sub.events):
            assert time.monotonic() < deadline, "live events did not catch up"
            if live.poll(100):
                topic, seq, payload = live.recv_multipart()
                assert topic == b"kv" and len(seq) == 8
                seq_no = int.from_bytes(seq, "big")
                if seq_no <= sub.last_seq:
                    continue  # already replayed
                if seq_no > sub.last_seq + 1:
                    replay(ctx, pub.replay_endpoint, sub.last_seq + 1, sub)  # a gap: ask for it
                    continue
                sub.apply(seq_no, payload)
        live.close()
        assert any(e[0] == "BlockRemoved" for e in sub.events)
        assert sub.cached == pool_cached(sim) and len(sub.cached) == 5


def test_block_stored_names_blocks_a_router_can_recompute(ctx: zmq.Context[Any]) -> None:
    with SimThread("prefill", speed=0, kv_events_endpoint="tcp://127.0.0.1:0",
                   kv_events_replay_endpoint="tcp://127.0.0.1:0") as sim, httpx.Client(timeout=10) as client:  # fmt: skip
        prompt = "The narwhal's tusk is a tooth. " * 10  # 310 characters: 78 tokens, 4 full blocks
        tokens = client.post(sim.url + "/tokenize", json={"prompt": prompt}).json()
        assert tokens["count"] == 78 and len(tokens["tokens"]) == 78 and tokens["max_model_len"] == 131_072
        answer = client.post(sim.url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
        assert answer.status_code == 200
        sub = Subscriber()
        deadline = time.monotonic() + 5
        while not sub.events:
            assert time.monotonic() < deadline
            replay(ctx, sim.engine.publisher.replay_endpoint, 0, sub)
            if not sub.events:
                sub = Subscriber()
                time.sleep(0.02)
        [stored] = sub.events
        _, hashes, parent, token_ids, block_size = stored[:5]
        assert parent is None and block_size == 16
        assert token_ids == tokens["tokens"][:64]
        assert hashes == recipe_hashes(tokens["tokens"], 16)
