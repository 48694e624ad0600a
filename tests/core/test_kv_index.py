"""The index of what each engine holds, from its KV events (docs/routing.md, "KV events").

The heart of it is a Hypothesis state machine: several simulated engines
cache prompts and evict blocks in any order, publishing vLLM's events
(the simulator's encoder, ``narwhal_sim/kv_events.py``); messages are lost
in transit and streams break and come back; routing queries, prefills sent,
engine removals and the passing of time interleave with all of it. After
every step:

* what each engine's :class:`~narwhal_core.kv_events.KvStream` delivered is
  exactly what the engine published, in order, without a duplicate (a gap
  is filled by the replay it asks for);
* the index equals a simple reference model fed the same events: a dict of
  the engine's hash -> the whole token prefix its block ends (hashed from
  the prompt's first token, not chained from a parent), oldest first, cut
  to the same bound;
* a query counts the leading blocks of a prompt the model holds, or says
  ``None`` (fall back) exactly when the model's stream rules say so.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from narwhal_core.kv_events import REPLAY_END, AllBlocksCleared, BlockRemoved, BlockStored, KvStream
from narwhal_core.kv_index import KvIndex, token_block_hashes
from narwhal_sim import engine as sim
from narwhal_sim.kv_events import encode_batch

BLOCK = 4
STALE_S = 10.0
TTL_S = 2.0
URLS = ("http://p1:8000", "http://p2:8000", "http://p3:8000")


def naive_hashes(tokens: list[int], block: int) -> list[int]:
    """The documented chain, written out: XXH3-64 of each block's ids (4-byte little-endian) seeded with the last."""
    out, value = [], 0
    for start in range(0, len(tokens) - block + 1, block):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + block])
        value = xxhash.xxh3_64_intdigest(data, value)
        out.append(value)
    return out


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 8))
@settings(max_examples=50, deadline=None)
def test_token_block_hashes_are_the_documented_chain(tokens: list[int], block: int) -> None:
    assert token_block_hashes(tokens, block) == naive_hashes(tokens, block)
    # A chain continued from a parent equals the chain of the whole.
    whole = token_block_hashes(tokens, block)
    if len(whole) >= 2:
        assert token_block_hashes(tokens[block:], block, whole[0]) == whole[1:]


def test_a_prompt_matches_up_to_its_first_block_missing() -> None:
    index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=0, max_blocks=100)
    url = URLS[0]
    tokens = list(range(16))
    hashes = token_block_hashes(tokens, BLOCK)
    assert index.matched_blocks(url, hashes, 0.0) is None  # never heard from
    index.apply(url, [BlockStored((11, 12), None, tuple(tokens[:8]), BLOCK, "GPU")], 0.0)
    assert index.matched_blocks(url, hashes, 0.0) == 2
    index.apply(url, [BlockStored((13,), 12, tuple(tokens[8:12]), BLOCK)], 0.0)
    assert index.matched_blocks(url, hashes, 0.0) == 3
    index.apply(url, [BlockRemoved((12,), "GPU")], 0.0)
    assert index.matched_blocks(url, hashes, 0.0) == 1  # block 2 is held, but not block 1
    index.apply(url, [AllBlocksCleared()], 0.0)
    assert index.matched_blocks(url, hashes, 0.0) == 0


def test_a_chain_whose_parent_is_unknown_is_skipped_and_counted() -> None:
    index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=0, max_blocks=100)
    url = URLS[0]
    index.apply(url, [BlockStored((2, 3), 999, tuple(range(8)), BLOCK)], 0.0)
    assert index.blocks(url) == frozenset()
    assert index.engines[url].unplaced == 2


def test_other_tiers_groups_and_block_sizes_are_not_indexed() -> None:
    index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=0, max_blocks=100)
    url = URLS[0]
    tokens = tuple(range(4))
    assert index.apply(url, [BlockStored((1,), None, tokens, BLOCK, "CPU")], 0.0) is None
    assert index.apply(url, [BlockStored((2,), None, tokens, BLOCK, "GPU", 1)], 0.0) is None
    assert index.blocks(url) == frozenset()
    problem = index.apply(url, [BlockStored((3,), None, tokens * 2, 8)], 0.0)
    assert problem == "block_size 8, not routing.kv_block_size 4"
    assert index.apply(url, [BlockStored((3,), None, tokens * 2, 8)], 0.0) is None  # said once
    assert index.apply(URLS[1], [BlockStored((5, 6), None, tokens, BLOCK)], 0.0) == (
        "BlockStored with 4 tokens for 2 blocks of 4"
    )
    assert index.blocks(URLS[1]) == frozenset()
    index.apply(url, [BlockStored((4,), None, tokens, BLOCK)], 0.0)
    index.apply(url, [BlockRemoved((4,), "CPU")], 0.0)  # another tier's copy left: the GPU's stays
    assert index.blocks(url) == frozenset(token_block_hashes(list(tokens), BLOCK))


