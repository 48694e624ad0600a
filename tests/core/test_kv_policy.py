"""Routing policy ``kv``: the prefix cost model fed with what the engines' KV events say (docs/routing.md, "KV events").

A fake tokenizer (one token per character) stands in for the runtime's;
events are built as vLLM sends them. The policy must send a prompt to the
engine whose events say it holds the prompt, follow an eviction, fall back
to the approximate index when an engine's stream is stale, and say in the
journal which index decided. Through the router: the events and the stream's
changes are taken (and logged once per change) under ``kv``, and ignored
under the other policies.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import pytest

from narwhal_core.config import Config, EngineConfig, ModelConfig, RoutingConfig, parse_engine_url
from narwhal_core.contract import CHAT, COMPLETIONS
from narwhal_core.events import KvEventsReceived, KvStreamChanged
from narwhal_core.fleet import Fleet
from narwhal_core.ids import PREFILL
from narwhal_core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from narwhal_core.kv_index import KvIndex, token_block_hashes
from narwhal_core.kv_policy import HEAD_CHARS_PER_BLOCK, HeadProbe, KvEventsPolicy, KvKey
from narwhal_core.routing import POLICIES, Plan, Prefix, Routing, StoppedClock, make_policy

from .router_driver import PREFILL_URLS, Driver, completion_body, make_config

BLOCK = 16
STALE_S = 30.0
PREFILLS = tuple(parse_engine_url(f"http://10.0.0.{i}:8100", key="p") for i in range(1, 5))
DECODES = tuple(parse_engine_url(f"http://10.0.1.{i}:8200", key="d") for i in range(1, 3))
#: Long enough for the approximate index too (its blocks are 2,048 bytes).
LONG = "".join(f"Line {i}: the narwhal's tusk is a tooth. " for i in range(160))


class CharTokenizer:
    """One token per character (a token-id prompt as is); a chat's messages joined."""

    def __init__(self) -> None:
        self.calls = 0

    def prompt_token_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        self.calls += 1
        if chat:
            return [ord(c) for m in body["messages"] for c in f"<{m['role']}>{m['content']}"]
        prompt = body["prompt"]
        if isinstance(prompt, list):
            return list(prompt)
        return [ord(c) for c in prompt]


