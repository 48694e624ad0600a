"""vLLM's KV block pool as the engine core uses it, and the KV events it records.

Pure: no sockets, clocks or loops. :class:`BlockPool` holds reference-counted
blocks, a hash → block map of cached full blocks and an LRU queue of free
blocks (a freed full block stays cached until the queue hands it out again);
see docs/simulator.md, "The engine core". The events are the values
:mod:`narwhal_sim.kv_events` puts on the wire.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice

import attrs

__all__ = ["BlockPool", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KvEvent"]


# --------------------------------------------------------------------------- KV events (values)


@attrs.frozen
class BlockStored:
    """Full blocks became cached (vLLM's ``BlockStored``); ``parent_block_hash`` is ``None`` for a first block."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@attrs.frozen
class BlockRemoved:
    """Cached blocks were evicted (vLLM's ``BlockRemoved``)."""

    block_hashes: tuple[int, ...]


@attrs.frozen
class AllBlocksCleared:
    """The whole prefix cache was dropped (vLLM's ``AllBlocksCleared``)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


# --------------------------------------------------------------------------- block pool


class BlockPool:
    """vLLM's block pool: ref-counted blocks, cached full blocks by hash, an LRU free queue.

    * A block with a reference count above 0 is pinned: never handed out, never evicted.
    * :meth:`free` drops one reference; at 0 the block joins the tail of the
      free queue. If it is cached (has a hash) it stays cached there.
    * :meth:`allocate` takes blocks from the head of the free queue (least
      recently freed first); a cached block taken this way is evicted.
    * :meth:`lookup` finds only cached blocks (resident, pinned or in the queue).
    """

    __slots__ = ("num_blocks", "block_size", "ref", "block_hash", "cached", "free_queue", "events",
                 "record_events")  # fmt: skip

    def __init__(self, num_blocks: int, *, block_size: int = 16, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        #: Chained block hash → the block holding it.
        self.cached: dict[int, int] = {}
        #: Free blocks, head = next handed out (and evicted, if cached): an OrderedDict used
        #: as an insertion-ordered set. Not a plain dict: deleting at a dict's head leaves
        #: slots that every later read of the head walks past, so each allocation would
        #: cost in proportion to the blocks freed since the dict last resized.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        #: Events since the last :meth:`take_events` (only when ``record_events``).
        self.events: list[KvEvent] = []
        self.record_events = record_events

    @property
    def num_free(self) -> int:
        """Blocks not pinned (free or cached-and-evictable), like vLLM's ``get_num_free_blocks``."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """``1 - free / total``: vLLM's ``kv_cache_usage_perc`` (1 means 100 percent)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes``."""
        cached = self.cached
        out: list[int] = []
        for h in hashes:
            block = cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def prefix_hits(self, hashes: Sequence[int], prompt_tokens: int) -> list[int]:
        """The cached blocks of a prompt's longest cached prefix, short of its last token (always computed)."""
        if not hashes:
            return []
        hits = self.lookup(hashes)
        if hits:
            limit = (prompt_tokens - 1) // self.block_size
            if len(hits) > limit:
                hits = hits[:limit]
        return hits

    def take(self, needed: int, hits: list[int]) -> list[int] | None:
        """``needed`` blocks for a request: its prefix ``hits`` (pinned), then fresh ones; ``None`` if they do not fit."""
        if hits:
            if needed - len(hits) > self.available_with(hits):
                return None
            self.touch(hits)
            fresh = self.allocate(needed - len(hits))
            assert fresh is not None
            return hits + fresh
        return self.allocate(needed)

    def available_with(self, hits: Sequence[int]) -> int:
        """Blocks :meth:`allocate` could hand out after :meth:`touch` of ``hits``."""
        ref = self.ref
        return len(self.free_queue) - sum(1 for b in hits if ref[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each of ``blocks`` (cache hits), pinning them."""
        ref = self.ref
        queue = self.free_queue
        for b in blocks:
            if ref[b] == 0:
                del queue[b]
            ref[b] += 1

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks from the head of the free queue (evicting cached ones), or ``None``."""
        queue = self.free_queue
        if count > len(queue):
            return None
        # The head of the queue in one read (popping one by one costs several times more).
        out = list(islice(queue, count))
        ref = self.ref
        block_hash = self.block_hash
        cached = self.cached
        removed: list[int] | None = [] if self.record_events else None
        for b in out:
            del queue[b]
            ref[b] = 1
            h = block_hash[b]
            if h is not None:
                # Evicted: block_hash[b] == h exactly when cached[h] == b (cache() keeps both).
                block_hash[b] = None
                del cached[h]
                if removed is not None:
                    removed.append(h)
        if removed:
            self.events.append(BlockRemoved(tuple(removed)))
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block, in order; unpinned blocks join the queue's tail."""
        ref = self.ref
        queue = self.free_queue
        for b in blocks:
            n = ref[b] - 1
            ref[b] = n
            if not n:
                queue[b] = None

    def cache(
        self, blocks: Sequence[int], hashes: Sequence[int], parent: int | None, token_ids: Sequence[int] | None
    ) -> None:
        """Register full ``blocks`` under ``hashes`` (``parent``: the hash before the first).

        A hash already cached in another block keeps that block (the new one
        stays uncached, as vLLM does). ``token_ids`` are the tokens of these
        blocks (``block_size`` each), for the ``BlockStored`` event.
        """
        if len(blocks) != len(hashes):
            raise ValueError("cache() needs one hash per block")
        cached = self.cached
        block_hash = self.block_hash
        if not self.record_events:
            for b, h in zip(blocks, hashes):
                if h not in cached and block_hash[b] is None:
                    cached[h] = b
                    block_hash[b] = h
            return
        # With events: each run of newly cached blocks is one BlockStored naming its parent.
        run_start = -1
        run_parent = parent
        prev = parent
        for i, (b, h) in enumerate(zip(blocks, hashes)):
            if h in cached or block_hash[b] is not None:
                if run_start >= 0:
                    self._stored(hashes, run_start, i, run_parent, token_ids)
                    run_start = -1
            else:
                cached[h] = b
                block_hash[b] = h
                if run_start < 0:
                    run_start, run_parent = i, prev
            prev = h
        if run_start >= 0:
            self._stored(hashes, run_start, len(hashes), run_parent, token_ids)

    def _stored(
        self, hashes: Sequence[int], start: int, end: int, parent: int | None, token_ids: Sequence[int] | None
    ) -> None:
        size = self.block_size
        tokens = tuple(token_ids[start * size : end * size]) if token_ids is not None else ()
        self.events.append(BlockStored(tuple(hashes[start:end]), parent, tokens, size))

    def clear_cache(self) -> None:
        """Forget every cached hash (blocks in use stay in use): vLLM's ``reset_prefix_cache``."""
        for b in self.cached.values():
            self.block_hash[b] = None
        self.cached.clear()
        if self.record_events:
            self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call."""
        events = self.events
        self.events = []
        return events