def test_the_bound_drops_the_oldest_stored_entries() -> None:
    index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=0, max_blocks=2)
    url = URLS[0]
    tokens = list(range(12))
    index.apply(url, [BlockStored((1, 2, 3), None, tuple(tokens), BLOCK)], 0.0)
    hashes = token_block_hashes(tokens, BLOCK)
    assert index.blocks(url) == frozenset(hashes[1:])
    assert index.matched_blocks(url, hashes, 0.0) == 0  # a miss, never a wrong hit
    assert index.engines[url].overflowed == 1
    index.resize(url, 1)
    assert index.blocks(url) == frozenset(hashes[2:])


def test_a_lost_stream_is_trusted_until_stale_then_dropped_until_heard_again() -> None:
    index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=0, max_blocks=100)
    url = URLS[0]
    tokens = list(range(8))
    hashes = token_block_hashes(tokens, BLOCK)
    assert index.stream(url, True, "connected", 0.0)
    assert not index.stream(url, True, "connected", 0.0)  # no change
    index.apply(url, [BlockStored((1, 2), None, tuple(tokens), BLOCK)], 0.0)
    assert index.stream(url, False, "disconnected", 1.0)
    assert not index.stream(url, False, "disconnected", 2.0)
    assert index.matched_blocks(url, hashes, 1.0 + STALE_S - 0.1) == 2  # a replay may yet fill the gap
    assert index.matched_blocks(url, hashes, 1.0 + STALE_S) is None
    assert index.blocks(url) == frozenset()
    assert index.changes[-1] == (url, "lost")
    assert index.stream(url, True, "connected", 20.0)
    assert index.matched_blocks(url, hashes, 20.0) == 0


def test_a_failed_replay_drops_at_once() -> None:
    index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=0, max_blocks=100)
    url = URLS[0]
    index.apply(url, [BlockStored((1,), None, (1, 2, 3, 4), BLOCK)], 0.0)
    index.stream(url, False, "replay_failed", 1.0)
    assert index.blocks(url) == frozenset()
    assert not index.usable(url, 1.0)


def test_silence_while_prefills_are_sent_falls_back_until_the_next_event() -> None:
    index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=0, max_blocks=100)
    url = URLS[0]
    index.apply(url, [BlockStored((1,), None, (1, 2, 3, 4), BLOCK)], 0.0)
    assert index.changes == [(url, "events")]  # heard from for the first time
    index.changes.clear()
    assert index.usable(url, 100.0)  # silent, but nothing was sent there: still right
    index.sent(url, [5], 100.0)
    index.apply(url, [], 105.0)  # an event (any) answers
    index.sent(url, [5], 106.0)
    assert index.usable(url, 106.0 + STALE_S - 0.1)
    assert not index.usable(url, 106.0 + STALE_S)
    assert not index.usable(url, 106.0 + STALE_S + 1)
    assert index.changes == [(url, "silent")]  # once
    assert len(index.blocks(url)) == 1  # kept: the next events are in order
    index.apply(url, [], 200.0)
    assert index.usable(url, 200.0) and index.changes[-1] == (url, "events")


def test_speculative_entries_count_until_they_expire_or_are_confirmed() -> None:
    index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=TTL_S, max_blocks=100)
    url = URLS[0]
    tokens = list(range(8))
    hashes = token_block_hashes(tokens, BLOCK)
    index.stream(url, True, "connected", 0.0)
    index.sent(url, hashes, 1.0)
    assert index.matched_blocks(url, hashes, 1.0 + TTL_S - 0.1) == 2
    assert index.matched_blocks(url, hashes, 1.0 + TTL_S) == 0
    index.sent(url, hashes, 5.0)
    index.apply(url, [BlockStored((1,), None, tuple(tokens[:4]), BLOCK)], 5.5)  # confirms block 0
    assert index.matched_blocks(url, hashes, 5.0 + TTL_S) == 1


