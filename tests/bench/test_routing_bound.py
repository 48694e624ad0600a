"""The routing benchmark's prefix-hit bound (benchmarks/routing_bound.py), on hand-made traces.

A pure function: one LRU cache of the fleet's capacity, at the engine's block
size, with the engine's rules (docs/simulator.md, "The KV block pool").
"""

from __future__ import annotations

import random

import pytest

from narwhal_bench.client import Target
from narwhal_bench.trace import PromptSynth, TraceRequest
from narwhal_bench.virtual import run_virtual

from . import load_benchmark

routing_bound = load_benchmark("routing_bound")

# Engine blocks of 2 tokens, trace blocks of 4 tokens: a trace block is 2 engine blocks.
SMALL = {"block_tokens": 2, "trace_block_tokens": 4}
TRACE = [
    (8, [1, 2]),  # cold: nothing to hit; caches 4 blocks
    (8, [1, 2]),  # the same prompt: every block but the one holding the last token, 3 blocks
    (6, [1, 3]),  # shares trace block 1 only: 2 blocks
    (4, [2]),  # id 2 after nothing is not id 2 after 1: no hit
]


def test_unlimited_capacity_counts_leading_blocks_but_never_the_last_token() -> None:
    bound = routing_bound.prefix_bound(TRACE, 1000, **SMALL)
    assert (bound.hits, bound.queries) == (6 + 4, 8 + 8 + 6 + 4)
    assert bound.rate == pytest.approx(10 / 26)


@pytest.mark.parametrize(("capacity", "hits_of_last"), [(4, 6), (3, 4), (1, 2), (0, 0)])
def test_capacity_evicts_least_recent_and_a_prompts_tail_first(capacity: int, hits_of_last: int) -> None:
    # After the three [1, ...] prompts, the blocks from most to least recent are
    # (1,0) (1,1) (1·3,0) (1·2,0) (1·2,1): a prompt's first block is touched last.
    trace = [*TRACE[:3], (8, [1, 2])]
    base = routing_bound.prefix_bound(trace[:3], capacity, **SMALL).hits
    assert routing_bound.prefix_bound(trace, capacity, **SMALL).hits - base == hits_of_last


def test_engine_blocks_must_tile_trace_blocks() -> None:
    with pytest.raises(ValueError):
        routing_bound.prefix_bound(TRACE, 10, block_tokens=3, trace_block_tokens=4)


def test_share_of_mean() -> None:
    assert routing_bound.share_of_mean({"a": 30, "b": 10, "c": 20}) == {"a": 1.5, "b": 0.5, "c": 1.0}
    assert routing_bound.share_of_mean({"a": 0, "b": 0}) == {"a": None, "b": None}
    assert routing_bound.share_of_mean({}) == {}


def _shared_prefix_trace() -> list[TraceRequest]:
    """24 requests, one a second (none overlaps another), over four shared roots with a few tails;
    prompts in whole 16-token blocks, so that no partial block takes room in the engine's pool."""
    rng = random.Random(7)
    roots = [[rng.randrange(1000) for _ in range(3)] for _ in range(4)]
    out = []
    for i in range(24):
        ids = tuple(rng.choice(roots) + [10_000 + rng.randrange(6) for _ in range(rng.randrange(3))])
        n_in = 16 * rng.randrange(20, 32 * len(ids) + 1)
        out.append(TraceRequest(index=i, arrival_s=float(i), input_length=n_in, output_length=2, hash_ids=ids))
    return out


@pytest.mark.parametrize("capacity", [200, 300, 5000])
def test_the_bound_is_what_one_engine_holding_all_the_capacity_hits(capacity: int) -> None:
    # One prefill engine of the simulator with the whole capacity, requests one at a time: the
    # placement problem is gone, so its own hit counters must come out at (never above) the bound.
    trace = _shared_prefix_trace()
    outcome = run_virtual(trace, Target(base_url="http://virtual"), synth=PromptSynth(), fleet="1P1D",
                          engine_options=[f"num_gpu_blocks={capacity}"])  # fmt: skip
    bound = routing_bound.prefix_bound(((r.input_length, r.hash_ids) for r in trace), capacity)
    assert all(r.ok for r in outcome.results)
    assert outcome.hit_rate is not None and outcome.hit_rate.queries == bound.queries
    assert 0.98 * bound.hits <= outcome.hit_rate.hits <= bound.hits
    if capacity >= 5000:  # nothing evicted: the same blocks, to the token
        assert outcome.hit_rate.hits == bound.hits
