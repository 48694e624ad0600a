"""The routing policies and the plan at admission (docs/configure.md, ``[routing]``), as pure functions.

A fleet is built in memory and driven by hand: legs started and ended,
engines taken out of rotation. The choice must depend on nothing else —
the same history gives the same choices.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal_core.config import EngineAddress, RoutingConfig, parse_engine_url
from narwhal_core.fleet import EngineState, Fleet
from narwhal_core.ids import DECODE, PREFILL
from narwhal_core.contract import CHAT, COMPLETIONS
from narwhal_core.policies import RECENT_LEGS
from narwhal_core.prefix import BLOCK_BYTES, BYTES_PER_TOKEN, block_hashes, prompt_key
from narwhal_core.routing import (
    MAX_CANDIDATES,
    LeastLoaded,
    Plan,
    Policy,
    Prefix,
    RoundRobin,
    Routing,
    make_policy,
)

from .router_driver import Driver, completion_body

PREFILLS = tuple(parse_engine_url(f"http://10.0.0.{i}:8100", key="p") for i in range(1, 5))
PREFILLS_URLS = tuple(f"http://10.0.0.{i}:8100" for i in range(1, 5))
DECODES = tuple(parse_engine_url(f"http://10.0.1.{i}:8200", key="d") for i in range(1, 3))
SETTINGS = settings(max_examples=60, deadline=None)


def fleet_of(policy: Policy, prefill: tuple[EngineAddress, ...] = PREFILLS, max_inflight: int = 4) -> Fleet:
    return Fleet(prefill, DECODES, max_inflight_per_engine=max_inflight, unhealthy_after=1, healthy_after=1,
                 policy=policy)


def plan(tokens: int) -> Plan:
    return Plan(True, "configured", tokens)


def send(fleet: Fleet, phase: Any, tokens: int = 0, avoid: tuple[EngineState, ...] = ()) -> EngineState:
    """Choose an engine and start a leg of ``tokens`` there, as Legs.start does."""
    engine = fleet.choose(phase, avoid, plan=plan(tokens))
    assert engine is not None
    fleet.leg_started(engine, tokens if phase == PREFILL else 0)
    return engine


def test_make_policy_names_each_policy() -> None:
    assert isinstance(make_policy(RoutingConfig()), LeastLoaded)
    assert isinstance(make_policy(RoutingConfig(policy="round_robin")), RoundRobin)
    assert make_policy(RoutingConfig(policy="round_robin")).name == "round_robin"
    assert make_policy(RoutingConfig()) is not make_policy(RoutingConfig())  # one per router


def test_round_robin_takes_turns_whatever_the_load() -> None:
    fleet = fleet_of(RoundRobin(), max_inflight=100)
    chosen = [send(fleet, PREFILL, tokens=1000 * (i + 1)).index for i in range(8)]
    assert chosen == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [send(fleet, DECODE).index for _ in range(4)] == [0, 1, 0, 1]


def test_round_robin_skips_engines_out_of_rotation_and_full() -> None:
    fleet = fleet_of(RoundRobin(), max_inflight=1)
    fleet.record_failure(fleet.engines[PREFILL][1])  # unhealthy_after=1: out of rotation
    assert [send(fleet, PREFILL, 10).index for _ in range(3)] == [0, 2, 3]
    assert fleet.choose(PREFILL) is None  # every engine in rotation is full


def test_least_loaded_prefill_goes_to_the_fewest_queued_tokens() -> None:
    fleet = fleet_of(LeastLoaded())
    p = fleet.engines[PREFILL]
    for engine, tokens in zip(p, (5000, 300, 2000, 4000)):
        fleet.leg_started(engine, tokens)
    assert fleet.choose(PREFILL, plan=plan(100)) is p[1]  # fewest tokens, though each runs one leg
    fleet.leg_started(p[1], 6000)
    assert fleet.choose(PREFILL, plan=plan(100)) is p[2]
    fleet.leg_ended(p[0], 5000)
    assert fleet.choose(PREFILL, plan=plan(100)) is p[0]
    assert p[0].queued_tokens == 0 and p[0].outstanding == 0


def test_least_loaded_decode_goes_to_the_fewest_running_legs() -> None:
    fleet = fleet_of(LeastLoaded())
    d = fleet.engines[DECODE]
    fleet.leg_started(d[0])
    fleet.leg_started(d[0])
    fleet.leg_started(d[1])
    assert fleet.choose(DECODE) is d[1]


def test_least_loaded_ties_rotate_instead_of_herding() -> None:
    fleet = fleet_of(LeastLoaded(), max_inflight=100)
    # Equal prompts, each leg ending before the next: every engine is idle at every choice.
    chosen = []
    for _ in range(8):
        engine = send(fleet, PREFILL, 500)
        fleet.leg_ended(engine, 500)
        chosen.append(engine.index)
    assert chosen == [0, 1, 2, 3, 0, 1, 2, 3]


def test_an_engine_failed_on_is_chosen_only_when_no_other_can_take_the_leg() -> None:
    fleet = fleet_of(LeastLoaded(), max_inflight=1)
    p = fleet.engines[PREFILL]
    fleet.leg_started(p[0], 10)
    assert fleet.choose(PREFILL, [p[1]], plan=plan(1)) is p[2]  # idle and not failed on
    for engine in p[2:]:
        fleet.leg_started(engine, 10)
    assert fleet.choose(PREFILL, [p[1]], plan=plan(1)) is p[1]  # the only one with room


OPS = st.lists(
    st.tuples(st.sampled_from(["prefill", "decode", "end", "down"]), st.integers(0, 3), st.integers(1, 9000)),
    max_size=40,
)


def replay(policy: Policy, ops: list[tuple[str, int, int]]) -> list[int | None]:
    """Run a history of choices, leg ends and failures; the engines chosen, in order."""
    fleet = fleet_of(policy, max_inflight=3)
    running: list[tuple[EngineState, int]] = []
    chosen: list[int | None] = []
    for op, which, tokens in ops:
        if op in ("prefill", "decode"):
            engine = fleet.choose(op, plan=plan(tokens))  # type: ignore[arg-type]
            chosen.append(None if engine is None else engine.index)
            if engine is not None:
                spent = tokens if op == "prefill" else 0
                fleet.leg_started(engine, spent)
                running.append((engine, spent))
        elif op == "end" and running:
            engine, spent = running.pop(which % len(running))
            fleet.leg_ended(engine, spent)
        elif op == "down":
            fleet.record_failure(fleet.engines[PREFILL][which])
    return chosen


@SETTINGS
@given(ops=OPS, name=st.sampled_from(["least_loaded", "round_robin", "prefix"]))
def test_the_choice_is_a_pure_function_of_the_history(ops: list[tuple[str, int, int]], name: str) -> None:
    """Same inputs, same choices: two fleets fed the same history choose alike."""
    config = RoutingConfig(policy=name)  # type: ignore[arg-type]
    assert replay(make_policy(config), ops) == replay(make_policy(config), ops)


@SETTINGS
@given(ops=OPS)
def test_least_loaded_always_picks_a_least_loaded_candidate(ops: list[tuple[str, int, int]]) -> None:
    fleet = fleet_of(LeastLoaded(), max_inflight=3)
    running: list[tuple[EngineState, int]] = []
    for op, which, tokens in ops:
        if op == "prefill":
            usable = [e for e in fleet.engines[PREFILL] if e.healthy and e.outstanding < 3]
            engine = fleet.choose(PREFILL, plan=plan(tokens))
            if not usable:
                assert engine is None
                continue
            assert engine is not None
            assert engine.queued_tokens == min(e.queued_tokens for e in usable)
            fleet.leg_started(engine, tokens)
            running.append((engine, tokens))
        elif op == "end" and running:
            engine, spent = running.pop(which % len(running))
            fleet.leg_ended(engine, spent)
    assert all(e.queued_tokens >= 0 for e in fleet.engines[PREFILL])


# ------------------------------------------------------------------ the plan


def routing_of(fleet: Fleet, **config: Any) -> Routing:
    return Routing(RoutingConfig(**config), fleet)


def test_always_and_never_are_fixed_plans_that_weigh_nothing() -> None:
    fleet = fleet_of(LeastLoaded())
    always = routing_of(fleet).plan({"prompt": "x"}, "/v1/completions", 4000)
    assert (always.pd, always.reason, always.tokens, always.hashes, always.candidates) == (
        True, "configured", 1000, None, ()
    )
    never = routing_of(fleet, mode="never").plan({"prompt": "x"}, "/v1/completions", 4000)
    assert (never.pd, never.reason) == (False, "configured")
    single_fleet = Fleet((), DECODES, max_inflight_per_engine=4, unhealthy_after=1, healthy_after=1)
    alone = routing_of(single_fleet, mode="always").plan({"prompt": "x"}, "/v1/completions", 40)
    assert (alone.pd, alone.reason) == (False, "no_prefill_engines")


def test_auto_runs_a_short_prompt_whole_on_a_decode_engine() -> None:
    fleet = fleet_of(LeastLoaded())
    routing = routing_of(fleet, mode="auto", disaggregate_min_uncached_tokens=512)
    short = routing.plan({"prompt": "hi"}, "/v1/completions", 4 * 100)
    assert (short.pd, short.reason) == (False, "short_prompt")
    long = routing.plan({"prompt": "hi"}, "/v1/completions", 4 * 5000)
    assert (long.pd, long.reason) == (True, "long_prompt")
    assert [c[1] for c in long.candidates] == [5000] * 4  # least_loaded knows no cache: every token uncached


def test_auto_runs_whole_on_a_decode_engine_when_the_prefill_queue_is_longer() -> None:
    fleet = fleet_of(LeastLoaded(), max_inflight=100)
    routing = routing_of(fleet, mode="auto", disaggregate_min_uncached_tokens=0)
    for engine in fleet.engines[PREFILL]:
        fleet.leg_started(engine, 20000)
    fleet.leg_started(fleet.engines[PREFILL][2], -5000)  # the least queued: 15000 tokens
    busy = routing.plan({}, "/v1/completions", 4 * 10000)
    assert (busy.pd, busy.reason) == (False, "prefill_queue")
    assert busy.candidates[0] == (PREFILLS[2].url, 10000, 15000)  # the best candidate first
    long = routing.plan({}, "/v1/completions", 4 * 16000)
    assert (long.pd, long.reason) == (True, "long_prompt")  # its own prefill outweighs the queue


def test_auto_with_every_prefill_engine_full_runs_whole() -> None:
    fleet = fleet_of(LeastLoaded(), max_inflight=1)
    for engine in fleet.engines[PREFILL]:
        fleet.leg_started(engine, 10)
    full = routing_of(fleet, mode="auto").plan({}, "/v1/completions", 4 * 10000)
    assert (full.pd, full.reason, full.candidates) == (False, "prefill_queue", ())


def test_the_record_lists_at_most_eight_candidates_best_first() -> None:
    many = tuple(parse_engine_url(f"http://10.0.2.{i}:8100", key="p") for i in range(1, 13))
    fleet = fleet_of(LeastLoaded(), prefill=many)
    for i, engine in enumerate(fleet.engines[PREFILL]):
        fleet.leg_started(engine, 1000 - i)  # the last is least loaded
    weighed = routing_of(fleet, mode="auto", disaggregate_min_uncached_tokens=0).plan({}, "/v1/completions", 40000)
    assert len(weighed.candidates) == MAX_CANDIDATES
    assert weighed.candidates[0][0] == many[-1].url
    assert [c[2] for c in weighed.candidates] == sorted(c[2] for c in weighed.candidates)
    record = weighed.to_json("least_loaded", many[-1].url, DECODES[0].url)
    assert record["candidates"][0] == {"engine": many[-1].url, "uncached_tokens": 10000, "queued_tokens": 989}
    assert (record["mode"], record["reason"], record["policy"]) == ("pd", "long_prompt", "least_loaded")


@pytest.mark.parametrize("mode", ["always", "never", "auto"])
def test_the_plan_is_a_pure_function_of_its_inputs(mode: str) -> None:
    def plans() -> list[tuple[Any, ...]]:
        fleet = fleet_of(LeastLoaded())
        routing = routing_of(fleet, mode=mode)
        out = []
        for size in (100, 4000, 40000, 400000):
            p = routing.plan({"prompt": "x"}, "/v1/completions", size)
            out.append((p.pd, p.reason, p.tokens, p.candidates))
            if p.pd:
                send(fleet, PREFILL, p.tokens)
        return out

    assert plans() == plans()


# ------------------------------------------------------------------ prefix

#: A system prompt every request shares: 8 blocks of the index (4096 tokens).
SHARED = "You are the narwhal help desk. " * 530  # ~16 KB
BLOCK_TOKENS = BLOCK_BYTES // BYTES_PER_TOKEN


def chat(question: str, system: str = SHARED) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def prefix_routing(fleet: Fleet, **config: Any) -> Routing:
    return Routing(RoutingConfig(policy="prefix", **config), fleet)


def prefix_fleet(
    capacity_tokens: int = 2_000_000, max_inflight: int = 100, miss_cost: float = 1.0
) -> tuple[Fleet, Prefix]:
    policy = Prefix(capacity_tokens, miss_cost)
    return fleet_of(policy, max_inflight=max_inflight), policy


def admit(fleet: Fleet, routing: Routing, body: dict[str, Any]) -> tuple[EngineState, Plan]:
    """Admission and the prefill leg's start, as the lifecycle and Legs.start do."""
    p = routing.plan(body, CHAT, 0)
    engine = fleet.choose(PREFILL, plan=p)
    assert engine is not None
    fleet.leg_started(engine, p.tokens)
    fleet.policy.sent(engine, p)
    return engine, p


