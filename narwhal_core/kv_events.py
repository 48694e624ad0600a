"""An engine's KV-cache events, decoded: vLLM's ``KVEventBatch`` payloads, and the order they came in.

vLLM (``vllm/distributed/kv_events.py``: the msgspec structs ``KVEventBatch``,
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, all
``array_like=True`` and tagged; frames written by
``ZmqEventPublisher._publisher_thread``; replay by
``ZmqEventPublisher._service_replay``) publishes on a ZMQ PUB socket, one
message of three frames per batch: the topic, the sequence number (8 bytes,
big-endian, from 0) and the msgpack payload ``[ts, [event, ...], dp_rank]``
(docs/routing.md, "KV events"). Later vLLM versions append fields to the
arrays (``medium``, ``lora_name``, ``extra_keys``, ``group_idx``); they are
read when present and ignored otherwise. Since vLLM dropped ``array_like``
from its event structs (vllm-project/vllm#42892, first released in 0.24.0),
each event is a map of its fields by name with its tag under ``"type"``; and
at vLLM commit ``0181ea3173e5`` the batch's own struct (``EventBatch``) is no
longer ``array_like`` either, so the batch is the map ``{"ts": ..., "events":
[...], "data_parallel_rank": ...}``. Every combination is read. An event of
a kind this module does not know (a later vLLM's) is skipped, not fatal to
its batch.

This module is pure: the runtime's subscriber owns the sockets and feeds the
frames to a :class:`KvStream`, which decodes them and says when the
sequence has a gap the replay socket must fill. Nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, Final

import attrs
import msgpack  # type: ignore[import-untyped]

__all__ = [
    "BlockStored", "BlockRemoved", "AllBlocksCleared", "KvEvent", "KvEventError",
    "decode_batch", "decode_seq", "KvStream", "StreamStep", "REPLAY_END", "RESTARTED",
]

#: A :class:`StreamStep`'s problem when the publisher started again (an engine restart): its cache is empty.
RESTARTED: Final = "sequence restarted"
#: The sequence number that ends a replay (-1, signed).
REPLAY_END: Final = -1


class KvEventError(ValueError):
    """A payload that is not a ``KVEventBatch`` as vLLM writes it; the message says what is wrong."""


@attrs.frozen
class BlockStored:
    """Blocks the engine's prefix cache now holds, each the hash of its tokens chained to its parent's."""

    #: The engine's hashes of the new blocks, in prompt order.
    block_hashes: tuple[int, ...]
    #: The engine's hash of the block before the first one (``None``: the first is the prompt's first block).
    parent_block_hash: int | None
    #: The tokens of every new block, ``block_size`` each, in order.
    token_ids: tuple[int, ...]
    #: Tokens per block.
    block_size: int
    #: The storage tier (``"GPU"``, ``"CPU"``, ...; ``None`` from vLLM versions that do not send it).
    medium: str | None = None
    #: The KV-cache group (hybrid models keep one per attention kind; ``None`` if not sent).
    group_idx: int | None = None


@attrs.frozen
class BlockRemoved:
    """Blocks the engine evicted from its prefix cache."""

    #: The engine's hashes of the evicted blocks.
    block_hashes: tuple[int, ...]
    #: The storage tier they left (``None`` if not sent).
    medium: str | None = None
    #: The KV-cache group they left (``None`` if not sent).
    group_idx: int | None = None


@attrs.frozen
class AllBlocksCleared:
    """The engine emptied its prefix cache (vLLM's ``reset_prefix_cache``)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _hash(value: Any, what: str) -> int:
    """An engine block hash: vLLM sends an int (``ExternalBlockHash``) or, in some versions, bytes."""
    if type(value) is int:
        return value
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big")
    raise KvEventError(f"{what} is not an int or bytes: {type(value).__name__}")


def _hashes(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KvEventError(f"{what} is not an array")
    return tuple(_hash(v, what) for v in value)


def _medium(fields: list[Any], at: int) -> str | None:
    value = fields[at] if len(fields) > at else None
    return value if isinstance(value, str) else None


def _group(fields: list[Any], at: int) -> int | None:
    value = fields[at] if len(fields) > at else None
    return value if type(value) is int else None


# Each event's fields in vLLM's order after its tag (``vllm/distributed/kv_events.py``): the
# positions of the array layout, and the names of the map layout.
_FIELDS: Final = MappingProxyType({
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
})


def _positional(fields: dict[Any, Any]) -> list[Any]:
    """A map-encoded event as the array layout (absent fields are ``None``, as an omitted trailing one)."""
    tag = fields.get("type")
    if not isinstance(tag, str):
        raise KvEventError("an event map has no string 'type'")
    names = _FIELDS.get(tag, ())
    return [tag, *(fields.get(name) for name in names)]


def _event(fields: Any) -> KvEvent | None:
    if isinstance(fields, dict):
        fields = _positional(fields)
    if not isinstance(fields, list) or not fields or not isinstance(fields[0], str):
        raise KvEventError("an event is not a tagged array or map")
    tag = fields[0]
    if tag == "BlockStored":
        if len(fields) < 5:
            raise KvEventError("BlockStored has fewer than 4 fields")
        hashes = _hashes(fields[1], "BlockStored.block_hashes")
        parent = None if fields[2] is None else _hash(fields[2], "BlockStored.parent_block_hash")
        tokens = fields[3]
        size = fields[4]
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise KvEventError("BlockStored.token_ids is not an array of ints")
        if type(size) is not int or size <= 0:
            raise KvEventError("BlockStored.block_size is not a positive int")
        # fields[5] is lora_id; [6] medium, [7] lora_name, [8] extra_keys, [9] group_idx (later versions).
        medium = _medium(fields, 6)
        if len(tokens) != size * len(hashes) and (medium is None or medium == "GPU"):
            # (A lower tier's blocks may come without their tokens: vLLM's offloading connector sends
            # placeholders. Nothing routes on those; a GPU block without its tokens is malformed.)
            raise KvEventError(f"BlockStored has {len(tokens)} tokens for {len(hashes)} blocks of {size}")
        return BlockStored(hashes, parent, tuple(tokens), size, medium, _group(fields, 9))
    if tag == "BlockRemoved":
        if len(fields) < 2:
            raise KvEventError("BlockRemoved has no block_hashes")
        return BlockRemoved(_hashes(fields[1], "BlockRemoved.block_hashes"), _medium(fields, 2), _group(fields, 3))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a kind of event a later vLLM sends: not ours to read


def decode_batch(payload: bytes) -> tuple[float, tuple[KvEvent, ...]]:
    """A ``KVEventBatch`` payload: its timestamp and its events (:class:`KvEventError` if malformed)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for bad input
        raise KvEventError(f"payload is not msgpack: {type(exc).__name__}") from None
    if isinstance(batch, dict):
        ts, events = batch.get("ts"), batch.get("events")
        if not isinstance(events, list):
            raise KvEventError("a batch map has no 'events' array")
    elif isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list):
        ts, events = batch[0], batch[1]
    else:
        raise KvEventError("payload is not [ts, [event, ...], ...] or {ts, events, ...}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KvEventError("the batch's ts is not a number")
    decoded = [_event(e) for e in events]
    return float(ts), tuple(e for e in decoded if e is not None)


def decode_seq(frame: bytes) -> int:
    """A sequence-number frame: 8 bytes, big-endian, signed (the replay's end is -1)."""
    if len(frame) != 8:
        raise KvEventError(f"a sequence number is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


@attrs.frozen
class StreamStep:
    """What one message of the stream gave: the events to apply, in order, and whether to ask for a replay."""

    #: Decoded events of every batch newly in order (none for a duplicate or a malformed batch).
    events: tuple[KvEvent, ...] = ()
    #: Ask the replay socket for every batch from this sequence number on (``None``: no gap).
    replay_from: int | None = None
    #: Why the message gave nothing, for the log (``None``: it was applied, or only a duplicate).
    problem: str | None = None


class KvStream:
    """The order of one engine's event stream: which batch comes next, and the gaps to fill.

    A subscriber that starts (or restarts) has missed what the engine
    published before: its first message, whatever its number, makes the
    stream ask for a replay from 0 (from the next expected number after a
    restart), and the live batches are held back until the replay has
    delivered everything before them. Later, a number past the next
    expected one is a gap: replay again. A batch already applied (a number
    below the next expected one) is dropped, so live and replayed copies of
    the same batch apply once.
    """

    __slots__ = ("next_seq", "replaying", "held")

    def __init__(self) -> None:
        #: The sequence number of the next batch to apply (``None``: nothing received yet).
        self.next_seq: int | None = None
        #: A replay was asked for and has not ended.
        self.replaying = False
        #: Live batches received during a replay, by sequence number, applied once it catches up.
        self.held: dict[int, tuple[KvEvent, ...]] = {}

    def message(self, seq: int, payload: bytes) -> StreamStep:
        """A live message (``seq`` from :func:`decode_seq`)."""
        try:
            _, events = decode_batch(payload)
        except KvEventError as exc:
            # A batch that cannot be read is lost: what it said must come from a replay.
            return self._gap(str(exc))
        if self.next_seq is None:
            self.next_seq = 0
            self.held[seq] = events
            return self._ask(0, None) if seq > 0 else self._drain()
        if self.replaying:
            if seq >= self.next_seq:
                self.held[seq] = events
            return StreamStep()
        if seq < self.next_seq:
            # Live numbers only grow: a smaller one is a publisher that started again (an engine
            # restart), with an empty cache and numbers from 0. Start over.
            self.next_seq = 0
            self.held = {seq: events}
            step = self._ask(0, None) if seq > 0 else self._drain()
            return StreamStep((AllBlocksCleared(), *step.events), step.replay_from, RESTARTED)
        if seq > self.next_seq:
            self.held[seq] = events
            return self._ask(self.next_seq, None)
        self.next_seq = seq + 1
        return StreamStep(events)

    def replayed(self, seq: int, payload: bytes) -> StreamStep:
        """A message from the replay socket; ``seq == REPLAY_END`` ends the replay."""
        if seq == REPLAY_END:
            self.replaying = False
            return StreamStep() if self.next_seq is None else self._drain()
        if self.next_seq is None or seq < self.next_seq:
            return StreamStep()
        try:
            _, events = decode_batch(payload)
        except KvEventError as exc:
            return StreamStep(problem=str(exc))
        self.held[seq] = events
        return StreamStep()

    def replay_failed(self) -> None:
        """The replay did not answer (no replay socket, a timeout): go on from what is held, gaps and all.

        The batches held while waiting for it apply at the next
        ``replayed(REPLAY_END, b"")``, in order, over the hole: the caller
        ends the replay that will not come.
        """
        self.replaying = False
        if self.held:
            self.next_seq = min(self.held)

    def restart(self) -> None:
        """The subscriber reconnected: the next message asks for what was published meanwhile (a gap)."""
        self.held.clear()
        self.replaying = False

    def _ask(self, start: int, problem: str | None) -> StreamStep:
        self.replaying = True
        return StreamStep(replay_from=start, problem=problem)

    def _gap(self, problem: str) -> StreamStep:
        if self.next_seq is None:
            self.next_seq = 0
        if self.replaying:
            return StreamStep(problem=problem)
        return self._ask(self.next_seq, problem)

    def _drain(self) -> StreamStep:
        """Apply the held batches that continue the sequence; a hole left after a replay is skipped."""
        held = self.held
        out: list[KvEvent] = []
        assert self.next_seq is not None
        while held:
            seq = min(held)
            if seq < self.next_seq:
                del held[seq]
                continue
            # After a replay nothing more can fill a hole: jump over it.
            out.extend(held.pop(seq))
            self.next_seq = seq + 1
        return StreamStep(tuple(out))

    @staticmethod
    def decode(frames: Sequence[bytes]) -> tuple[int, bytes]:
        """A live message's frames (topic, sequence, payload): its sequence number and payload."""
        if len(frames) != 3:
            raise KvEventError(f"a message has 3 frames, not {len(frames)}")
        return decode_seq(frames[1]), frames[2]
