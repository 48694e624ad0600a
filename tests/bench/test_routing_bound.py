"""The routing benchmark's prefix-hit bound (benchmarks/routing_bound.py), on hand-made traces.

A pure function: one LRU cache of the fleet's capacity, at the engine's block
size, with the engine's rules (docs/simulator.md, "The KV block pool").
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "routing_bound.py"
_spec = importlib.util.spec_from_file_location("routing_bound", _PATH)
assert _spec is not None and _spec.loader is not None
routing_bound = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(routing_bound)

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