def test_prefix_keys_the_prompt_once_at_admission() -> None:
    fleet, policy = prefix_fleet()
    p = prefix_routing(fleet).plan(chat("hello"), CHAT, 123456)
    key = prompt_key(chat("hello"), True)
    assert p.hashes == block_hashes(key) and len(p.hashes) >= 8
    assert p.tokens == len(key) // BYTES_PER_TOKEN  # from the key, not the body's size
    assert [c[1] for c in p.candidates] == [p.tokens] * 4  # nothing cached anywhere yet


def test_a_prompt_whose_every_block_one_idle_engine_holds_goes_there() -> None:
    fleet, policy = prefix_fleet()
    routing = prefix_routing(fleet)
    body = chat("the same question, asked twice")
    first, _ = admit(fleet, routing, body)
    fleet.leg_ended(first, fleet.engines[PREFILL][first.index].queued_tokens)  # it finished: idle again
    # The turn has moved past it: without the index the next choice would be another engine.
    assert fleet.choose(PREFILL, plan=Plan(True, "configured", 10)) is not first
    again = routing.plan(body, CHAT, 0)
    assert again.candidates[0][0] == first.url and again.candidates[0][1] < BLOCK_TOKENS
    assert fleet.choose(PREFILL, plan=again) is first


@SETTINGS
@given(questions=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=6), busy=st.integers(0, 3))
def test_a_fully_cached_prompt_goes_to_the_idle_engine_holding_it(questions: list[str], busy: int) -> None:
    fleet, policy = prefix_fleet()
    routing = prefix_routing(fleet)
    for q in questions:
        engine, p = admit(fleet, routing, chat(q))
        fleet.leg_ended(engine, p.tokens)
    holder, p = admit(fleet, routing, chat(questions[-1]))
    fleet.leg_ended(holder, p.tokens)
    for engine in fleet.engines[PREFILL]:  # the others are busy, the holder idle
        if engine is not holder:
            fleet.leg_started(engine, 1 + busy)
    assert fleet.choose(PREFILL, plan=routing.plan(chat(questions[-1]), CHAT, 0)) is holder


