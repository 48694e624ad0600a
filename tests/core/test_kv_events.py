"""vLLM's KV events decoded, and the order of an engine's stream kept (docs/routing.md, "KV events").

The shapes are vLLM's (``vllm/distributed/kv_events.py``): ``KVEventBatch``
``[ts, [event, ...], dp_rank]``, or the map ``{ts, events, data_parallel_rank}``
where ``EventBatch`` is not ``array_like`` (vLLM commit ``0181ea3173e5``);
each event a tagged array (``array_like`` structs, older versions sending
fewer trailing fields) or, since vllm-project/vllm#42892, a map of its
fields with the tag under ``"type"``.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal_core.kv_events import (
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventError,
    KvStream,
    decode_batch,
    decode_seq,
)
from narwhal_sim import engine as sim
from narwhal_sim.kv_events import encode_batch

TOKENS = list(range(100, 116))


def pack(events: list[Any], ts: Any = 1.5, *rest: Any) -> bytes:
    payload: bytes = msgpack.packb([ts, events, *rest], use_bin_type=True)
    return payload


def one(event: Any) -> Any:
    _, events = decode_batch(pack([event], 1.5, 0))
    assert len(events) == 1
    return events[0]


# ------------------------------------------------------------------ shapes


@pytest.mark.parametrize(("fields", "medium", "group"), [
    ([[1, 2], None, TOKENS, 8], None, None),  # the oldest: no lora_id
    ([[1, 2], None, TOKENS, 8, None], None, None),  # lora_id
    ([[1, 2], None, TOKENS, 8, None, "GPU"], "GPU", None),  # medium
    ([[1, 2], None, TOKENS, 8, None, "GPU", None], "GPU", None),  # lora_name
    ([[1, 2], None, TOKENS, 8, None, "CPU", None, [None, None], 1, "full_attention"], "CPU", 1),  # groups
])
def test_block_stored_in_every_array_length(fields: list[Any], medium: str | None, group: int | None) -> None:
    event = one(["BlockStored", *fields])
    assert event == BlockStored((1, 2), None, tuple(TOKENS), 8, medium, group)


def test_block_stored_with_a_parent_and_bytes_hashes() -> None:
    big = (2**64 - 1).to_bytes(8, "big")
    sha = bytes(range(32))  # vLLM's sha256 block hashes
    event = one(["BlockStored", [sha], big, TOKENS[:8], 8, 3, "GPU"])
    assert event.block_hashes == (int.from_bytes(sha, "big"),)
    assert event.parent_block_hash == 2**64 - 1


@pytest.mark.parametrize(("fields", "expected"), [
    ([[7, 8]], BlockRemoved((7, 8))),
    ([[7, 8], "GPU"], BlockRemoved((7, 8), "GPU")),
    ([[b"\x01\x02"], "CPU", 2], BlockRemoved((0x0102,), "CPU", 2)),
])
def test_block_removed_in_every_array_length(fields: list[Any], expected: BlockRemoved) -> None:
    assert one(["BlockRemoved", *fields]) == expected


def test_all_blocks_cleared() -> None:
    assert one(["AllBlocksCleared"]) == AllBlocksCleared()


def test_map_encoded_events_as_vllm_sends_them_since_42892() -> None:
    stored = {
        "type": "BlockStored", "block_hashes": [15760518052499183552], "parent_block_hash": None,
        "token_ids": TOKENS, "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
        "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [15760518052499183552], "medium": "GPU"}
    ts, events = decode_batch(pack([stored, removed, {"type": "AllBlocksCleared"}], 1789095808.8, 0))
    assert ts == 1789095808.8
    assert events == (
        BlockStored((15760518052499183552,), None, tuple(TOKENS), 16, "GPU", 0),
        BlockRemoved((15760518052499183552,), "GPU"),
        AllBlocksCleared(),
    )
    # Fields left out (omit_defaults) read as absent.
    assert one({"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS, "block_size": 16}) == (
        BlockStored((1,), None, tuple(TOKENS), 16)
    )


def test_a_map_batch_as_vllm_encodes_it_once_event_batch_is_not_array_like() -> None:
    # vLLM commit 0181ea3173e5: EventBatch without array_like, omit_defaults; the rank always set by publish().
    stored = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": TOKENS,
              "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
    batch = {"ts": 1789095808.8, "events": [stored, {"type": "AllBlocksCleared"}], "data_parallel_rank": 1}
    assert decode_batch(msgpack.packb(batch)) == (1789095808.8, (
        BlockStored((7,), None, tuple(TOKENS), 16, "GPU"), AllBlocksCleared(),
    ))
    # Array events in a map batch, a map without its rank, and keys a later vLLM adds: all read.
    later = {"events": [["BlockRemoved", [7]]], "ts": 2, "extra": {"x": 1}}
    assert decode_batch(msgpack.packb(later)) == (2.0, (BlockRemoved((7,)),))


_hashes = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=3)
_stored = st.builds(lambda h, p, m: BlockStored(tuple(h), p, tuple(range(16 * len(h))), 16, m),
                    _hashes, st.none() | st.integers(0, 2**64 - 1), st.sampled_from([None, "GPU"]))  # fmt: skip
_removed = st.builds(lambda h, m: BlockRemoved(tuple(h), m), _hashes, st.sampled_from([None, "GPU", "CPU"]))
_events = st.lists(_stored | _removed | st.just(AllBlocksCleared()), max_size=5)


def _as_array(event: Any) -> list[Any]:
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, None, event.medium, None]  # fmt: skip
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def _as_map(event: Any) -> dict[str, Any]:
    fields = _as_array(event)
    names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                             "lora_name"), "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}  # fmt: skip
    # (omit_defaults: a None field with a default is left out; these have none, so they are all sent.)
    return {"type": fields[0], **dict(zip(names[fields[0]], fields[1:], strict=True))}


@settings(max_examples=60, deadline=None)
@given(_events, st.booleans(), st.booleans(), st.randoms(use_true_random=False))
def test_every_encoding_of_a_batch_decodes_to_the_same_events(
    events: list[Any], map_events: bool, map_batch: bool, rng: Any
) -> None:
    wire = [(_as_map if map_events and rng.random() < 0.8 else _as_array)(e) for e in events]
    batch = {"ts": 1.0, "events": wire, "data_parallel_rank": 0} if map_batch else [1.0, wire, 0]
    assert decode_batch(msgpack.packb(batch)) == (1.0, tuple(events))


def test_a_lower_tiers_blocks_may_come_without_their_tokens() -> None:
    # vLLM's offloading connector sends placeholders for a lower tier's blocks, with no tokens.
    assert one(["BlockStored", [1, 2], None, [], 16, None, "CPU"]) == BlockStored((1, 2), None, (), 16, "CPU")


def test_an_unknown_kind_of_event_is_skipped_not_fatal() -> None:
    _, events = decode_batch(pack([["CacheLevelUpdated", 1], {"type": "Other"}, ["AllBlocksCleared"]]))
    assert events == (AllBlocksCleared(),)


def test_a_batch_without_its_rank_and_with_an_integer_ts() -> None:
    assert decode_batch(pack([], 3)) == (3.0, ())


@pytest.mark.parametrize(("map_events", "map_batch"), [(False, False), (True, False), (True, True)])
def test_the_simulators_encodings_decode(map_events: bool, map_batch: bool) -> None:
    events = [sim.BlockStored((5,), None, tuple(TOKENS), 16), sim.BlockRemoved((5,)), sim.AllBlocksCleared()]
    payload = encode_batch(events, 2.0, 1, map_events=map_events, map_batch=map_batch)
    assert isinstance(msgpack.unpackb(payload), dict) is map_batch
    assert decode_batch(payload) == (2.0, (
        BlockStored((5,), None, tuple(TOKENS), 16, "GPU"), BlockRemoved((5,), "GPU"), AllBlocksCleared(),
    ))


@pytest.mark.parametrize(("payload", "message"), [
    (b"\xc1", "payload is not msgpack"),
    (msgpack.packb({"ts": 1}), "a batch map has no 'events' array"),
    (msgpack.packb({"ts": 1, "events": {}}), "a batch map has no 'events' array"),
    (msgpack.packb({"events": []}), "the batch's ts is not a number"),
    (msgpack.packb({"ts": "1", "events": []}), "the batch's ts is not a number"),
    (msgpack.packb({"ts": 1, "events": [{"type": 5}]}), "an event map has no string 'type'"),
    (msgpack.packb({"ts": 1, "events": [{"type": "BlockStored", "block_hashes": [1]}]}),
     "BlockStored.token_ids is not an array of ints"),
    (msgpack.packb("x"), "payload is not [ts, [event, ...], ...] or {ts, events, ...}"),
    (msgpack.packb([1.0]), "payload is not [ts, [event, ...], ...] or {ts, events, ...}"),
    (msgpack.packb([1.0, {}]), "payload is not [ts, [event, ...], ...] or {ts, events, ...}"),
    (msgpack.packb(["x", []]), "the batch's ts is not a number"),
    (msgpack.packb([True, []]), "the batch's ts is not a number"),
    (pack([5]), "an event is not a tagged array or map"),
    (pack([[]]), "an event is not a tagged array or map"),
    (pack([[1, 2]]), "an event is not a tagged array or map"),
    (pack([{"block_hashes": [1]}]), "an event map has no string 'type'"),
    (pack([["BlockStored", [1], None, TOKENS]]), "BlockStored has fewer than 4 fields"),
    (pack([["BlockStored", 1, None, TOKENS, 16]]), "BlockStored.block_hashes is not an array"),
    (pack([["BlockStored", ["x"], None, TOKENS, 16]]), "BlockStored.block_hashes is not an int or bytes: str"),
    (pack([["BlockStored", [1], 2.5, TOKENS, 16]]), "BlockStored.parent_block_hash is not an int or bytes: float"),
    (pack([["BlockStored", [1], None, [1, "a"], 16]]), "BlockStored.token_ids is not an array of ints"),
    (pack([["BlockStored", [1], None, TOKENS, 0]]), "BlockStored.block_size is not a positive int"),
    (pack([["BlockStored", [1, 2], None, TOKENS, 16]]), "BlockStored has 16 tokens for 2 blocks of 16"),
    (pack([["BlockStored", [1], None, TOKENS[:4], 16, None, "GPU"]]), "BlockStored has 4 tokens for 1 blocks of 16"),
    (pack([["BlockRemoved"]]), "BlockRemoved has no block_hashes"),
    (pack([{"type": "BlockRemoved"}]), "BlockRemoved.block_hashes is not an array"),
])
def test_malformed_payloads_say_what_is_wrong(payload: bytes, message: str) -> None:
    with pytest.raises(KvEventError) as caught:
        decode_batch(payload)
    assert str(caught.value).split(":")[0] == message.split(":")[0]
    assert str(caught.value).startswith(message)


def test_sequence_numbers_and_frames() -> None:
    assert decode_seq((7).to_bytes(8, "big")) == 7
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == REPLAY_END
    with pytest.raises(KvEventError, match="8 bytes, not 4"):
        decode_seq(b"\0\0\0\1")
    assert KvStream.decode([b"topic", (3).to_bytes(8, "big"), b"p"]) == (3, b"p")
    with pytest.raises(KvEventError, match="3 frames, not 2"):
        KvStream.decode([b"topic", b"p"])


# ------------------------------------------------------------------ the stream


def batch(n: int) -> bytes:
    """Batch number ``n``: one removal naming ``n`` (so the order applied shows)."""
    return pack([["BlockRemoved", [n]]])


def removed(*ns: int) -> tuple[BlockRemoved, ...]:
    return tuple(BlockRemoved((n,)) for n in ns)


def test_a_first_message_numbered_0_applies_at_once() -> None:
    stream = KvStream()
    assert stream.message(0, batch(0)).events == removed(0)
    assert stream.message(1, batch(1)).events == removed(1)
    assert stream.next_seq == 2


def test_a_first_message_later_than_0_asks_for_a_replay_and_holds_the_live_ones() -> None:
    stream = KvStream()
    step = stream.message(3, batch(3))
    assert (step.events, step.replay_from) == ((), 0)
    assert stream.message(4, batch(4)).events == ()  # held while the replay runs
    for n in range(4):
        assert stream.replayed(n, batch(n)).events == ()
    assert stream.replayed(REPLAY_END, b"").events == removed(0, 1, 2, 3, 4)
    assert stream.message(5, batch(5)).events == removed(5)


def test_a_gap_is_replayed_and_duplicates_apply_once() -> None:
    stream = KvStream()
    stream.message(0, batch(0))
    step = stream.message(3, batch(3))
    assert (step.events, step.replay_from) == ((), 1)
    for n in range(4):  # the replay sends from 1, but a publisher may resend 0 too
        stream.replayed(n, batch(n))
    stream.replayed(2, batch(2))
    assert stream.replayed(REPLAY_END, b"").events == removed(1, 2, 3)
    assert stream.replayed(3, batch(3)).events == ()  # late copies: dropped
    assert stream.replayed(REPLAY_END, b"").events == ()


def test_a_replay_that_misses_batches_skips_the_hole() -> None:
    stream = KvStream()
    stream.message(0, batch(0))
    stream.message(4, batch(4))
    stream.replayed(2, batch(2))  # 1 and 3 are gone from the publisher's buffer
    assert stream.replayed(REPLAY_END, b"").events == removed(2, 4)
    assert stream.next_seq == 5


def test_a_replay_that_fails_applies_what_was_held_over_the_hole() -> None:
    stream = KvStream()
    stream.message(0, batch(0))
    assert stream.message(2, batch(2)).replay_from == 1
    stream.message(3, batch(3))
    stream.replay_failed()
    assert not stream.replaying
    assert stream.replayed(REPLAY_END, b"").events == removed(2, 3)  # the caller ends it
    assert stream.message(4, batch(4)).events == removed(4)
    empty = KvStream()
    empty.replay_failed()  # nothing received: nothing to do
    assert empty.replayed(REPLAY_END, b"").events == () and empty.next_seq is None


def test_a_sequence_going_back_is_a_restarted_engine() -> None:
    stream = KvStream()
    for n in range(5):
        stream.message(n, batch(n))
    step = stream.message(0, batch(10))
    assert step.events == (AllBlocksCleared(), BlockRemoved((10,)))
    assert step.problem == "sequence restarted"
    # Its first batches lost: the replay from 0 brings them.
    for n in (1, 2):
        stream.message(n, batch(10 + n))
    step = stream.message(1, batch(20))
    assert (step.events[:1], step.replay_from) == ((AllBlocksCleared(),), 0)
    stream.replayed(0, batch(30))
    assert stream.replayed(REPLAY_END, b"").events == removed(30, 20)


def test_a_reconnected_subscriber_asks_for_what_it_missed() -> None:
    stream = KvStream()
    stream.message(0, batch(0))
    stream.message(1, batch(1))
    stream.restart()
    step = stream.message(4, batch(4))
    assert step.replay_from == 2
    stream.replayed(2, batch(2))
    stream.replayed(3, batch(3))
    assert stream.replayed(REPLAY_END, b"").events == removed(2, 3, 4)


def test_a_malformed_live_batch_is_a_gap_and_a_malformed_replayed_one_a_hole() -> None:
    stream = KvStream()
    stream.message(0, batch(0))
    step = stream.message(1, b"\xc1")
    assert step.replay_from == 1
    assert step.problem is not None and step.problem.startswith("payload is not msgpack")
    assert stream.message(2, b"\xc1").replay_from is None  # already replaying
    problem = stream.replayed(1, b"\xc1").problem
    assert problem is not None and problem.startswith("payload is not msgpack")
    stream.replayed(2, batch(2))
    assert stream.replayed(REPLAY_END, b"").events == removed(2)
    assert KvStream().message(0, b"\xc1").replay_from == 0  # a first message unreadable: all of it
