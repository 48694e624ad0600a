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
from narwhal_core.routing import MAX_CANDIDATES, LeastLoaded, Plan, Policy, RoundRobin, Routing, make_policy

PREFILLS = tuple(parse_engine_url(f"http://10.0.0.{i}:8100", key="p") for i in range(1, 5))
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
@given(ops=OPS, name=st.sampled_from(["least_loaded", "round_robin"]))
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