def hotspot(fleet: Fleet, *, requests: int, in_flight: int) -> list[int]:
    """One shared prefix, all traffic: ``requests`` chat prompts, the oldest finishing once ``in_flight`` run.

    The index of the prefill engine each went to.
    """
    routing = prefix_routing(fleet)
    running: list[tuple[EngineState, int]] = []
    chosen = []
    for i in range(requests):
        engine, p = admit(fleet, routing, chat(f"question {i}"))
        chosen.append(engine.index)
        running.append((engine, p.tokens))
        if len(running) >= in_flight:
            done, tokens = running.pop(0)
            fleet.leg_ended(done, tokens)
    return chosen


def test_a_hotspot_spreads_once_its_queue_outweighs_the_hit() -> None:
    """One shared prefix, all traffic: its engine takes it while its queue is short, then every engine does."""
    fleet, policy = prefix_fleet()
    chosen = hotspot(fleet, requests=40, in_flight=4)  # three in flight when each is chosen
    # A second request behind the first on the prefix's engine would wait for all of the
    # first's prompt, more than the hit saves: it goes elsewhere, and so the prefix spreads.
    assert chosen[1] != chosen[0], chosen
    shares = [chosen.count(i) for i in range(4)]
    assert min(shares) > 0 and max(shares) <= 1.5 * len(chosen) / 4, shares
    assert all(len(index) >= 8 for index in policy.indexes.values())  # every engine holds the prefix now


