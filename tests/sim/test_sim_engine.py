"""The engine core and its block pool, driven by hand (pure: time is an argument).

docs/simulator.md, "The engine core": steps under a token budget, chunked
prefill, one KV block pool for the prefix cache and running requests, KV
events that mirror the pool, stable block hashes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal_sim.engine import (
    DECODE_REMOTE,
    PLAIN,
    PREFILL_REMOTE,
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    EngineCore,
    EngineRequest,
    Finished,
    Started,
    StepConfig,
    Tokens,
)
from narwhal_sim.model import Prompt
from narwhal_sim.tokens import block_hashes, pseudo_token_ids

BS = 4  # a small block size keeps the cases small


def request(rid: str, ids: list[int], max_tokens: int = 3, kind: str = PLAIN, **extra: object) -> EngineRequest:
    return EngineRequest(request_id=rid, kind=kind, prompt_tokens=len(ids), max_tokens=max_tokens,
                         block_hashes=block_hashes(ids, BS), token_ids=ids[: len(ids) // BS * BS],
                         **extra)  # type: ignore[arg-type]  # fmt: skip


def run(core: EngineCore, until: float = float("inf")) -> list[object]:
    """Advance through every step due by ``until``; all outputs."""
    outputs: list[object] = []
    while True:
        t = core.next_event_time()
        if t is None or t > until:
            return outputs
        outputs += core.advance(now=t)


# --------------------------------------------------------------------------- step model


def test_step_time_formula_and_first_token() -> None:
    config = StepConfig()
    assert config.step_s(0, 1) == pytest.approx(0.00705)
    assert config.step_s(1000, 10) == pytest.approx((7 + 80 + 0.5) / 1000)
    assert config.transfer_s(10) == pytest.approx(0.0025)
    core = EngineCore(config)
    core.add_request(EngineRequest(request_id="a", prompt_tokens=1000, max_tokens=3), now=0.0)
    out = run(core)
    assert out[0] == Started("a", 0.0, 0)
    first = out[1]
    assert isinstance(first, Tokens) and first.count == 1 and first.at == pytest.approx(0.087)
    rest = out[2]
    # Two identical decode steps, coalesced into one run.
    assert isinstance(rest, Tokens) and rest.count == 2 and rest.step_s == pytest.approx(0.00705)
    assert rest.at == pytest.approx(0.087 + 2 * 0.00705)
    assert out[3] == Finished("a", rest.at, "length")


def test_prefill_engine_has_a_throughput_and_a_queue_forms() -> None:
    # Four 8192-token prompts at once: one per step (the budget), so TTFT grows by a step each.
    core = EngineCore(StepConfig(prefix_caching=False))
    for i in range(4):
        core.add_request(EngineRequest(request_id=f"r{i}", prompt_tokens=8192, max_tokens=1), now=0.0)
    firsts = [o.at for o in run(core) if isinstance(o, Tokens)]
    step = 0.007 + 8192 * 0.00008
    assert firsts == pytest.approx([step * (i + 1) for i in range(4)])


def test_prefill_and_decode_interfere_on_one_engine() -> None:
    core = EngineCore(StepConfig())
    core.add_request(EngineRequest(request_id="d", prompt_tokens=16, max_tokens=50), now=0.0)
    run(core, until=0.05)
    core.add_request(EngineRequest(request_id="p", prompt_tokens=4000, max_tokens=1), now=0.05)
    gaps = [o.step_s for o in run(core) if isinstance(o, Tokens) and o.request_id == "d"]
    # The decode step shared with the 4,000-token prefill takes as long as that prefill.
    assert max(gaps) == pytest.approx((7 + 4000 * 0.08 + 0.05) / 1000)
    assert min(gaps) == pytest.approx(0.00705)


def test_requests_arriving_during_a_run_cut_it_at_the_step_in_flight() -> None:
    core = EngineCore(StepConfig())
    core.add_request(EngineRequest(request_id="a", prompt_tokens=4, max_tokens=100), now=0.0)
    run(core, until=0.0074)  # the prefill step (ends 0.00732); then a run of 99 decode steps is in flight
    core.add_request(EngineRequest(request_id="b", prompt_tokens=4, max_tokens=2), now=0.02)
    out = run(core)
    a_tokens = [o for o in out if isinstance(o, Tokens) and o.request_id == "a"]
    b_first = next(o for o in out if isinstance(o, Tokens) and o.request_id == "b")
    # At 0.02 one step of a's run is done (reported), the 2nd is in flight (ends 0.02142); the run stops there.
    assert (a_tokens[0].count, a_tokens[1].count) == (1, 1)
    assert a_tokens[0].at == pytest.approx(0.00732 + 0.00705)
    assert a_tokens[1].at == pytest.approx(0.00732 + 2 * 0.00705)
    assert b_first.at == pytest.approx(a_tokens[1].at + (7 + 4 * 0.08 + 0.05) / 1000)
    assert sum(o.count for o in a_tokens) == 99


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    budget=st.integers(8, 200),
    seqs=st.integers(1, 6),
    chunked=st.booleans(),
)
def test_budget_is_never_exceeded_and_chunked_prefill_progresses(
    prompts: list[int], budget: int, seqs: int, chunked: bool
) -> None:
    if not chunked:
        prompts = [min(p, budget) for p in prompts]
    core = EngineCore(StepConfig(block_size=BS, num_gpu_blocks=400, max_num_seqs=seqs, max_num_batched_tokens=budget,
                                 chunked_prefill=chunked, prefix_caching=False))  # fmt: skip
    for i, n in enumerate(prompts):
        core.add_request(EngineRequest(request_id=f"r{i}", prompt_tokens=n, max_tokens=2), now=0.0)
    finished = set()
    progress: dict[str, int] = {}
    for _ in range(10_000):
        step = core._step
        if step is None:
            break
        tokens = sum(n for _, n in step.prefills) + len(step.decodes)
        assert 0 < tokens <= budget
        assert len(core._running) <= seqs
        for seq, n in step.prefills:
            rid = seq.req.request_id
            # Each chunk continues where the last one stopped, and a prompt is done in whole chunks.
            assert seq.computed == progress.get(rid, seq.computed)
            progress[rid] = seq.computed + n
            assert seq.computed + n <= seq.req.prompt_tokens
            if not chunked:
                assert n == seq.req.prompt_tokens
        finished |= {o.request_id for o in core.advance(now=step.end) if isinstance(o, Finished)}
    assert finished == {f"r{i}" for i in range(len(prompts))}
    assert core.pool.num_free == 400


# --------------------------------------------------------------------------- block pool


def test_free_blocks_stay_cached_and_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(4, block_size=1, record_events=True)
    a = pool.allocate(2)
    assert a == [0, 1]
    pool.cache(a, [10, 11], None, [1, 2])
    pool.free(a[::-1])  # tail first: block 1 before block 0
    assert pool.lookup([10, 11]) == [0, 1]  # freed, still cached
    assert pool.num_free == 4
    assert list(pool.free_queue) == [2, 3, 1, 0]
    assert pool.allocate(3) == [2, 3, 1]  # takes the uncached ones, then the LRU cached one
    assert pool.lookup([10, 11]) == [0]  # 11 was evicted with block 1
    assert pool.take_events() == [BlockStored((10, 11), None, (1, 2), 1), BlockRemoved((11,))]


def test_a_pinned_block_is_never_handed_out() -> None:
    pool = BlockPool(3, block_size=1)
    a = pool.allocate(2)
    assert a is not None
    pool.cache(a, [5, 6], None, None)
    pool.free([a[1]])
    pool.touch([a[1]])  # a cache hit pins it again
    assert pool.allocate(2) is None
    assert pool.allocate(1) == [2]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("afth"), st.integers(0, 7), st.integers(1, 4)), max_size=60))
def test_pool_invariants_under_any_operations(ops: list[tuple[str, int, int]]) -> None:
    """Pinned blocks are never free or evicted; LRU order; hits only on cached blocks."""
    pool = BlockPool(8, block_size=1, record_events=True)
    owned: list[list[int]] = []
    counter = 0
    for op, pick, count in ops:
        if op == "a":
            got = pool.allocate(count)
            if got is None:
                assert count > pool.num_free
                continue
            counter += 1
            hashes = [counter * 100 + i for i in range(len(got))]
            pool.cache(got, hashes, None, None)
            owned.append(got)
        elif op == "f" and owned:
            blocks = owned.pop(pick % len(owned))
            order_before = list(pool.free_queue)
            pool.free(blocks[::-1])
            newly = [b for b in blocks[::-1] if pool.ref[b] == 0]
            assert list(pool.free_queue) == order_before + newly  # joined the tail, in order
        elif op == "t" and owned:
            blocks = owned[pick % len(owned)]
            pool.touch(blocks)
            owned.append(list(blocks))
        elif op == "h":
            hashes = list(pool.cached)
            if hashes:
                h = hashes[pick % len(hashes)]
                assert pool.lookup([h]) == [pool.cached[h]]
            assert pool.lookup([999_999]) == []
        pinned = {b for blocks in owned for b in blocks}
        for b in range(8):
            assert (pool.ref[b] > 0) == (b in pinned)
            assert (b in pool.free_queue) == (b not in pinned)
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h


def test_prefix_hit_only_on_resident_blocks() -> None:
    config = StepConfig(block_size=BS, num_gpu_blocks=6, max_num_batched_tokens=64)
    core = EngineCore(config)
    shared = list(range(1, 13))  # 3 full blocks
    core.add_request(request("a", shared + [99], max_tokens=1), now=0.0)
    run(core)
    core.add_request(request("b", shared + [98], max_tokens=1), now=1.0)
    started = [o for o in run(core) if isinstance(o, Started)]
    assert started == [Started("b", 1.0, 12)]
    # A request needing all 6 blocks evicts every cached block.
    core.add_request(request("c", list(range(50, 70)), max_tokens=1), now=2.0)
    run(core)
    core.add_request(request("d", shared + [97], max_tokens=1), now=3.0)
    started = [o for o in run(core) if isinstance(o, Started)]
    assert started == [Started("d", 3.0, 0)]


def test_at_least_one_token_is_computed_on_a_full_hit() -> None:
    core = EngineCore(StepConfig(block_size=BS))
    ids = list(range(8))
    core.add_request(request("a", ids, max_tokens=1), now=0.0)
    run(core)
    core.add_request(request("b", ids, max_tokens=1), now=1.0)
    assert [o for o in run(core) if isinstance(o, Started)] == [Started("b", 1.0, 4)]


def test_kv_held_for_a_remote_decode_counts_against_the_pool_until_freed() -> None:
    core = EngineCore(StepConfig(block_size=BS, num_gpu_blocks=4))
    core.add_request(request("p", list(range(16)), kind=PREFILL_REMOTE), now=0.0)
    out = run(core)
    assert out[-1] == Finished("p", out[-1].at, "length", (0, 1, 2, 3))  # type: ignore[union-attr]
    assert core.pool.num_free == 0 and core.metrics().held_blocks == 4
    core.add_request(request("q", list(range(100, 104)), max_tokens=1), now=1.0)
    assert run(core) == [] and core.num_waiting == 1
    assert core.free_held("p", now=2.0) == (0, 1, 2, 3)
    assert [type(o) for o in run(core)] == [Started, Tokens, Finished]
    assert core.free_held("p", now=3.0) is None


def test_decode_remote_loads_then_decodes_or_recomputes() -> None:
    core = EngineCore(StepConfig(block_size=BS))
    core.add_request(request("d", list(range(10)), max_tokens=3, kind=DECODE_REMOTE), now=0.0)
    assert run(core) == [Started("d", 0.0, 0)]
    assert core.state_of("d") == "loading" and core.num_running == 1
    core.kv_loaded("d", now=0.01)
    out = run(core)
    assert [o.count for o in out if isinstance(o, Tokens)] == [3]  # one coalesced run
    assert out[0].at == pytest.approx(0.01 + 3 * 0.00705)  # type: ignore[union-attr]
    # The pulled prompt's full blocks are cached here now.
    assert len(core.pool.cached) == 2
    core.add_request(request("e", list(range(50, 60)), max_tokens=1, kind=DECODE_REMOTE), now=1.0)
    run(core)
    core.kv_loaded("e", now=1.0, ok=False)  # the pull failed: recompute here
    out = run(core)
    assert out[0] == Started("e", 1.0, 0) and isinstance(out[1], Tokens)
    assert out[1].at == pytest.approx(1.0 + (7 + 10 * 0.08) / 1000)


def test_abort_and_linger_free_slot_and_blocks() -> None:
    core = EngineCore(StepConfig(block_size=BS, num_gpu_blocks=10, max_num_seqs=1))
    core.add_request(request("a", list(range(8)), max_tokens=2, linger=True), now=0.0)
    core.add_request(request("b", list(range(20, 28)), max_tokens=2), now=0.0)
    out = run(core)
    assert out[-1] == Finished("a", out[-1].at, "length")  # type: ignore[union-attr]
    assert core.num_running == 1 and core.num_waiting == 1  # a keeps its slot
    assert core.abort("a", now=1.0)
    assert [o.request_id for o in run(core) if isinstance(o, Finished)] == ["b"]
    assert core.pool.num_free == 10 and not core.abort("a", now=2.0)


# --------------------------------------------------------------------------- KV events mirror the pool


def mirror(events: list[object], state: set[int]) -> None:
    """What a subscriber knows: the set of cached block hashes."""
    for e in events:
        if isinstance(e, BlockStored):
            state.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            state.difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            state.clear()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from("arpdxkc"), st.integers(0, 5), st.integers(1, 40)), max_size=40))
def test_kv_events_exactly_mirror_the_pool(ops: list[tuple[str, int, int]]) -> None:
    core = EngineCore(StepConfig(block_size=BS, num_gpu_blocks=24, max_num_batched_tokens=16), kv_events=True)
    state: set[int] = set()
    live: list[str] = []
    held: list[str] = []
    now = 0.0
    for i, (op, pick, length) in enumerate(ops):
        now += 0.003
        prefixes = [[7] * 8, [1, 2, 3, 4, 5, 6, 7, 8], list(range(30, 42))]
        ids = (prefixes[pick % 3] + list(range(100 + i, 100 + i + length)))[: max(length, 1)]
        rid = f"r{i}"
        if op in "ar":
            core.add_request(request(rid, ids, max_tokens=1 + pick), now=now)
            live.append(rid)
        elif op == "p":
            core.add_request(request(rid, ids, kind=PREFILL_REMOTE), now=now)
            held.append(rid)
        elif op == "d":
            core.add_request(request(rid, ids, max_tokens=2, kind=DECODE_REMOTE), now=now)
            live.append(rid)
        elif op == "x" and live:
            core.abort(live.pop(pick % len(live)), now=now)
        elif op == "k" and held:
            core.free_held(held.pop(pick % len(held)), now=now)
        elif op == "c":
            core.reset_prefix_cache(now=now)
        for out in core.advance(now=now):
            if isinstance(out, Started) and out.request_id in live and core.state_of(out.request_id) == "loading":
                core.kv_loaded(out.request_id, now=now, ok=pick % 2 == 0)
        mirror(core.take_kv_events(), state)
        assert state == set(core.pool.cached)
    run(core)
    mirror(core.take_kv_events(), state)
    assert state == set(core.pool.cached)


def test_block_stored_carries_tokens_parent_and_size() -> None:
    core = EngineCore(StepConfig(block_size=BS, max_num_batched_tokens=4), kv_events=True)
    ids = list(range(1, 11))  # two full blocks, computed in chunks of 4
    core.add_request(request("a", ids, max_tokens=1), now=0.0)
    run(core)
    hashes = block_hashes(ids, BS)
    assert core.take_kv_events() == [
        BlockStored((hashes[0],), None, (1, 2, 3, 4), BS),
        BlockStored((hashes[1],), hashes[0], (5, 6, 7, 8), BS),
    ]


# --------------------------------------------------------------------------- stable hashes and token ids


def test_block_hashes_are_chained_and_process_independent() -> None:
    ids = list(range(40))
    hashes = block_hashes(ids, 16)
    assert len(hashes) == 2 and all(0 <= h < 2**64 for h in hashes)
    assert block_hashes(ids[:16] + [0] * 16, 16)[0] == hashes[0]
    assert block_hashes([1] + ids[1:], 16)[1] != hashes[1]  # a changed first block changes every later hash
    code = "from narwhal_sim.model import Prompt; print(Prompt(text='x' * 200).block_hashes(16))"
    seen = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, check=True).stdout  # fmt: skip
        for seed in ("1", "2")
    }
    assert seen == {f"{Prompt(text='x' * 200).block_hashes(16)}\n"}


def test_documented_hash_recipe() -> None:
    import hashlib

    ids = list(range(16))
    first = hashlib.sha256(bytes(8) + b"".join(t.to_bytes(4, "big") for t in ids)).digest()
    assert block_hashes(ids, 16) == [int.from_bytes(first[:8], "big")]
    import zlib

    assert pseudo_token_ids("abcdefghi") == [zlib.crc32(c.encode()) % 128_256 for c in ("abcd", "efgh", "i")]
    assert Prompt(text="a" * 63).block_hashes(16) == block_hashes(pseudo_token_ids("a" * 63), 16)


def per_token(outputs: list[object]) -> list[tuple[str, int, float]]:
    """Outputs as (request, token number, time) per token, runs expanded."""
    seen: dict[str, int] = {}
    out = []
    for o in outputs:
        if isinstance(o, Tokens):
            for k in range(o.count):
                seen[o.request_id] = seen.get(o.request_id, 0) + 1
                out.append((o.request_id, seen[o.request_id], round(o.at - (o.count - 1 - k) * o.step_s, 9)))
    return sorted(out)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.floats(0, 0.2), st.integers(1, 3000), st.integers(1, 40), st.booleans()),
                min_size=1, max_size=15))  # fmt: skip
def test_coalesced_runs_give_the_same_tokens_at_the_same_times(arrivals: list[tuple[float, int, int, bool]]) -> None:
    """The server's driver (one step at a time) and the virtual-time driver (runs) agree token by token."""
    results = []
    for coalesce in (False, True):
        core = EngineCore(StepConfig(max_num_batched_tokens=2048, max_num_seqs=4), coalesce=coalesce)
        outputs: list[object] = []
        events = sorted((t, i, n, m, abort) for i, (t, n, m, abort) in enumerate(arrivals))
        for t, i, n, m, abort in events:
            outputs += run(core, until=t)
            core.add_request(EngineRequest(request_id=f"r{i}", prompt_tokens=n, max_tokens=m), now=t)
            outputs += core.advance(now=t)
            if abort:
                core.abort(f"r{(i * 7 + 3) % len(arrivals)}", now=t)  # maybe running, waiting, done or unknown
                outputs += core.advance(now=t)
        outputs += run(core)
        results.append(per_token(outputs))
    assert results[0] == results[1]