class HeadTokenizer(CharTokenizer):
    """:class:`CharTokenizer` that can also encode a prompt's head (``head_token_ids``), counting each kind of call."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = 0

    def head_token_ids(self, body: dict[str, Any], chat: bool, chars: int) -> list[int] | None:
        self.heads += 1
        if body.get("truncate_prompt_tokens"):
            return None
        return self.prompt_token_ids(body, chat)[:chars]


class BrokenTokenizer:
    def prompt_token_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        raise RuntimeError("no template")


@contextmanager
def kv_allowed() -> Iterator[None]:
    """Build a config naming ``kv`` (until ``routing.policy`` lists it, its check is set aside)."""
    with attrs.validators.disabled():
        yield


def kv_routing_config(**values: Any) -> RoutingConfig:
    with kv_allowed():
        return RoutingConfig(policy="kv", **values)  # type: ignore[arg-type]


def kv_fleet(**values: Any) -> tuple[Fleet, KvEventsPolicy, Routing, StoppedClock]:
    config = kv_routing_config(**values)
    policy = make_policy(config, CharTokenizer())
    assert isinstance(policy, KvEventsPolicy)
    clock = StoppedClock()
    policy.bind(clock)
    fleet = Fleet(PREFILLS, DECODES, max_inflight_per_engine=100, unhealthy_after=1, healthy_after=1, policy=policy)
    return fleet, policy, Routing(config, fleet), clock


def stored(text: str, first_hash: int = 1000, blocks: int | None = None) -> BlockStored:
    """The event an engine sends after computing ``text`` (its full blocks, or the first ``blocks``)."""
    count = len(text) // BLOCK if blocks is None else blocks
    tokens = tuple(ord(c) for c in text[: count * BLOCK])
    return BlockStored(tuple(range(first_hash, first_hash + count)), None, tokens, BLOCK, "GPU")


def admit(fleet: Fleet, routing: Routing, body: dict[str, Any], probe: HeadProbe | None = None) -> tuple[str, Plan]:
    """Admission and the prefill leg, as the lifecycle and Legs.start do; the leg ends at once.

    ``probe``: what the head look found (:meth:`Routing.probe_head`), passed to the plan as the lifecycle does.
    """
    plan = routing.plan(body, COMPLETIONS, 0, probe=probe)
    engine = fleet.choose(PREFILL, plan=plan)
    assert engine is not None
    fleet.leg_started(engine, plan.tokens)
    fleet.policy.sent(engine, plan)
    fleet.leg_ended(engine, plan.tokens)
    return engine.url, plan


def test_kv_is_a_registered_policy_and_needs_a_tokenizer() -> None:
    assert POLICIES["kv"] is KvEventsPolicy and issubclass(KvEventsPolicy, Prefix)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        make_policy(kv_routing_config())
    policy = make_policy(kv_routing_config(kv_block_size=32, kv_events_stale_s=5.0, kv_speculative_ttl_s=0.0),
                         CharTokenizer())
    assert isinstance(policy, KvEventsPolicy)
    assert (policy.block_size, policy.index.stale_s, policy.index.speculative_ttl_s) == (32, 5.0, 0.0)
    assert policy.index.max_blocks == 2_000_000 // 32


@pytest.mark.parametrize(("value", "ok"), [(0, False), (1, True), (4096, True), (4097, False)])
def test_kv_block_size_is_1_to_4096(value: int, ok: bool) -> None:
    if ok:
        assert RoutingConfig(kv_block_size=value).kv_block_size == value
    else:
        with pytest.raises(Exception, match="between 1 and 4096"):
            RoutingConfig(kv_block_size=value)


def test_the_key_holds_both_indexes_hashes_and_the_true_token_count() -> None:
    fleet, policy, routing, _ = kv_fleet()
    plan = routing.plan(completion_body(LONG), COMPLETIONS, 0)
    assert isinstance(plan.hashes, KvKey)
    assert plan.hashes.exact == token_block_hashes([ord(c) for c in LONG], BLOCK)
    assert list(plan.hashes) == Prefix.key(policy, completion_body(LONG), COMPLETIONS)[0]
    assert plan.tokens == len(LONG)
    chat = {"model": "m", "messages": [{"role": "user", "content": LONG}]}
    assert routing.plan(chat, CHAT, 0).tokens == len(LONG) + len("<user>")


def test_the_engine_whose_events_say_it_holds_the_prompt_gets_it() -> None:
    fleet, policy, routing, _ = kv_fleet()
    for e in PREFILLS:
        policy.kv_stream(e.url, True, "connected", 0.0)
    holder = PREFILLS[2].url
    policy.kv_events(holder, [stored(LONG)], 0.0)
    url, plan = admit(fleet, routing, completion_body(LONG + " And a question?"))
    assert url == holder
    cached = len(LONG) // BLOCK * BLOCK
    assert plan.candidates[0] == (holder, plan.tokens - cached, 0)
    record = plan.to_json("kv", holder, None)
    assert record["index"] == "kv"
    assert record["candidates"][0] == {
        "engine": holder, "uncached_tokens": plan.tokens - cached, "queued_tokens": 0,
        "matched_tokens": cached, "index": "kv",
    }
    assert {c["index"] for c in record["candidates"]} == {"kv"}


def test_routing_follows_an_eviction_where_prefix_would_not() -> None:
    fleet, policy, routing, clock = kv_fleet(kv_speculative_ttl_s=0.0)
    for e in PREFILLS:
        policy.kv_stream(e.url, True, "connected", 0.0)
    first, _ = admit(fleet, routing, completion_body(LONG))  # nothing held anywhere: the first in turn
    event = stored(LONG)
    policy.kv_events(first, [event], 0.0)
    again, plan = admit(fleet, routing, completion_body(LONG))
    assert again == first and plan.candidates[0][1] < plan.tokens
    # The engine evicts the prompt's first block: nothing of it can be reused there any more.
    policy.kv_events(first, [BlockRemoved(event.block_hashes[:1], "GPU")], 1.0)
    clock.now = 1.0
    after, plan = admit(fleet, routing, completion_body(LONG))
    assert after != first
    assert all(uncached == plan.tokens for _, uncached, _ in plan.candidates)
    # Under prefix, the same history keeps sending it to the first engine (it never hears of the eviction).
    prefix = Prefix(2_000_000)
    prefix_fleet = Fleet(PREFILLS, DECODES, max_inflight_per_engine=100, unhealthy_after=1, healthy_after=1,
                         policy=prefix)
    prefix_routing = Routing(RoutingConfig(policy="prefix"), prefix_fleet)
    assert len({admit(prefix_fleet, prefix_routing, completion_body(LONG))[0] for _ in range(3)}) == 1


def test_an_engine_whose_stream_is_stale_is_weighed_from_the_approximate_index() -> None:
    fleet, policy, routing, clock = kv_fleet(kv_speculative_ttl_s=0.0)
    holder, other = PREFILLS[1].url, PREFILLS[3].url
    policy.kv_stream(holder, True, "connected", 0.0)
    policy.sent(fleet.find(PREFILL, other), routing.plan(completion_body(LONG), COMPLETIONS, 0))  # type: ignore[arg-type]
    policy.kv_events(holder, [stored(LONG)], 0.0)
    url, plan = admit(fleet, routing, completion_body(LONG))
    assert url == holder and plan.indexes is not None and plan.indexes[0] == "kv"
    assert policy.kv_stream(holder, False, "disconnected", 10.0)
    clock.now = 10.0 + STALE_S - 1
    assert admit(fleet, routing, completion_body(LONG))[0] == holder  # a replay may yet come: still trusted
    clock.now = 10.0 + STALE_S
    url, plan = admit(fleet, routing, completion_body(LONG))
    record = plan.to_json("kv", url, None)
    assert record["index"] == "approximate"
    assert {c["index"] for c in record["candidates"]} == {"approximate"}
    # (The approximate index of each engine knows what Narwhal sent there: both were sent LONG.)
    assert url in (holder, other)
    assert policy.index.blocks(holder) == frozenset()  # dropped, until its events come back
    policy.kv_stream(holder, True, "connected", clock.now)
    assert policy.index_name(fleet.find(PREFILL, holder), plan) == "kv"  # type: ignore[arg-type]


def test_a_prompt_the_tokenizer_cannot_render_is_weighed_approximately_everywhere() -> None:
    config = kv_routing_config()
    policy = KvEventsPolicy.from_config(config, BrokenTokenizer())
    fleet = Fleet(PREFILLS, DECODES, max_inflight_per_engine=100, unhealthy_after=1, healthy_after=1, policy=policy)
    for e in PREFILLS:
        policy.kv_stream(e.url, True, "connected", 0.0)
    plan = Routing(config, fleet).plan(completion_body(LONG), COMPLETIONS, 0)
    assert type(plan.hashes) is list
    assert plan.indexes == ("approximate",) * 4


def test_a_speculative_entry_holds_a_prompt_just_sent_until_its_events_come() -> None:
    fleet, policy, routing, clock = kv_fleet(kv_speculative_ttl_s=2.0)
    for e in PREFILLS:
        policy.kv_stream(e.url, True, "connected", 0.0)
    first, _ = admit(fleet, routing, completion_body(LONG))
    assert admit(fleet, routing, completion_body(LONG))[0] == first  # before any event: speculated
    clock.now = 2.0
    assert admit(fleet, routing, completion_body(LONG))[0] != first  # expired, never confirmed


def test_the_engine_leaving_the_fleet_is_forgotten() -> None:
    fleet, policy, routing, _ = kv_fleet()
    url = PREFILLS[0].url
    policy.kv_events(url, [stored(LONG)], 0.0)
    policy.capacity(fleet.find(PREFILL, url), 64)  # type: ignore[arg-type]
    assert len(policy.index.blocks(url)) == 4
    policy.drop(fleet.find(PREFILL, url))  # type: ignore[arg-type]
    assert url not in policy.index.engines and url not in policy.indexes


# ------------------------------------------------------------------ through the router


def kv_driver(**routing: Any) -> Driver:
    # What policy kv needs besides (where the configuration asks for it): the tokenizer's file (the
    # runtime loads it; here the stand-in is passed in) and the engines' KV-event endpoints.
    model = {"tokenizer": "tokenizer.json"} if "tokenizer" in attrs.fields_dict(ModelConfig) else {}
    engine = {"kv_events": "tcp://{host}:5557"} if "kv_events" in attrs.fields_dict(EngineConfig) else {}
    with kv_allowed():
        config: Config = make_config(routing={"policy": "kv", **routing}, model=model, engine=engine)
    return Driver(config, tokenizer=CharTokenizer())


def test_the_router_logs_each_change_of_a_stream_once() -> None:
    d = kv_driver()
    url = PREFILL_URLS[0]
    d.feed(KvStreamChanged(url, True, "connected"))
    d.feed(KvStreamChanged(url, True, "connected"))
    d.feed(KvStreamChanged(url, False, "disconnected"))
    d.feed(KvStreamChanged(url, False, "replay_failed"))
    d.feed(KvStreamChanged("http://elsewhere:1", False, "disconnected"))  # not an engine of the fleet
    logs = [(log.event, log.fields) for log in d.logs if log.event.startswith("kv_events")]
    assert logs == [
        ("kv_events_live", {"engine": url, "reason": "connected"}),
        ("kv_events_lost", {"level": "warning", "engine": url, "reason": "disconnected",
                            "fallback_after_s": STALE_S}),
    ]
    assert d.router.statistics().kv_events_live == dict.fromkeys(PREFILL_URLS, False)


def test_the_router_sends_a_prompt_where_the_events_say_it_is_held_and_journals_it() -> None:
    d = kv_driver()
    holder = PREFILL_URLS[-1]
    for url in PREFILL_URLS:
        d.feed(KvStreamChanged(url, True, "connected"))
    d.feed(KvEventsReceived(holder, (stored(LONG),)))
    d.feed(KvEventsReceived("http://elsewhere:1", (AllBlocksCleared(),)))  # ignored
    assert d.router.statistics().kv_events_live == dict.fromkeys(PREFILL_URLS, True)
    client = d.post(COMPLETIONS, completion_body(LONG))
    leg = d.leg("prefill")
    assert leg.engine.url == holder
    d.serve_until_done()
    routing = d.terminals()[-1]["routing"]
    assert routing["policy"] == "kv" and routing["index"] == "kv" and routing["prefill"] == holder
    assert routing["candidates"][0]["matched_tokens"] == len(LONG) // BLOCK * BLOCK
    assert client.last.status == 200


def test_a_stream_lost_past_stale_s_falls_back_says_so_and_comes_back_with_its_events() -> None:
    d = kv_driver(kv_events_stale_s=5.0)
    holder = PREFILL_URLS[-1]  # the only engine whose events are subscribed to
    d.feed(KvStreamChanged(holder, True, "connected"))
    d.feed(KvEventsReceived(holder, (stored(LONG),)))
    d.feed(KvStreamChanged(holder, False, "disconnected"))
    d.advance(5.0)
    d.post(COMPLETIONS, completion_body(LONG))
    d.serve_until_done()
    routing = d.terminals()[-1]["routing"]
    assert routing["index"] == "approximate"
    assert [c["index"] for c in routing["candidates"] if c["engine"] == holder] == ["approximate"]
    stale = [log.fields for log in d.logs if log.event == "kv_events_stale"]
    assert stale == [{"level": "warning", "engine": holder, "reason": "lost", "index": "approximate",
                      "stale_s": 5.0}]
    assert d.router.statistics().kv_events_live[holder] is False
    d.feed(KvEventsReceived(holder, (stored(LONG),)))  # its stream speaks again: trusted again
    assert d.logs[-1].event == "kv_events_live" and d.logs[-1].fields["reason"] == "events"
    assert d.router.statistics().kv_events_live[holder] is True


def test_a_block_size_other_than_the_configured_one_is_logged_once() -> None:
    d = kv_driver()
    url = PREFILL_URLS[0]
    wrong = BlockStored((1,), None, tuple(range(32)), 32, "GPU")
    d.feed(KvEventsReceived(url, (wrong,)))
    d.feed(KvEventsReceived(url, (wrong,)))
    assert d.log_events().count("kv_events_unusable") == 1


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin", "prefix"])
def test_other_policies_ignore_kv_events(policy: str) -> None:
    d = Driver(routing={"policy": policy})
    url = PREFILL_URLS[0]
    d.feed(KvStreamChanged(url, True, "connected"))
    d.feed(KvEventsReceived(url, (stored(LONG),)))
    d.feed(KvStreamChanged(url, False, "disconnected"))
    assert not [e for e in d.log_events() if e.startswith("kv_events")]
    assert d.router.statistics().kv_events_live == {}


def head_fleet(tokenizer: Any = None, *, streams: bool = True) -> tuple[Fleet, KvEventsPolicy, Routing, Any]:
    config = kv_routing_config(tokenize_inline_max_bytes=100)
    tok = tokenizer if tokenizer is not None else HeadTokenizer()
    policy = make_policy(config, tok)
    assert isinstance(policy, KvEventsPolicy)
    policy.bind(StoppedClock())
    fleet = Fleet(PREFILLS, DECODES, max_inflight_per_engine=100, unhealthy_after=1, healthy_after=1, policy=policy)
    for e in PREFILLS if streams else ():
        policy.kv_stream(e.url, True, "connected", 0.0)
    return fleet, policy, Routing(config, fleet), tok


def test_a_large_prompt_whose_first_block_no_engine_holds_is_weighed_from_its_head_alone() -> None:
    fleet, policy, routing, tok = head_fleet()
    body = completion_body(LONG)
    probe = routing.probe_head(body, COMPLETIONS)
    assert probe is not None
    assert tok.heads == 1 and tok.calls == 1  # the head only (CharTokenizer's call inside head_token_ids)
    plan = routing.plan(body, COMPLETIONS, len(LONG), probe=probe)
    assert tok.calls == 1  # the whole prompt was never tokenized
    assert isinstance(plan.hashes, KvKey)
    head = [ord(c) for c in LONG[: HEAD_CHARS_PER_BLOCK * BLOCK]]
    # The head's blocks but its last (the tokens near the cut): what a speculative entry holds.
    assert plan.hashes.exact == token_block_hashes(head[: len(head) - BLOCK], BLOCK)
    assert list(plan.hashes) == Prefix.key(policy, body, COMPLETIONS)[0]
    assert all(uncached == plan.tokens for _, uncached, _ in plan.candidates)
    assert plan.indexes is not None and set(plan.indexes) == {"kv"}


def test_a_large_prompt_whose_head_an_engine_holds_whole_is_tokenized_whole_off_the_loop() -> None:
    fleet, policy, routing, tok = head_fleet()
    policy.kv_events(PREFILLS[1].url, [stored(LONG)], 0.0)  # every block of it
    body = completion_body(LONG)
    assert routing.probe_head(body, COMPLETIONS) is None
    assert tok.heads == 1
    # A speculative entry counts too: a prompt just sent there.
    fleet2, policy2, routing2, tok2 = head_fleet()
    url, _ = admit(fleet2, routing2, completion_body(LONG))  # weighed from its head, which is held nowhere
    assert tok2.calls == 1 and routing2.probe_head(body, COMPLETIONS) is None


def test_a_prefix_shorter_than_the_head_is_weighed_from_the_head_alone() -> None:
    # The holder lacks the head's third block: what it holds of the whole prompt is its first two, known
    # without tokenizing the rest.
    fleet, policy, routing, tok = head_fleet()
    holder = PREFILLS[2].url
    policy.kv_events(holder, [stored(LONG[: 2 * BLOCK])], 0.0)
    body = completion_body(LONG)
    probe = routing.probe_head(body, COMPLETIONS)
    assert probe is not None
    url, plan = admit(fleet, routing, body, probe)
    assert tok.calls == 1  # the head's, never the whole prompt's
    assert url == holder
    assert plan.candidates[0] == (holder, plan.tokens - 2 * BLOCK, 0)
    assert plan.to_json("kv", holder, None)["candidates"][0]["matched_tokens"] == 2 * BLOCK


@pytest.mark.parametrize("case", ["no head", "head raises", "truncated", "small", "streams down"])
def test_a_head_that_cannot_tell_has_the_prompt_tokenized_whole_and_no_trusted_stream_none(case: str) -> None:
    class Raising(HeadTokenizer):
        def head_token_ids(self, body: dict[str, Any], chat: bool, chars: int) -> list[int] | None:
            raise RuntimeError("no template")

    tok = {"no head": CharTokenizer(), "head raises": Raising()}.get(case)
    fleet, policy, routing, used = head_fleet(tok)
    body = completion_body(LONG)
    if case == "truncated":
        body["truncate_prompt_tokens"] = 100
    if case == "small":  # under tokenize_inline_max_bytes: tokenized whole, on the loop, no head asked (the
        # lifecycle asks for a head only above it: tests/core/test_tokenize_offloop.py::test_the_bound_decides)
        assert routing.inline_max == 100
        assert routing.plan(body, COMPLETIONS, 100).tokens == len(LONG)
        assert used.heads == 0
        return
    if case == "streams down":  # no engine's events heard from: the approximate index weighs every engine
        fleet, policy, routing, _ = head_fleet(streams=False)
        probe = routing.probe_head(body, COMPLETIONS)
        assert probe is not None
        assert routing.plan(body, COMPLETIONS, len(LONG), probe=probe).indexes == ("approximate",) * len(PREFILLS)
        return
    assert routing.probe_head(body, COMPLETIONS) is None


#: A second large prompt, sharing no block with :data:`LONG`.
OTHER = "".join(f"Row {i}: a narwhal dives a mile deep. " for i in range(160))


def head_hashes(text: str) -> list[int]:
    """The blocks a head look of ``text`` keys on: its head's but the last (CharTokenizer: a token a character)."""
    head = [ord(c) for c in text[: HEAD_CHARS_PER_BLOCK * BLOCK]]
    return token_block_hashes(head[: len(head) - BLOCK], BLOCK)