def test_without_a_queue_a_shared_prefix_stays_on_its_engine() -> None:
    """Each request done before the next: nothing waits, so the engine holding the prefix takes them all."""
    fleet, policy = prefix_fleet()
    routing = prefix_routing(fleet)
    chosen = []
    for i in range(8):
        engine, p = admit(fleet, routing, chat(f"question {i}"))
        fleet.leg_ended(engine, p.tokens)
        chosen.append(engine.index)
    assert chosen == [chosen[0]] * 8


def test_prefix_ties_go_to_the_engine_that_computed_least_lately() -> None:
    """Idle engines that hold nothing of a prompt: it goes to the one sent the fewest uncached tokens lately.

    Turn order alone would give it to the next engine in turn (the first,
    which computed the longest prompt); with conversations that come back
    to where they started, that piles them on whichever engines chance gave
    them (benchmarks/README.md, "Defaults that win").
    """
    fleet, policy = prefix_fleet()
    routing = prefix_routing(fleet)
    chosen = []
    for i, length in enumerate((40_000, 2_000, 9_000, 6_000, 500)):  # nothing shared: each its own system prompt
        engine, p = admit(fleet, routing, chat("q", system=f"{i} " + "s" * length))
        fleet.leg_ended(engine, p.tokens)  # done before the next: every engine idle at every choice
        chosen.append(engine.index)
    assert chosen == [0, 1, 2, 3, 1]
    assert policy.recent_work(PREFILLS_URLS[0]) > policy.recent_work(PREFILLS_URLS[2]) > policy.recent_work(
        PREFILLS_URLS[3]) > policy.recent_work(PREFILLS_URLS[1]) > 0  # fmt: skip