def test_next_step_end_walks_a_run_step_by_step() -> None:
    core = EngineCore(StepConfig())
    core.add_request(EngineRequest(request_id="a", prompt_tokens=4, max_tokens=4), now=0.0)
    times = []
    while (t := core.next_step_end()) is not None:
        times += [(o.at, o.count) for o in core.advance(now=t) if isinstance(o, Tokens)]
    first = 0.00732
    assert times == [(first, 1)] + [(pytest.approx(first + k * 0.00705), 1) for k in (1, 2, 3)]


def pool_state(core: EngineCore) -> tuple[object, ...]:
    pool = core.pool
    return (list(pool.ref), list(pool.block_hash), dict(pool.cached), list(pool.free_queue), core.now,
            core.steps, core.prefix_cache_queries, core.prefix_cache_hits, core.prompt_tokens_computed,
            core.generation_tokens, core.metrics().held_blocks)  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 90), st.integers(1, 12), st.booleans(), st.booleans()),
             min_size=1, max_size=25),  # fmt: skip
    st.booleans(),
)
def test_serve_now_is_stepping_in_one_pass(ops: list[tuple[int, int, int, bool, bool]], chunked: bool) -> None:
    config = StepConfig(block_size=BS, num_gpu_blocks=40, max_num_batched_tokens=32 if chunked else 100,
                        chunked_prefill=chunked)  # fmt: skip
    fast, slow = EngineCore(config, kv_events=True), EngineCore(config, kv_events=True)
    held: list[str] = []
    for i, (prefix, length, max_tokens, remote, release) in enumerate(ops):
        ids = ([prefix] * 12 + list(range(1000 + i, 1000 + i + length)))[:length]
        now = i * 0.5
        kind = PREFILL_REMOTE if remote else PLAIN
        if release and held:
            rid = held.pop(0)
            assert fast.free_held(rid, now=now) == slow.free_held(rid, now=now)
            assert fast.run_until_idle() == slow.run_until_idle()
        outs = []
        for core, one_pass in ((fast, True), (slow, False)):
            request = EngineRequest(request_id=f"r{i}", kind=kind, prompt_tokens=len(ids), max_tokens=max_tokens,
                                    block_hashes=block_hashes(ids, BS), token_ids=ids[: len(ids) // BS * BS])  # fmt: skip
            if one_pass:
                outs.append(core.serve_now(request, now=now))
            else:
                core.add_request(request, now=now)
                outs.append(core.run_until_idle())
        assert outs[0] == outs[1]
        if remote and outs[0] and isinstance(outs[0][-1], Finished):
            held.append(f"r{i}")
        assert pool_state(fast) == pool_state(slow)
        assert fast.take_kv_events() == slow.take_kv_events()