def test_interleaved_head_looks_each_plan_from_their_own_head() -> None:
    # Two large prompts looked at, then planned, in turn: each plan is made from what its own head look
    # found (its head's blocks, its holder), handed over explicitly, never from whichever look came last.
    fleet, policy, routing, tok = head_fleet()
    holder_a, holder_b = PREFILLS[2].url, PREFILLS[0].url
    policy.kv_events(holder_a, [stored(LONG[: 2 * BLOCK])], 0.0)
    policy.kv_events(holder_b, [stored(OTHER[: 3 * BLOCK], first_hash=5000)], 0.0)
    a, b = completion_body(LONG), completion_body(OTHER)
    probe_a, probe_b = routing.probe_head(a, COMPLETIONS), routing.probe_head(b, COMPLETIONS)
    assert probe_a is not None and probe_b is not None
    plan_a = routing.plan(a, COMPLETIONS, len(LONG), probe=probe_a)
    plan_b = routing.plan(b, COMPLETIONS, len(OTHER), probe=probe_b)
    assert tok.heads == 2 and tok.calls == 2  # the two heads; neither prompt tokenized whole
    assert isinstance(plan_a.hashes, KvKey) and isinstance(plan_b.hashes, KvKey)
    assert plan_a.hashes.exact == head_hashes(LONG) and plan_b.hashes.exact == head_hashes(OTHER)
    assert plan_a.candidates[0] == (holder_a, plan_a.tokens - 2 * BLOCK, 0)
    assert plan_b.candidates[0] == (holder_b, plan_b.tokens - 3 * BLOCK, 0)
    assert not hasattr(policy, "probed")  # the policy keeps nothing of a request between the two calls