# ---------------------------------------------------------------- the state machine


def key(event: Any) -> tuple[Any, ...]:
    """An event, simulator's or decoded, as comparable values."""
    if isinstance(event, (BlockStored, sim.BlockStored)):
        return ("stored", tuple(event.block_hashes), event.parent_block_hash, tuple(event.token_ids))
    if isinstance(event, (BlockRemoved, sim.BlockRemoved)):
        return ("removed", tuple(event.block_hashes))
    return ("cleared",)


class Engine:
    """A simulated engine: its prefix cache (block prefix -> its hash), and the batches it published."""

    def __init__(self, salt: int) -> None:
        self.salt = salt
        self.cache: dict[tuple[int, ...], int] = {}
        self.published: list[list[Any]] = []
        self.restarted = False

    def engine_hash(self, prefix: tuple[int, ...]) -> int:
        # The engine's own hash: another algorithm and seed than Narwhal's.
        return xxhash.xxh64_intdigest(repr(prefix).encode(), self.salt) | 1


class Model:
    """What the index should hold, from the events delivered, in the simplest terms."""

    def __init__(self, max_blocks: int) -> None:
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.speculative: dict[int, float] = {}
        self.max_blocks = max_blocks
        self.live: bool | None = None
        self.lost_at = 0.0
        self.awaiting: float | None = None
        self.stale = False
        self.silent = False

    def apply(self, events: list[Any]) -> None:
        self.live, self.stale, self.silent, self.awaiting = True, False, False, None
        for event in events:
            if isinstance(event, BlockStored):
                base: tuple[int, ...] = ()
                if event.parent_block_hash is not None:
                    if event.parent_block_hash not in self.entries:
                        continue
                    base = self.entries[event.parent_block_hash]
                for i, theirs in enumerate(event.block_hashes):
                    prefix = base + tuple(event.token_ids[: (i + 1) * BLOCK])
                    self.entries.pop(theirs, None)
                    self.entries[theirs] = prefix
                    self.speculative.pop(token_block_hashes(list(prefix), BLOCK)[-1], None)
                while len(self.entries) > self.max_blocks:
                    self.entries.popitem(last=False)
            elif isinstance(event, BlockRemoved):
                for theirs in event.block_hashes:
                    self.entries.pop(theirs, None)
            else:
                self.entries.clear()
                self.speculative.clear()

    def clear(self) -> None:
        self.entries.clear()
        self.speculative.clear()

    def held(self) -> set[int]:
        return {token_block_hashes(list(prefix), BLOCK)[-1] for prefix in self.entries.values()}

    def usable(self, now: float) -> bool:
        if self.live is None or self.stale or self.silent:
            return False
        if self.live is False:
            if now - self.lost_at < STALE_S:
                return True
            self.stale = True
            self.clear()
            return False
        if self.awaiting is not None and now - self.awaiting >= STALE_S:
            self.silent = True  # entries kept
            return False
        return True

    def matched(self, prompt: list[int], now: float) -> int | None:
        if not self.usable(now):
            return None
        held = self.held()
        count = 0
        for value in token_block_hashes(prompt, BLOCK):
            if value not in held and self.speculative.get(value, now) <= now:
                break
            count += 1
        return count


PROMPT_TOKENS = st.lists(st.integers(0, 50), min_size=BLOCK, max_size=BLOCK)