def test_recent_work_fades_leg_by_leg_and_leaves_with_its_engine() -> None:
    fleet, policy = prefix_fleet()
    routing = prefix_routing(fleet)
    first, p = admit(fleet, routing, chat("q", system="a long one " * 2000))
    fleet.leg_ended(first, p.tokens)
    assert policy.recent_work(first.url) == p.tokens  # nothing cached anywhere: all of it computed
    others = [e for e in fleet.engines[PREFILL] if e is not first]
    for i in range(RECENT_LEGS):
        policy.sent(others[i % 3], plan(10))
    assert policy.recent_work(first.url) == pytest.approx(p.tokens * (1 - 1 / RECENT_LEGS) ** RECENT_LEGS)
    policy.drop(first)
    assert policy.recent_work(first.url) == 0.0


def test_prefix_cost_weighs_queued_tokens_against_cached_ones() -> None:
    fleet, policy = prefix_fleet()
    routing = prefix_routing(fleet)
    holder, p = admit(fleet, routing, chat("q"))
    fleet.leg_ended(holder, p.tokens)
    cached = p.tokens - routing.plan(chat("q"), CHAT, 0).candidates[0][1]
    assert cached >= 8 * BLOCK_TOKENS
    fleet.leg_started(holder, cached - 1)  # its queue costs less than the hit saves: still there
    assert fleet.choose(PREFILL, plan=routing.plan(chat("q"), CHAT, 0)) is holder
    fleet.leg_started(holder, 2)  # now it costs more
    assert fleet.choose(PREFILL, plan=routing.plan(chat("q"), CHAT, 0)) is not holder


