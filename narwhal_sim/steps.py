"""The engine core's requests and steps (:mod:`narwhal_sim.engine`): one step's work, as values and functions.

Pure, like the core: :class:`Seq` is a request inside the core (its state,
blocks and progress), :class:`Step` the step in flight (a run of identical
decode steps counts as one). :func:`running_work` and :func:`next_step` make
the step the scheduler plans; :func:`run_alone` is the speed-0 pass of a lone
request, whose outputs equal stepping it (tests/sim/test_sim_engine.py checks it).
"""

from __future__ import annotations

from narwhal_sim.block_pool import BlockPool
from narwhal_sim.engine_io import PREFILL_REMOTE, EngineOutput, EngineRequest, Started, StepConfig, Tokens

__all__ = ["Seq", "Step", "running_work", "next_step", "run_alone"]


class Seq:
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

    def start(self, blocks: list[int], num_hits: int, block_size: int) -> int:
        """Running on ``blocks``, the first ``num_hits`` of them prefix-cache hits; its cached tokens."""
        self.blocks = blocks
        self.num_cached_blocks = num_hits
        cached = num_hits * block_size
        self.computed = self.cached_tokens = cached
        self.state = "running"
        return cached

    def blocks_needed(self, block_size: int) -> int:
        tokens = self.prompt_tokens if self.kind == PREFILL_REMOTE else self.prompt_tokens + self.max_tokens
        return -(-tokens // block_size)

    def release_blocks(self, pool: BlockPool) -> None:
        # Last blocks first, so a prefix outlives its tail in the free queue (vLLM frees in reverse).
        blocks = self.blocks
        if blocks:
            pool.free(reversed(blocks))
        self.blocks = []

    def cache_blocks(self, pool: BlockPool, config: StepConfig) -> None:
        """Cache the full prompt blocks computed so far that are not cached yet."""
        if not config.prefix_caching:
            return
        req = self.req
        hashes = req.block_hashes
        size = config.block_size
        full = min(self.computed // size, len(hashes), len(self.blocks))
        start = self.num_cached_blocks
        if full <= start:
            return
        tokens = None
        if pool.record_events and req.token_ids is not None:
            tokens = req.token_ids[start * size : full * size]
            if len(tokens) != (full - start) * size:
                tokens = None
        parent = hashes[start - 1] if start > 0 else None
        pool.cache(self.blocks[start:full], hashes[start:full], parent, tokens)
        self.num_cached_blocks = full


class Step:
    __slots__ = ("start", "dur", "count", "end", "prefills", "decodes")

    def __init__(self, start: float, dur: float, count: int, prefills: list[tuple[Seq, int]], decodes: list[Seq]):
        self.start = start
        self.dur = dur
        self.count = count
        self.end = start + dur * count
        self.prefills = prefills
        self.decodes = decodes

    def split(self, done: int, out: list[EngineOutput]) -> tuple[float, int]:
        """The first ``done`` steps of this decode run ended: their tokens into ``out``, the rest runs on.

        When they ended, and the tokens they generated.
        """
        at = self.start + self.dur * done
        generated = 0
        for seq in self.decodes:
            if seq.state == "running":
                seq.generated += done
                generated += done
                out.append(Tokens(seq.rid, done, at, self.dur))
        self.start = at
        self.count -= done
        return at, generated


def run_alone(seq: Seq, t: float, config: StepConfig, pool: BlockPool) -> tuple[list[EngineOutput], float, int, int]:
    """A lone running request's steps in one pass from ``t`` (:meth:`EngineCore.serve_now`).

    Its outputs but the last, the time its last token comes, the steps it took and the prompt tokens
    they computed: what stepping it alone would give.
    """
    rid = seq.rid
    size = config.block_size
    budget = config.max_num_batched_tokens
    out: list[EngineOutput] = [Started(rid, t, seq.cached_tokens)]
    left = seq.prompt_tokens - seq.computed
    steps = computed = 0
    dur = 0.0
    while left > 0:
        n = left if left <= budget else budget
        dur = config.step_s(n, 0)
        t = t + dur
        steps += 1
        seq.computed += n
        computed += n
        left -= n
        if seq.num_cached_blocks * size + size <= seq.computed:
            seq.cache_blocks(pool, config)
    seq.generated = 1
    out.append(Tokens(rid, 1, t, dur))
    if seq.max_tokens > 1:
        count = seq.max_tokens - 1
        dur = (config.step_base_ms + config.decode_per_seq_ms * 1) / 1000.0
        t = t + dur * count
        steps += count
        seq.generated += count
        out.append(Tokens(rid, count, t, dur))
    return out, t, steps, computed


def running_work(
    running: list[Seq], budget: int, chunked: bool
) -> tuple[list[tuple[Seq, int]], list[Seq], int, int]:
    """The running requests' share of a step, in admission order: prefill chunks, decodes, their prefill
    tokens and the budget left."""
    prefills: list[tuple[Seq, int]] = []
    decodes: list[Seq] = []
    prefill_tokens = 0
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
    return prefills, decodes, prefill_tokens, budget


def next_step(
    now: float, config: StepConfig, prefills: list[tuple[Seq, int]], prefill_tokens: int, decodes: list[Seq],
    coalesce: bool,
) -> Step | None:
    """The step of this work starting at ``now``; ``None`` when there is none."""
    if not prefills:
        if not decodes:
            return None
        count = 1
        if coalesce:
            # Decode-only: identical steps until the first of the batch finishes.
            count = min([s.max_tokens - s.generated for s in decodes])
        dur = (config.step_base_ms + config.decode_per_seq_ms * len(decodes)) / 1000.0
        return Step(now, dur, count if count > 1 else 1, prefills, decodes)
    return Step(now, config.step_s(prefill_tokens, len(decodes)), 1, prefills, decodes)