class IndexMachine(RuleBasedStateMachine):
    """See the module docstring."""

    @initialize(
        base=st.lists(PROMPT_TOKENS, min_size=2, max_size=3),
        max_blocks=st.sampled_from([4, 8, 1000]),
    )
    def setup(self, base: list[list[int]], max_blocks: int) -> None:
        # Prompts that share beginnings: every combination of up to 3 of the base blocks, in order.
        self.prompts = [b1 + b2 + b3 for b1 in base for b2 in [[]] + base for b3 in [[]] + base][:12]
        self.prompts.sort(key=len)
        self.now = 0.0
        self.max_blocks = max_blocks
        self.index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=TTL_S, max_blocks=max_blocks)
        self.engines = {url: Engine(salt) for salt, url in enumerate(URLS)}
        self.streams = {url: KvStream() for url in URLS}
        self.models = {url: Model(max_blocks) for url in URLS}
        #: Connected: live messages reach the stream (else they are lost until it reconnects).
        self.connected = dict.fromkeys(URLS, True)
        #: Seqs delivered in order so far (== the stream's next_seq after each step).
        self.delivered = dict.fromkeys(URLS, 0)

    # -------------------------------------------------------------- plumbing

    def publish(self, url: str, events: list[Any], lose: bool) -> None:
        engine = self.engines[url]
        seq = len(engine.published)
        engine.published.append(events)
        if lose or not self.connected[url]:
            return
        self.step(url, self.streams[url].message(seq, encode_batch(events, self.now)))

    def step(self, url: str, step: Any) -> None:
        stream, engine = self.streams[url], self.engines[url]
        expected: list[Any] = []
        if step.problem == "sequence restarted":
            expected.append(("cleared",))
            self.delivered[url] = 0
        start = self.delivered[url]
        if stream.next_seq is not None and stream.next_seq >= start:
            for batch in engine.published[start : stream.next_seq]:
                expected.extend(key(e) for e in batch)
            self.delivered[url] = stream.next_seq
        assert [key(e) for e in step.events] == expected
        if step.events or expected:
            self.index.apply(url, step.events, self.now)
            self.models[url].apply(list(step.events))
        if step.replay_from is not None:
            for seq, batch in enumerate(engine.published):
                if seq >= step.replay_from:
                    self.step(url, stream.replayed(seq, encode_batch(batch, self.now)))
            self.step(url, stream.replayed(REPLAY_END, b""))

    # ----------------------------------------------------------------- rules

    @rule(url=st.sampled_from(URLS), which=st.integers(0, 11), split=st.integers(0, 3), lose=st.booleans())
    def cache_a_prompt(self, url: str, which: int, split: int, lose: bool) -> None:
        """The engine computes a prompt: it stores its blocks from the first one it lacks."""
        engine = self.engines[url]
        prompt = self.prompts[which % len(self.prompts)]
        prefixes = [tuple(prompt[: (i + 1) * BLOCK]) for i in range(len(prompt) // BLOCK)]
        first = next((i for i, p in enumerate(prefixes) if p not in engine.cache), None)
        if first is None:
            return
        parent = engine.cache[prefixes[first - 1]] if first else None
        hashes = [engine.engine_hash(p) for p in prefixes[first:]]
        for p, h in zip(prefixes[first:], hashes):
            engine.cache[p] = h
        tokens = prompt[first * BLOCK :]
        cut = min(split, len(hashes))
        events = []
        if cut:
            events.append(sim.BlockStored(tuple(hashes[:cut]), parent, tuple(tokens[: cut * BLOCK]), BLOCK))
            parent = hashes[cut - 1]
        if cut < len(hashes):
            events.append(sim.BlockStored(tuple(hashes[cut:]), parent, tuple(tokens[cut * BLOCK :]), BLOCK))
        self.publish(url, events, lose)

    @rule(url=st.sampled_from(URLS), picks=st.lists(st.integers(0, 20), min_size=1, max_size=3), lose=st.booleans())
    def evict(self, url: str, picks: list[int], lose: bool) -> None:
        """The engine evicts blocks, in any order (not only tails)."""
        engine = self.engines[url]
        if not engine.cache:
            return
        cached = sorted(engine.cache)
        gone = {cached[p % len(cached)] for p in picks}
        hashes = tuple(engine.cache.pop(p) for p in sorted(gone))
        self.publish(url, [sim.BlockRemoved(hashes)], lose)

    @rule(url=st.sampled_from(URLS), lose=st.booleans())
    def reset_prefix_cache(self, url: str, lose: bool) -> None:
        self.engines[url].cache.clear()
        self.publish(url, [sim.AllBlocksCleared()], lose)

    @rule(url=st.sampled_from(URLS))
    def empty_batch(self, url: str) -> None:
        """A batch that reaches the subscriber: any gap before it shows."""
        self.publish(url, [], False)

    @precondition(lambda self: any(self.delivered.values()))
    @rule(url=st.sampled_from(URLS))
    def engine_restarts(self, url: str) -> None:
        """The engine restarts: empty cache, numbers from 0 (its first batch reaches the subscriber).

        (A restart whose first batches are all lost, with the next number
        equal to the one expected, cannot be told from the stream going on:
        docs/routing.md, "KV events".)
        """
        if not self.delivered[url] or not self.connected[url]:
            return
        engine = self.engines[url]
        engine.cache.clear()
        engine.published.clear()
        self.publish(url, [], False)

    @rule(url=st.sampled_from(URLS), reason=st.sampled_from(["disconnected", "malformed", "replay_failed"]))
    def stream_lost(self, url: str, reason: str) -> None:
        self.connected[url] = False
        self.streams[url].restart()
        self.index.stream(url, False, reason, self.now)
        model = self.models[url]
        if reason == "replay_failed" or model.live is None:
            model.clear()
            model.stale = True
        if model.live is not False:
            model.live, model.lost_at = False, self.now

    @rule(url=st.sampled_from(URLS))
    def stream_back(self, url: str) -> None:
        self.connected[url] = True
        self.index.stream(url, True, "connected", self.now)
        model = self.models[url]
        model.live, model.stale, model.silent, model.awaiting = True, False, False, None

    @rule(url=st.sampled_from(URLS), which=st.integers(0, 11))
    def prefill_sent(self, url: str, which: int) -> None:
        prompt = self.prompts[which % len(self.prompts)]
        hashes = token_block_hashes(prompt, BLOCK)
        self.index.sent(url, hashes, self.now)
        model = self.models[url]
        if model.awaiting is None:
            model.awaiting = self.now
        if model.speculative and next(iter(model.speculative.values())) <= self.now:
            model.speculative = {v: until for v, until in model.speculative.items() if until > self.now}
        for value in hashes:
            model.speculative[value] = self.now + TTL_S  # (a key already there keeps its place)
        while len(model.speculative) > model.max_blocks:
            del model.speculative[next(iter(model.speculative))]

    @rule(url=st.sampled_from(URLS))
    def engine_removed(self, url: str) -> None:
        """The engine leaves the fleet; one comes back at the same URL, new."""
        self.index.drop(url)
        self.engines[url] = Engine(self.engines[url].salt + 100)
        self.streams[url] = KvStream()
        self.models[url] = Model(self.max_blocks)
        self.connected[url] = True
        self.delivered[url] = 0

    @rule(seconds=st.sampled_from([0.5, 1.5, 3.0, 9.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @rule(url=st.sampled_from(URLS), which=st.integers(0, 11))
    def route(self, url: str, which: int) -> None:
        prompt = self.prompts[which % len(self.prompts)]
        got = self.index.matched_blocks(url, token_block_hashes(prompt, BLOCK), self.now)
        assert got == self.models[url].matched(prompt, self.now)

    # ------------------------------------------------------------ invariants

    @invariant()
    def the_index_is_the_models(self) -> None:
        for url in URLS:
            assert self.index.usable(url, self.now) == self.models[url].usable(self.now)
            assert self.index.blocks(url) == self.models[url].held(), url
            view = self.index.engines.get(url)
            if view is not None:
                assert len(view.by_engine) <= view.max_blocks
                assert sum(view.held.values()) == len(view.by_engine)

    @invariant()
    def caught_up_streams_delivered_everything(self) -> None:
        for url in URLS:
            stream = self.streams[url]
            if self.connected[url] and not stream.replaying and stream.next_seq is not None:
                assert self.delivered[url] == stream.next_seq <= len(self.engines[url].published)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("medium", [None, "GPU"])
def test_the_gpu_tier_is_indexed_whether_named_or_not(medium: str | None) -> None:
    index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=0, max_blocks=10)
    index.apply(URLS[0], [BlockStored((1,), None, (1, 2, 3, 4), BLOCK, medium)], 0.0)
    assert len(index.blocks(URLS[0])) == 1


def test_an_engine_hash_twice_in_one_event_keeps_the_last_block() -> None:
    index = KvIndex(BLOCK, stale_s=STALE_S, speculative_ttl_s=0, max_blocks=10)
    tokens = list(range(8))
    index.apply(URLS[0], [BlockStored((7, 7), None, tuple(tokens), BLOCK)], 0.0)
    assert index.blocks(URLS[0]) == frozenset(token_block_hashes(tokens, BLOCK)[1:])
    view = index.engines[URLS[0]]
    assert sum(view.held.values()) == len(view.by_engine) == 1