@pytest.mark.parametrize("miss_cost", [2.0, 3.0, 5.0])
def test_a_miss_counts_miss_cost_queued_tokens(miss_cost: float) -> None:
    """The holder keeps a prompt until its queue outweighs ``miss_cost`` x the tokens it would save."""
    fleet, policy = prefix_fleet(miss_cost=miss_cost)
    routing = prefix_routing(fleet)
    holder, p = admit(fleet, routing, chat("q"))
    fleet.leg_ended(holder, p.tokens)
    plan = routing.plan(chat("q"), CHAT, 0)
    saved = p.tokens - plan.candidates[0][1]
    assert saved >= 8 * BLOCK_TOKENS
    limit = int(miss_cost * saved)
    fleet.leg_started(holder, limit - 1)  # a queue worth less than the weighed hit: still there
    assert fleet.choose(PREFILL, plan=routing.plan(chat("q"), CHAT, 0)) is holder
    fleet.leg_started(holder, 2)  # now worth more
    assert fleet.choose(PREFILL, plan=routing.plan(chat("q"), CHAT, 0)) is not holder


@pytest.mark.parametrize(("in_flight", "engines_used"), [(2, 1), (6, 2), (8, 3), (12, 4)])
def test_a_hotspot_spreads_with_the_default_miss_cost_too(in_flight: int, engines_used: int) -> None:
    """Weighing a miss 3x moves the point where a hot prefix spreads; it still spreads, more with more load.

    A new copy of the prefix is made only when the queue on the engines
    holding it outweighs 3x the tokens the copy would save (with
    ``miss_cost`` 1 two prefills in flight already spread it, and four use
    every engine): with 2 prefills in flight one engine serves the prefix,
    with 6 two, with 8 three, with 12 all four, and the engines that do not
    take it keep their caches for other prompts. The engines that share it
    share it evenly.
    """
    policy = make_policy(RoutingConfig(policy="prefix"))
    assert isinstance(policy, Prefix) and policy.miss_cost == 3.0
    chosen = hotspot(fleet_of(policy, max_inflight=100), requests=60, in_flight=in_flight)
    shares = [chosen.count(i) for i in range(4)]
    assert sum(1 for n in shares if n) == engines_used, shares
    if engines_used > 1:
        assert max(shares) <= 1.5 * len(chosen) / engines_used, shares


@SETTINGS
@given(
    prompts=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    capacity_blocks=st.integers(0, 12),
)
def test_the_index_never_exceeds_its_bound(prompts: list[int], capacity_blocks: int) -> None:
    fleet, policy = prefix_fleet(capacity_tokens=capacity_blocks * BLOCK_TOKENS)
    routing = prefix_routing(fleet, kv_capacity_tokens=max(1, capacity_blocks * BLOCK_TOKENS))
    for n in prompts:
        admit(fleet, routing, {"prompt": f"{n} " + "x" * (BLOCK_BYTES * (n % 7))})
        assert all(len(index) <= capacity_blocks for index in policy.indexes.values())


def test_an_engine_out_of_rotation_is_forgotten() -> None:
    fleet, policy = prefix_fleet()
    routing = prefix_routing(fleet)
    holder, p = admit(fleet, routing, chat("q"))
    fleet.leg_ended(holder, p.tokens)
    assert len(policy.indexes[holder.url]) > 0
    while fleet.record_failure(holder) != "down":
        pass
    assert len(policy.indexes[holder.url]) == 0
    fleet.record_success(holder, probe=True)  # healthy_after=1: back, holding nothing we know of
    assert holder.healthy
    assert routing.plan(chat("q"), CHAT, 0).candidates[0][1] == p.tokens


