"""The steppable engine core: a vLLM-V1-like scheduler loop over one KV block pool.

Pure: no sockets, clocks, threads or randomness. Time is an argument
(``now``, seconds of modelled GPU time, never decreasing from call to
call). Two drivers run the same core: the asyncio server's
(:mod:`narwhal_sim.driving`, real time scaled by ``--speed``, or instantly
at speed 0) and a discrete-event loop in virtual time. See
docs/simulator.md, "The engine core".

* :class:`StepConfig` — scheduler limits, pool size and the step-time formula
  ``step_base_ms + prefill_tokens × prefill_per_token_ms + decode_seqs × decode_per_seq_ms``.
* :class:`BlockPool` — vLLM's KV block pool: reference-counted blocks, a
  hash → block map of cached full blocks, and an LRU queue of free blocks
  (a freed full block stays cached until the queue hands it out again).
* :class:`EngineCore` — requests in, steps, outputs out.

One engine step (vLLM V1's ``Scheduler.schedule``, simplified): running
requests first — each decoding request one token, each partly prefilled
request its next chunk — then waiting requests in arrival order while the
token budget (``max_num_batched_tokens``), the sequence cap
(``max_num_seqs``) and the pool allow. A request reserves the blocks of its
prompt and output when it is admitted (no preemption). Consecutive
decode-only steps with the same batch are one *run* of identical steps
(any change — an arrival, an abort, a finished KV load — cuts the run at
the step in flight), so a long decode costs the simulator O(1) work.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice

import attrs

__all__ = [
    "PLAIN",
    "PREFILL_REMOTE",
    "DECODE_REMOTE",
    "KINDS",
    "StepConfig",
    "BlockPool",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KvEvent",
    "EngineRequest",
    "Started",
    "Tokens",
    "Finished",
    "EngineOutput",
    "EngineMetrics",
    "EngineCore",
]

#: Prefill and decode both here.
PLAIN = "plain"
#: A prefill leg: one token, then the prompt's KV stays pinned for a remote decode.
PREFILL_REMOTE = "prefill_remote"
#: A decode leg whose prompt KV comes from another engine (the driver moves it).
DECODE_REMOTE = "decode_remote"
KINDS = (PLAIN, PREFILL_REMOTE, DECODE_REMOTE)

_EPS = 1e-12


@attrs.frozen(kw_only=True)
class StepConfig:
    """Scheduler limits, pool size and the step-time model (defaults: Llama-3.1-8B on one H100)."""

    #: Tokens per KV block.
    block_size: int = 16
    #: KV blocks of the engine (28,000 × 16 tokens at 128 KiB per token ≈ 56 GiB).
    num_gpu_blocks: int = 28_000
    #: Requests running at once (slots).
    max_num_seqs: int = 256
    #: Token budget of one step (decode tokens plus prefill tokens).
    max_num_batched_tokens: int = 8192
    #: Split a prompt that does not fit the budget over several steps.
    chunked_prefill: bool = True
    #: Look prompts up in (and add them to) the cache of full blocks.
    prefix_caching: bool = True
    #: Fixed time of one step (a forward pass of the weights: ~16 GB read at ~3.35 TB/s, plus overhead).
    step_base_ms: float = 7.0
    #: Time per prefill token in a step (0.08 ms ≈ 12,500 prompt tokens/s).
    prefill_per_token_ms: float = 0.08
    #: Time per decoding sequence in a step (attention over its KV, sampling).
    decode_per_seq_ms: float = 0.05
    #: Fixed time of a KV transfer to a decode engine.
    kv_transfer_base_ms: float = 2.0
    #: Transfer time per block (2 MiB per 16-token block for Llama-3.1-8B over RDMA).
    kv_transfer_per_block_ms: float = 0.05

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("step_base_ms", "prefill_per_token_ms", "decode_per_seq_ms", "kv_transfer_base_ms",
                     "kv_transfer_per_block_ms"):  # fmt: skip
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a non-negative number")

    def step_s(self, prefill_tokens: int, decode_seqs: int) -> float:
        """Seconds one step takes."""
        return (
            self.step_base_ms + self.prefill_per_token_ms * prefill_tokens + self.decode_per_seq_ms * decode_seqs
        ) / 1000.0

    def transfer_s(self, blocks: int) -> float:
        """Seconds to move ``blocks`` KV blocks from a prefill engine."""
        return (self.kv_transfer_base_ms + self.kv_transfer_per_block_ms * blocks) / 1000.0

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)


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


# --------------------------------------------------------------------------- requests and outputs


@attrs.define(slots=True, kw_only=True, eq=False)
class EngineRequest:
    """One request as the core sees it."""

    #: Unique among the core's requests and held KV (the server uses the KV owner key for prefill legs).
    request_id: str
    #: :data:`PLAIN`, :data:`PREFILL_REMOTE` or :data:`DECODE_REMOTE`.
    kind: str = PLAIN
    #: Prompt length in tokens (at least 1).
    prompt_tokens: int
    #: Tokens to generate (a prefill leg generates one whatever this says).
    max_tokens: int = 16
    #: Chained hashes of the prompt's full blocks (docs/simulator.md, "Block hashes"); may be empty.
    block_hashes: Sequence[int] = ()
    #: The prompt's token ids, for ``BlockStored`` events (only read when events are on).
    token_ids: Sequence[int] | None = None
    #: After its last token the request keeps its slot and blocks until :meth:`EngineCore.abort`
    #: (the server's stalled answers).
    linger: bool = False
    #: Its blocks stay pinned after its end, like a :data:`PREFILL_REMOTE` request's, until
    #: :meth:`EngineCore.free_held` (a decode engine's bidirectional hold, docs/simulator.md).
    hold: bool = False


@attrs.define(slots=True)
class Started:
    """The request was admitted at ``at``: it has a slot and its blocks.

    ``cached_tokens`` are its prefix-cache hits. For a :data:`DECODE_REMOTE`
    request this is when the driver starts moving its KV (then calls
    :meth:`EngineCore.kv_loaded`).
    """

    request_id: str
    at: float
    cached_tokens: int


@attrs.define(slots=True)
class Tokens:
    """``count`` tokens were generated; the last at ``at``, each earlier one ``step_s`` before the next."""

    request_id: str
    count: int
    at: float
    step_s: float


@attrs.define(slots=True)
class Finished:
    """The request generated its last token at ``at``.

    For a :data:`PREFILL_REMOTE` request (or one with ``hold``) ``block_ids`` are
    the blocks now held (pinned) until :meth:`EngineCore.free_held`.
    """

    request_id: str
    at: float
    reason: str
    block_ids: tuple[int, ...] = ()


EngineOutput = Started | Tokens | Finished


@attrs.frozen(kw_only=True)
class EngineMetrics:
    """What ``/metrics`` reports, as vLLM names it (docs/simulator.md)."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_free_blocks: int
    num_gpu_blocks: int
    held_requests: int
    held_blocks: int
    steps: int
    prompt_tokens_computed: int
    generation_tokens: int