def counting_index(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the precise index's queries, by engine URL (a wrapper around ``KvIndex.matched_blocks``)."""
    asked: dict[str, int] = {}
    real = KvIndex.matched_blocks

    def counted(self: KvIndex, url: str, hashes: Sequence[int], now: float) -> int | None:
        asked[url] = asked.get(url, 0) + 1
        return real(self, url, hashes, now)

    monkeypatch.setattr(KvIndex, "matched_blocks", counted)
    return asked


def test_the_index_is_asked_once_per_candidate_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet, policy, routing, _ = head_fleet()
    holder = PREFILLS[2].url
    policy.kv_events(holder, [stored(LONG[: 2 * BLOCK])], 0.0)
    asked = counting_index(monkeypatch)
    # A large prompt weighed from its head: the head look's answers are the weighing's and the pick's.
    body = completion_body(LONG)
    probe = routing.probe_head(body, COMPLETIONS)
    assert probe is not None and dict(probe.matched) == {e.url: 2 if e.url == holder else 0 for e in PREFILLS}
    url, plan = admit(fleet, routing, body, probe)  # weighed, picked at admission, picked again at the leg's start
    assert url == holder and plan.candidates[0] == (holder, plan.tokens - 2 * BLOCK, 0)
    assert asked == dict.fromkeys((e.url for e in PREFILLS), 1)
    # A prompt tokenized whole (no probe): asked once per candidate too, for its weighing and both picks.
    asked.clear()
    url, _ = admit(fleet, routing, completion_body(OTHER))
    assert asked == dict.fromkeys((e.url for e in PREFILLS), 1)
    # A probe is the index's answer at its instant: a plan made later asks again.
    asked.clear()
    clock = policy.clock
    assert isinstance(clock, StoppedClock)
    third = completion_body("".join(f"Note {i}: a tusk senses the sea. " for i in range(160)))  # sent nowhere
    probe = routing.probe_head(third, COMPLETIONS)
    assert probe is not None and asked == dict.fromkeys((e.url for e in PREFILLS), 1)
    clock.now = 0.5
    routing.plan(third, COMPLETIONS, len(third["prompt"]), probe=probe)
    assert asked == dict.fromkeys((e.url for e in PREFILLS), 2)