def test_prefix_decode_legs_go_by_load_not_by_the_prefill_choice() -> None:
    fleet, policy = prefix_fleet()
    routing = prefix_routing(fleet)
    _, p = admit(fleet, routing, chat("q"))
    d = fleet.engines[DECODE]
    fleet.leg_started(d[0])
    assert fleet.choose(DECODE, plan=p) is d[1]


@SETTINGS
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=25))
def test_prefix_choice_is_a_pure_function_of_the_history(ops: list[tuple[int, bool]]) -> None:
    def run() -> list[tuple[int, bool, str]]:
        fleet, policy = prefix_fleet(max_inflight=3)
        routing = prefix_routing(fleet, mode="auto", disaggregate_min_uncached_tokens=1000)
        out = []
        running: list[tuple[EngineState, int]] = []
        for question, finish in ops:
            p = routing.plan(chat(str(question)), CHAT, 0)
            engine = fleet.choose(PREFILL, plan=p)
            out.append((-1 if engine is None else engine.index, p.pd, p.reason))
            if engine is not None:
                fleet.leg_started(engine, p.tokens)
                policy.sent(engine, p)
                running.append((engine, p.tokens))
            if finish and running:
                engine, tokens = running.pop(0)
                fleet.leg_ended(engine, tokens)
        return out

    assert run() == run()


# ------------------------------------------------------------- the router


def test_a_single_request_retries_its_decode_leg_and_holds_no_kv() -> None:
    """mode never: a failed decode leg is retried as a decode leg (no prefill); nothing to release."""
    d = Driver(routing={"policy": "least_loaded", "mode": "never"}, retry={"backoff_base_s": 0.01, "backoff_max_s": 0.01})
    client = d.post(COMPLETIONS, completion_body())
    assert d.open_legs("prefill") == []
    first = d.leg("decode")
    assert "kv_transfer_params" not in first.body and first.body["max_tokens"] == 64
    d.answer_status(first.bid, 503)
    d.advance(0.05)
    second = d.leg("decode")
    assert second.bid == f"{first.rid}-d2" and second.engine.url != first.engine.url  # not the one failed on
    d.answer_decode(second.bid)
    assert client.last.status == 200
    assert d.pending_controls("release") == []  # no release: no KV was held
    record = d.terminal(first.rid)
    assert record["mode"] == "single"
    assert [(leg["phase"], leg["outcome"], leg["kv"]) for leg in record["legs"]] == [
        ("decode", "http_error", None), ("decode", "ok", None),
    ]
    assert record["routing"] == {
        "policy": "least_loaded", "mode": "single", "reason": "configured",
        "prefill": None, "decode": second.engine.url, "candidates": [],
    }
    d.check_invariants(final=True)


def test_a_batch_in_single_mode_runs_one_decode_leg_per_prompt() -> None:
    d = Driver(routing={"mode": "never"})
    client = d.post(COMPLETIONS, completion_body(prompt=["one", "two"]))
    d.serve_until_done()
    assert client.last.status == 200 and len(client.last.json()["choices"]) == 2
    rid = client.last.rid
    assert rid is not None
    record = d.terminal(rid)
    assert [(leg["phase"], leg["prompt"]) for leg in record["legs"]] == [("decode", 0), ("decode", 1)]
    d.check_invariants(final=True)


def test_prefix_batches_key_each_prompt_and_auto_decides_once() -> None:
    d = Driver(routing={"policy": "prefix", "mode": "auto", "disaggregate_min_uncached_tokens": 0})
    long = "x" * (3 * BLOCK_BYTES)
    client = d.post(COMPLETIONS, completion_body(prompt=[long, "y" + long]))
    d.serve_until_done()
    assert client.last.status == 200
    rid = client.last.rid
    assert rid is not None
    record = d.terminal(rid)
    assert [leg["phase"] for leg in record["legs"]] == ["prefill", "decode", "prefill", "decode"]
    assert (record["routing"]["mode"], record["routing"]["reason"]) == ("pd", "long_prompt")
    policy = d.router.fleet.policy
    assert isinstance(policy, Prefix)
    held = sum(len(index) for index in policy.indexes.values())
    assert held == 6  # each prompt's own three blocks: the second was keyed on its own
    d.check_invariants(final=True)
