"""vLLM's KV-cache events on the wire: msgpack ``KVEventBatch`` over a ZMQ PUB socket, plus replay.

The layout follows vLLM's ``vllm/distributed/kv_events.py`` (msgspec structs
``EventBatch``, ``KVCacheEvent`` tagged, ``omit_defaults=True``; encoded by
``ZmqEventPublisher._publisher_thread``; replay in
``ZmqEventPublisher._service_replay``; data-parallel ports in
``ZmqEventPublisher.offset_endpoint_port``) — see docs/simulator.md, "KV events":

* a message is three frames: topic (UTF-8), sequence number (8 bytes,
  big-endian, from 0), payload;
* payload = ``[ts, [event, ...], data_parallel_rank]`` (``EventBatch``
  ``array_like``, commit ``b4e69e0af33f``), or the map ``{"ts", "events",
  "data_parallel_rank"}`` (``EventBatch`` without ``array_like``, commit
  ``0181ea3173e5``);
* events as arrays (``array_like``, before vLLM PR #42892):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``; or as
  maps of the same fields by name with the tag under ``"type"`` (since PR
  #42892; the fields without a default are always sent, the later ones with
  a ``None`` default left out, as ``omit_defaults`` does);
* the replay ROUTER socket takes ``[identity, b"", start_seq (8 bytes big-endian)]``
  and answers each buffered batch with ``seq >= start`` as ``[identity, b"", seq, payload]``,
  then ``[identity, b"", -1 (8 bytes, signed), b""]``;
* data-parallel rank *r* publishes on the endpoint's port + *r*, its replay
  socket on the replay port + *r*.

:func:`encode_batch` is pure; :class:`KvEventPublisher` owns the sockets on a
thread of its own (ZMQ sockets are not thread-safe; the asyncio loop only
puts batches in a queue), as vLLM's publisher does.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, Final

import msgpack

from narwhal_sim.engine import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["encode_event", "encode_batch", "offset_port", "KvEventPublisher", "END_SEQ", "MEDIUM"]

#: The replay's end marker: sequence number -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: ``medium`` of every event (vLLM's ``MEDIUM_GPU``).
MEDIUM = "GPU"


#: Each event's fields after its tag, by name, in vLLM's order (what a map-encoded event's keys are).
_FIELDS: Final = MappingProxyType({
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
})


def encode_event(event: KvEvent, *, as_map: bool = False) -> list[Any] | dict[str, Any]:
    """One event as vLLM's msgspec layout: an array, tag first, or (``as_map``) a map, tag under ``"type"``."""
    if type(event) is BlockStored:
        fields: list[Any] = ["BlockStored", list(event.block_hashes), event.parent_block_hash,
                             list(event.token_ids), event.block_size, None, MEDIUM, None]  # fmt: skip
    elif type(event) is BlockRemoved:
        fields = ["BlockRemoved", list(event.block_hashes), MEDIUM]
    elif type(event) is AllBlocksCleared:
        fields = ["AllBlocksCleared"]
    else:
        raise TypeError(f"not a KV event: {event!r}")
    if not as_map:
        return fields
    return {"type": fields[0], **dict(zip(_FIELDS[fields[0]], fields[1:], strict=True))}


def encode_batch(
    events: Sequence[KvEvent], ts: float, data_parallel_rank: int = 0, *, map_events: bool = False,
    map_batch: bool = False,
) -> bytes:
    """A ``KVEventBatch`` payload, its events (``map_events``) and itself (``map_batch``) arrays or maps."""
    encoded = [encode_event(e, as_map=map_events) for e in events]
    batch: Any = (
        {"ts": ts, "events": encoded, "data_parallel_rank": data_parallel_rank} if map_batch
        else [ts, encoded, data_parallel_rank]
    )  # fmt: skip
    payload: bytes = msgpack.packb(batch, use_bin_type=True)
    return payload


def offset_port(endpoint: str, data_parallel_rank: int) -> str:
    """``tcp://HOST:PORT`` with the port + ``data_parallel_rank`` (vLLM's ``offset_endpoint_port``).

    A free port asked for (``0`` or ``*``, the simulator's own) stays as it is.
    """
    base, _, port = endpoint.rpartition(":")
    if data_parallel_rank == 0 or not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + data_parallel_rank}"


class KvEventPublisher:
    """A ZMQ PUB socket (and optional replay ROUTER socket) on a thread of its own.

    ``endpoint``: ``tcp://HOST:PORT``; the socket binds when the host is
    ``*`` or the port is ``0``/``*`` (a free port), and connects otherwise
    (vLLM binds for ``*`` or ``::``, ``ZmqEventPublisher._socket_setup``).
    ``replay_endpoint`` always binds. Both ports are offset by
    ``data_parallel_rank``, which every batch carries; ``map_events`` and
    ``map_batch`` choose the encoding (:func:`encode_batch`).
    :attr:`endpoint` and :attr:`replay_endpoint` are the resolved addresses.
    """

    def __init__(
        self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "", buffer_steps: int = 10_000,
        data_parallel_rank: int = 0, map_events: bool = False, map_batch: bool = False,
    ) -> None:
        import zmq

        endpoint = offset_port(endpoint, data_parallel_rank)
        if replay_endpoint is not None:
            replay_endpoint = offset_port(replay_endpoint, data_parallel_rank)
        self._rank, self._map_events, self._map_batch = data_parallel_rank, map_events, map_batch
        #: What the batches look like (``/sim/stats``): the rank they carry, and whether events and batch are maps.
        self.encoding = {
            "data_parallel_rank": data_parallel_rank, "events": "map" if map_events else "array",
            "batch": "map" if map_batch else "array",
        }

        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = self._open(self._pub, endpoint, bind=None)
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._open(self._replay, replay_endpoint, bind=True)
        self._topic = topic.encode("utf-8")
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self.published = 0
        self._thread = threading.Thread(target=self._run, name="narwhal-sim-kv-events", daemon=True)
        self._thread.start()

    def _open(self, sock: Any, endpoint: str, *, bind: bool | None) -> str:
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if bind is None:
            bind = host == "*" or "::" in host or port in ("0", "*")
        if not bind:
            sock.connect(endpoint)
            return endpoint
        if port in ("0", "*"):
            sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(endpoint)
        return str(sock.getsockopt(self._zmq.LAST_ENDPOINT).decode())

    def publish(self, events: Sequence[KvEvent], ts: float) -> None:
        """Queue one batch (called on the engine's loop)."""
        payload = encode_batch(events, ts, self._rank, map_events=self._map_events, map_batch=self._map_batch)
        self._queue.put(payload)

    def close(self) -> None:
        """Stop the thread (after sending what is queued) and close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        zmq = self._zmq
        pub = self._pub
        replay = self._replay
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    payload = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if payload is None:
                    break
                seq = self._seq
                self._seq += 1
                seq_bytes = seq.to_bytes(8, "big")
                try:
                    pub.send_multipart((self._topic, seq_bytes, payload), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # PUB drops at its high-water mark; the replay buffer still has it
                self._buffer.append((seq, payload))
                self.published += 1
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _serve_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
