"""Pure figures for the routing benchmark: the prefix-hit bound and each engine's share of the work.

No I/O, no clock: values in, values out, so ``tests/bench/test_routing_bound.py``
can check them on small hand-made traces.

**The bound.** No placement of requests on engines can hit the prefix cache
more often than one global LRU cache holding the whole fleet's KV capacity
and seeing every request in arrival order: each engine's cache is a part of
that capacity, and a request can only reuse what some earlier request left.
:func:`prefix_bound` replays a workload through such a cache at the engine's
block size, with the engine's rules (docs/simulator.md, "The KV block pool",
which follows vLLM's ``KVCacheManager``):

* a prompt's blocks are its full ``block_tokens``-token pieces; a block is
  named by its position and everything before it (a chained hash), so equal
  blocks after different prefixes are different blocks;
* a request hits the longest run of its leading blocks that are cached, but
  never the block holding its last prompt token (at least one token is
  computed): at most ``(input_length - 1) // block_tokens`` blocks;
* afterwards all its full blocks are cached, the first block most recently
  used (an engine frees a request's last blocks first, so they are evicted
  first), and the least recently used blocks beyond the capacity are evicted.

The workload's prompts are made of trace blocks of ``trace_block_tokens``
(512 in the Mooncake format, docs/bench.md): each trace block id always
becomes the same text, so a trace block is ``trace_block_tokens /
block_tokens`` engine blocks, and the engine block ``j`` of a prompt is
named by the prompt's trace ids up to ``j // per`` and ``j % per``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["Bound", "prefix_bound", "share_of_mean"]


class Bound:
    """Tokens a global LRU cache would have served, of the prompt tokens looked up."""

    __slots__ = ("hits", "queries", "capacity_blocks", "block_tokens")

    def __init__(self, hits: int, queries: int, capacity_blocks: int, block_tokens: int) -> None:
        self.hits = hits
        self.queries = queries
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens

    @property
    def rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None

    def to_json(self) -> dict[str, object]:
        return {"hits": self.hits, "queries": self.queries, "rate": self.rate,
                "capacity_blocks": self.capacity_blocks, "block_tokens": self.block_tokens}  # fmt: skip


def prefix_bound(requests: Iterable[tuple[int, Sequence[int]]], capacity_blocks: int, *,
                 block_tokens: int = 16, trace_block_tokens: int = 512) -> Bound:  # fmt: skip
    """Replay ``(input_length, hash_ids)`` pairs, in order, through one LRU cache of ``capacity_blocks``."""
    if trace_block_tokens % block_tokens:
        raise ValueError("the trace's block must be a whole number of engine blocks")
    per = trace_block_tokens // block_tokens
    chain_ids: dict[tuple[int, int], int] = {}  # (parent chain id, trace id) -> chain id
    lru: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
    hits = queries = 0
    for input_length, hash_ids in requests:
        chain: list[int] = []
        parent = -1
        for trace_id in hash_ids:
            parent = chain_ids.setdefault((parent, trace_id), len(chain_ids))
            chain.append(parent)
        queries += input_length
        hit_blocks = 0
        for j in range((input_length - 1) // block_tokens):
            if (chain[j // per], j % per) not in lru:
                break
            hit_blocks += 1
        hits += hit_blocks * block_tokens
        for j in range(input_length // block_tokens - 1, -1, -1):  # the first block ends most recent
            key = (chain[j // per], j % per)
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return Bound(hits, queries, capacity_blocks, block_tokens)


def share_of_mean(work: Mapping[str, float]) -> dict[str, float | None]:
    """Each engine's work over the mean of ``work`` (1.0 is a fair share); ``None`` when nothing was done."""
    if not work:
        return {}
    mean = sum(work.values()) / len(work)
    return {name: (value / mean if mean > 0 else None) for name, value in work.items()}