class _Seq:
    """A request inside the core."""

    __slots__ = ("req", "rid", "prompt_tokens", "state", "blocks", "computed", "num_cached_blocks", "generated",
                 "max_tokens", "cached_tokens", "kind")  # fmt: skip

    def __init__(self, req: EngineRequest) -> None:
        self.req = req
        self.rid = req.request_id
        self.prompt_tokens = req.prompt_tokens
        self.kind = req.kind
        #: waiting → running (or loading → running) → done | held | lingering.
        self.state = "waiting"
        self.blocks: list[int] = []
        self.computed = 0
        self.num_cached_blocks = 0
        self.generated = 0
        self.max_tokens = 1 if req.kind == PREFILL_REMOTE else max(req.max_tokens, 1)
        self.cached_tokens = 0


class _Step:
    __slots__ = ("start", "dur", "count", "end", "prefills", "decodes")

    def __init__(self, start: float, dur: float, count: int, prefills: list[tuple[_Seq, int]], decodes: list[_Seq]):
        self.start = start
        self.dur = dur
        self.count = count
        self.end = start + dur * count
        self.prefills = prefills
        self.decodes = decodes


class EngineCore:
    """The engine: requests in (:meth:`add_request`), steps, outputs out (:meth:`advance`).

    Driving it: after any call that changes it, and whenever
    :meth:`next_event_time` comes due, call :meth:`advance` with the current
    time and act on the outputs. Calls that change the core first finish
    every step due by their ``now``; their own effects show in the next
    :meth:`advance`.
    """

    def __init__(self, config: StepConfig | None = None, *, kv_events: bool = False, coalesce: bool = True) -> None:
        config = config if config is not None else StepConfig()
        config.check()
        self.config = config
        #: Run identical decode-only steps as one (a real-time driver that paces every token turns it off).
        self.coalesce = coalesce
        self.pool = BlockPool(config.num_gpu_blocks, block_size=config.block_size, record_events=kv_events)
        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        #: Admitted requests in admission order (prefilling, decoding, loading KV, lingering).
        self._running: list[_Seq] = []
        self._held: dict[str, _Seq] = {}
        self._step: _Step | None = None
        self._out: list[EngineOutput] = []
        self._now = 0.0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.steps = 0
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0

    # ------------------------------------------------------------------ driver API

    @property
    def now(self) -> float:
        """The latest time the core has seen."""
        return self._now

    def add_request(self, request: EngineRequest, *, now: float) -> None:
        """Queue ``request`` (admitted at the next step start). ``ValueError`` if it can never fit."""
        if request.request_id in self._seqs or request.request_id in self._held:
            raise ValueError(f"request id {request.request_id!r} is in use")
        if request.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}")
        if request.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        seq = _Seq(request)
        if self._blocks_needed(seq) > self.config.num_gpu_blocks:
            raise ValueError("request needs more KV blocks than the engine has")
        if (not self.config.chunked_prefill and request.kind != DECODE_REMOTE
                and request.prompt_tokens > self.config.max_num_batched_tokens):  # fmt: skip
            raise ValueError("prompt is longer than max_num_batched_tokens and chunked prefill is off")
        self._catch_up(now)
        self._seqs[request.request_id] = seq
        self._waiting.append(seq)
        self._changed(now)

    def abort(self, request_id: str, *, now: float) -> bool:
        """Drop a request wherever it is (waiting, running, loading, lingering); ``False`` if unknown."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._catch_up(now)
        seq = self._seqs.pop(request_id, None)
        if seq is None:  # it finished in the steps just caught up
            return False
        if seq.state == "waiting":
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
            self._release_blocks(seq)
        seq.state = "done"
        self._changed(now)
        return True

    def kv_loaded(self, request_id: str, *, now: float, ok: bool = True) -> bool:
        """A :data:`DECODE_REMOTE` request's KV arrived (``ok``) or did not (it recomputes the prompt here)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.state != "loading":
            return False
        self._catch_up(now)
        if seq.state != "loading":
            return False
        if ok:
            req = seq.req
            seq.state = "running"
            seq.computed = req.prompt_tokens
            seq.cached_tokens = req.prompt_tokens
            self._cache_blocks(seq)
        else:
            # Recompute: back to the head of the queue as a plain request.
            self._running.remove(seq)
            self._release_blocks(seq)
            seq.blocks = []
            seq.kind = PLAIN
            seq.state = "waiting"
            self._waiting.appendleft(seq)
        self._changed(now)
        return True

    def free_held(self, request_id: str, *, now: float) -> tuple[int, ...] | None:
        """Unpin the KV a finished :data:`PREFILL_REMOTE` (or ``hold``) request holds (pulled, released or expired)."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return None
        self._catch_up(now)
        blocks = tuple(seq.blocks)
        self._release_blocks(seq)
        seq.state = "done"
        self._changed(now)
        return blocks

    def held_blocks(self, request_id: str) -> tuple[int, ...] | None:
        """The blocks held for ``request_id``, if any."""
        seq = self._held.get(request_id)
        return tuple(seq.blocks) if seq is not None else None

    def reset_prefix_cache(self, *, now: float) -> None:
        """Forget every cached block hash (``AllBlocksCleared``); blocks in use stay in use."""
        self._catch_up(now)
        self.pool.clear_cache()
        for seq in self._running:
            seq.num_cached_blocks = len(seq.req.block_hashes) + 1  # never re-cache its blocks
        self._changed(now)

    def next_event_time(self) -> float | None:
        """When :meth:`advance` has something to do: now if outputs wait, the step's end, or ``None`` (idle)."""
        if self._out:
            return self._now
        step = self._step
        return step.end if step is not None else None

    def next_step_end(self) -> float | None:
        """When the step in flight ends — inside a run of identical steps, its next step —, or
        :meth:`next_event_time` when no step is in flight. A driver that wants every token at its own
        time (streaming) wakes here and calls :meth:`advance`, which reports the steps done so far."""
        if self._out:
            return self._now
        step = self._step
        if step is None:
            return None
        if step.count > 1 and step.dur > 0:
            done = int((self._now - step.start) / step.dur + 1e-9)
            return min(step.start + (done + 1) * step.dur, step.end)
        return step.end

    def advance(self, *, now: float) -> list[EngineOutput]:
        """Finish every step due by ``now`` (starting the next ones); the outputs since the last call."""
        self._catch_up(now)
        out = self._out
        self._out = []
        return out

    def serve_now(self, request: EngineRequest, *, now: float) -> list[EngineOutput]:
        """:meth:`add_request` then :meth:`run_until_idle`, in one call (the server at ``--speed 0``).

        When the engine is empty and the request can start at once, its steps
        are computed in one pass — the same outputs, times, pool changes and
        counters as stepping (tests/sim/test_sim_engine.py checks it), less work.
        """
        if (
            self._step is not None
            or self._running
            or self._waiting
            or self._out
            or not self.coalesce
            or request.linger
            or request.kind == DECODE_REMOTE
        ):
            self.add_request(request, now=now)
            return self.run_until_idle()
        rid = request.request_id
        if rid in self._seqs or rid in self._held:
            raise ValueError(f"request id {rid!r} is in use")
        if request.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}")
        config = self.config
        prompt_tokens = request.prompt_tokens
        if prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        seq = _Seq(request)
        needed = self._blocks_needed(seq)
        if needed > config.num_gpu_blocks:
            raise ValueError("request needs more KV blocks than the engine has")
        budget = config.max_num_batched_tokens
        if not config.chunked_prefill and prompt_tokens > budget:
            raise ValueError("prompt is longer than max_num_batched_tokens and chunked prefill is off")
        pool = self.pool
        size = config.block_size
        hits: list[int] = []
        if config.prefix_caching and request.block_hashes:
            hits = pool.lookup(request.block_hashes)
            limit = (prompt_tokens - 1) // size
            if len(hits) > limit:
                hits = hits[:limit]
        if needed - len(hits) > pool.available_with(hits):
            self.add_request(request, now=now)  # it waits for blocks held for remote decodes
            return self.run_until_idle()
        t = now if now > self._now else self._now
        pool.touch(hits)
        fresh = pool.allocate(needed - len(hits))
        assert fresh is not None
        seq.blocks = hits + fresh if hits else fresh
        seq.num_cached_blocks = len(hits)
        cached = len(hits) * size
        seq.computed = seq.cached_tokens = cached
        seq.state = "running"
        if config.prefix_caching:
            self.prefix_cache_queries += prompt_tokens
            self.prefix_cache_hits += cached
        out: list[EngineOutput] = [Started(rid, t, cached)]
        left = prompt_tokens - cached
        dur = 0.0
        while left > 0:
            n = left if left <= budget else budget
            dur = config.step_s(n, 0)
            t = t + dur
            self.steps += 1
            seq.computed += n
            self.prompt_tokens_computed += n
            left -= n
            if seq.num_cached_blocks * size + size <= seq.computed:
                self._cache_blocks(seq)
        seq.generated = 1
        self.generation_tokens += 1
        out.append(Tokens(rid, 1, t, dur))
        if seq.max_tokens > 1:
            count = seq.max_tokens - 1
            dur = (config.step_base_ms + config.decode_per_seq_ms * 1) / 1000.0
            t = t + dur * count
            self.steps += count
            seq.generated += count
            self.generation_tokens += count
            out.append(Tokens(rid, count, t, dur))
        if seq.kind == PREFILL_REMOTE or seq.req.hold:
            seq.state = "held"
            self._held[rid] = seq
            out.append(Finished(rid, t, "length", tuple(seq.blocks)))
        else:
            self._release_blocks(seq)
            seq.state = "done"
            out.append(Finished(rid, t, "length"))
        self._now = t
        return out

    def run_until_idle(self) -> list[EngineOutput]:
        """Run every step at once, one after the other, until no step is left (time jumps to each
        step's end); the outputs. What a driver with no clock to follow (``--speed 0``) does."""
        step = self._step
        while step is not None:
            self._end_step(step)
            step = self._step
        out = self._out
        self._out = []
        return out

    def take_kv_events(self) -> list[KvEvent]:
        """KV events since the last call, in order (only with ``kv_events=True``)."""
        return self.pool.take_events()

    def metrics(self) -> EngineMetrics:
        """Gauges and counters as vLLM reports them."""
        held_blocks = sum(len(s.blocks) for s in self._held.values())
        return EngineMetrics(
            num_requests_running=len(self._running),
            num_requests_waiting=len(self._waiting),
            kv_cache_usage_perc=self.pool.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_free_blocks=self.pool.num_free,
            num_gpu_blocks=self.pool.num_blocks,
            held_requests=len(self._held),
            held_blocks=held_blocks,
            steps=self.steps,
            prompt_tokens_computed=self.prompt_tokens_computed,
            generation_tokens=self.generation_tokens,
        )

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot, blocks or budget."""
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """No step in flight and no output waiting."""
        return self._step is None and not self._out

    def state_of(self, request_id: str) -> str | None:
        """``waiting``, ``running``, ``loading``, ``lingering``, ``held``, or ``None`` (unknown or done)."""
        seq = self._seqs.get(request_id) or self._held.get(request_id)
        return seq.state if seq is not None else None

    # ------------------------------------------------------------------ internals

    def _blocks_needed(self, seq: _Seq) -> int:
        tokens = seq.req.prompt_tokens + (0 if seq.kind == PREFILL_REMOTE else seq.max_tokens)
        return self.config.blocks_for(tokens)

    def _catch_up(self, now: float) -> None:
        step = self._step
        limit = now + _EPS
        while step is not None and step.end <= limit:
            self._end_step(step)
            step = self._step
        if step is not None and step.count > 1:
            # A run of identical steps in flight: report the steps of it already done.
            done = int((limit - step.start) / step.dur) if step.dur > 0 else 0
            if done >= 1:
                self._split_run(step, min(done, step.count - 1))
        if now > self._now:
            self._now = now

    def _split_run(self, step: _Step, done: int) -> None:
        """The first ``done`` steps of a decode run ended: their tokens, then the rest runs on."""
        at = step.start + step.dur * done
        self.steps += done
        out = self._out
        for seq in step.decodes:
            if seq.state == "running":
                seq.generated += done
                self.generation_tokens += done
                out.append(Tokens(seq.rid, done, at, step.dur))
        step.start = at
        step.count -= done
        if at > self._now:
            self._now = at

    def _changed(self, now: float) -> None:
        """Something changed at ``now``: start a step if idle, or cut a run of identical steps."""
        step = self._step
        if step is None:
            self._plan(max(now, self._now))
            return
        if step.count > 1:
            # _catch_up left the run's step in flight first: it ends, then the next step is planned anew.
            step.count = 1
            step.end = step.start + step.dur

    def _release_blocks(self, seq: _Seq) -> None:
        # Last blocks first, so a prefix outlives its tail in the free queue (vLLM frees in reverse).
        blocks = seq.blocks
        if blocks:
            self.pool.free(reversed(blocks))
        seq.blocks = []

    def _cache_blocks(self, seq: _Seq) -> None:
        """Cache the full prompt blocks computed so far that are not cached yet."""
        if not self.config.prefix_caching:
            return
        req = seq.req
        hashes = req.block_hashes
        size = self.config.block_size
        full = min(seq.computed // size, len(hashes), len(seq.blocks))
        start = seq.num_cached_blocks
        if full <= start:
            return
        tokens = None
        if self.pool.record_events and req.token_ids is not None:
            tokens = req.token_ids[start * size : full * size]
            if len(tokens) != (full - start) * size:
                tokens = None
        parent = hashes[start - 1] if start > 0 else None
        self.pool.cache(seq.blocks[start:full], hashes[start:full], parent, tokens)
        seq.num_cached_blocks = full

    def _plan(self, now: float) -> None:
        """Schedule the step starting at ``now`` (or stay idle)."""
        config = self.config
        budget = config.max_num_batched_tokens
        chunked = config.chunked_prefill
        prefills: list[tuple[_Seq, int]] = []
        decodes: list[_Seq] = []
        prefill_tokens = 0
        running = self._running
        for seq in running:
            if budget <= 0:
                break
            if seq.state != "running":
                continue
            remaining = seq.prompt_tokens - seq.computed
            if remaining > 0:
                n = remaining if remaining <= budget else (budget if chunked else 0)
                if n:
                    prefills.append((seq, n))
                    prefill_tokens += n
                    budget -= n
            else:
                decodes.append(seq)
                budget -= 1
        waiting = self._waiting
        if waiting:
            pool = self.pool
            size = config.block_size
            caching = config.prefix_caching
            max_seqs = config.max_num_seqs
            out = self._out
            while waiting and budget > 0 and len(running) < max_seqs:
                seq = waiting[0]
                req = seq.req
                prompt_tokens = seq.prompt_tokens
                tokens = prompt_tokens if seq.kind == PREFILL_REMOTE else prompt_tokens + seq.max_tokens
                needed = -(-tokens // size)
                if seq.kind == DECODE_REMOTE:
                    blocks = pool.allocate(needed)
                    if blocks is None:
                        break
                    waiting.popleft()
                    seq.blocks = blocks
                    seq.state = "loading"
                    running.append(seq)
                    out.append(Started(seq.rid, now, 0))
                    continue
                hits: list[int] = []
                if caching and req.block_hashes:
                    hits = pool.lookup(req.block_hashes)
                    if hits:
                        limit = (prompt_tokens - 1) // size
                        if len(hits) > limit:
                            hits = hits[:limit]
                cached = len(hits) * size
                to_compute = prompt_tokens - cached
                if not chunked and to_compute > budget:
                    break
                if hits:
                    if needed - len(hits) > pool.available_with(hits):
                        break
                    pool.touch(hits)
                    fresh = pool.allocate(needed - len(hits))
                    assert fresh is not None
                    seq.blocks = hits + fresh
                else:
                    fresh = pool.allocate(needed)
                    if fresh is None:
                        break
                    seq.blocks = fresh
                waiting.popleft()
                seq.num_cached_blocks = len(hits)
                seq.computed = cached
                seq.cached_tokens = cached
                seq.state = "running"
                running.append(seq)
                if caching:
                    self.prefix_cache_queries += prompt_tokens
                    self.prefix_cache_hits += cached
                out.append(Started(seq.rid, now, cached))
                n = to_compute if to_compute <= budget else budget
                prefills.append((seq, n))
                prefill_tokens += n
                budget -= n
        if not prefills:
            if not decodes:
                self._step = None
                return
            count = 1
            if self.coalesce:
                # Decode-only: identical steps until the first of the batch finishes.
                count = min([s.max_tokens - s.generated for s in decodes])
            dur = (config.step_base_ms + config.decode_per_seq_ms * len(decodes)) / 1000.0
            self._step = _Step(now, dur, count if count > 1 else 1, prefills, decodes)
            return
        self._step = _Step(now, config.step_s(prefill_tokens, len(decodes)), 1, prefills, decodes)

    def _end_step(self, step: _Step) -> None:
        at = step.end
        count = step.count
        self.steps += count
        out = self._out
        if at > self._now:
            self._now = at
        dur = step.dur
        for seq in step.decodes:
            if seq.state != "running":
                continue  # aborted meanwhile
            seq.generated += count
            self.generation_tokens += count
            out.append(Tokens(seq.rid, count, at, dur))
            if seq.generated >= seq.max_tokens:
                self._finish(seq, at)
        for seq, n in step.prefills:
            if seq.state != "running":
                continue
            seq.computed += n
            self.prompt_tokens_computed += n
            if seq.num_cached_blocks * self.config.block_size + self.config.block_size <= seq.computed:
                self._cache_blocks(seq)
            if seq.computed >= seq.prompt_tokens:
                seq.generated = 1
                self.generation_tokens += 1
                out.append(Tokens(seq.rid, 1, at, dur))
                if seq.max_tokens <= 1:
                    self._finish(seq, at)
        self._step = None
        self._plan(at)

    def _finish(self, seq: _Seq, at: float) -> None:
        rid = seq.req.request_id
        if seq.kind == PREFILL_REMOTE or seq.req.hold:
            self._running.remove(seq)
            del self._seqs[rid]
            seq.state = "held"
            self._held[rid] = seq
            self._out.append(Finished(rid, at, "length", tuple(seq.blocks)))
        elif seq.req.linger:
            seq.state = "lingering"
            self._out.append(Finished(rid, at, "length"))
        else:
            self._running.remove(seq)
            del self._seqs[rid]
            self._release_blocks(seq)
            seq.state = "done"
            self._out.append(Finished(rid, at, "length"))
