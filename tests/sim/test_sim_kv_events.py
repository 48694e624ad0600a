"""KV events on the wire, read by a subscriber written from vLLM's format (docs/simulator.md, "KV events").

The subscriber below uses only pyzmq and msgpack and vLLM's layout: frames
(topic, 8-byte big-endian sequence, payload); payload ``[ts, events, dp_rank]``
or ``{"ts", "events", "data_parallel_rank"}``;
``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]``,
``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``, or the same
fields by name with the tag under ``"type"`` (vLLM PR #42892); replay on a
ROUTER socket: send the start sequence (8 bytes big-endian), receive
``(seq, payload)`` frames until sequence -1. Nothing of the simulator's own
event classes is used to decode.
"""

from __future__ import annotations

import hashlib
import socket
import time
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from narwhal_sim.testing import SimThread


END = (-1).to_bytes(8, "big", signed=True)


#: vLLM's field names after the tag (``vllm/distributed/kv_events.py``, commit 0181ea3173e5).
NAMES = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def positional(event: Any) -> list[Any]:
    """A map-encoded event as the array layout; every field without a default is sent (omit_defaults)."""
    if isinstance(event, list):
        return event
    assert set(event) == {"type", *NAMES[event["type"]]}, event
    return [event["type"], *(event[name] for name in NAMES[event["type"]])]


class Subscriber:
    """What a router keeps from vLLM KV events: the set of cached block hashes, and the raw events."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.events: list[list[Any]] = []
        #: Per batch: (whether the batch was a map, whether its events were, its data_parallel_rank).
        self.shapes: set[tuple[bool, bool | None, int]] = set()
        self.last_seq = -1

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.last_seq + 1, f"sequence gap: {self.last_seq} then {seq}"
        self.last_seq = seq
        batch = msgpack.unpackb(payload, raw=False)
        if isinstance(batch, dict):
            assert set(batch) == {"ts", "events", "data_parallel_rank"}, batch
            ts, wire, rank = batch["ts"], batch["events"], batch["data_parallel_rank"]
        else:
            ts, wire, rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 60
        maps = {isinstance(e, dict) for e in wire}
        assert len(maps) <= 1
        self.shapes.add((isinstance(batch, dict), maps.pop() if maps else None, rank))
        for event in map(positional, wire):
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


def replayed(ctx: zmq.Context[Any], sim: SimThread, client: httpx.Client) -> Subscriber:
    """One prompt sent to ``sim``; its events, read back from the replay socket."""
    answer = client.post(sim.url + "/v1/completions", json={"prompt": "narwhal tusk " * 12, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    deadline = time.monotonic() + 5
    while True:
        sub = Subscriber()
        replay(ctx, sim.engine.publisher.replay_endpoint, 0, sub)
        if sub.events:
            return sub
        assert time.monotonic() < deadline, "no events replayed"
        time.sleep(0.02)


@pytest.mark.parametrize(("version", "batch_map", "shape"), [
    ("0.18", False, (False, False)),  # arrays (array_like structs)
    ("0.23.1", False, (False, False)),  # the lease family, before PR #42892 shipped
    ("0.24.0", False, (False, True)),  # the first release with map events
    (None, False, (False, True)),  # the default family's 0.27.1
    (None, True, (True, True)),  # EventBatch without array_like (vLLM commit 0181ea3173e5)
])
def test_each_family_encodes_its_events_as_vllm_does(
    ctx: zmq.Context[Any], version: str | None, batch_map: bool, shape: tuple[bool, bool]
) -> None:
    with SimThread("prefill", speed=0, vllm_version=version, kv_events_batch_map=batch_map,
                   kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0") as sim, \
            httpx.Client(timeout=10) as client:  # fmt: skip
        sub = replayed(ctx, sim, client)
        assert sub.shapes == {(*shape, 0)}
        assert sub.cached == pool_cached(sim) and sub.cached


def free_port_pair() -> int:
    """A port P with P and P + 1 free on every address."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = int(probe.getsockname()[1])
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("", port))
                b.bind(("", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


def test_a_data_parallel_rank_publishes_on_the_port_plus_its_rank(ctx: zmq.Context[Any]) -> None:
    # vLLM's ZmqEventPublisher.offset_endpoint_port: rank r on the endpoint's port + r, replay port + r too.
    port = free_port_pair()
    with SimThread("prefill", speed=0, data_parallel_rank=1, kv_events_endpoint=f"tcp://*:{port - 1}",
                   kv_events_replay_endpoint=f"tcp://*:{port}") as sim, \
            httpx.Client(timeout=10) as client:  # fmt: skip
        publisher = sim.engine.publisher
        assert publisher.endpoint.endswith(f":{port}") and publisher.replay_endpoint.endswith(f":{port + 1}")
        sub = replayed(ctx, sim, client)
        assert {rank for *_, rank in sub.shapes} == {1}
        assert sim.stats()["kv_events_endpoint"] == publisher.endpoint
