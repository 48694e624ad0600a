"""The steppable engine core: a vLLM-V1-like scheduler loop over one KV block pool.

Pure: no sockets, clocks, threads or randomness. Time is an argument
(``now``, seconds of modelled GPU time, never decreasing from call to
call). Two drivers run the same core: the asyncio server's
(:mod:`narwhal_sim.driving`, real time scaled by ``--speed``, or instantly
at speed 0) and a discrete-event loop in virtual time. See
docs/simulator.md, "The engine core".

* :class:`StepConfig` — scheduler limits, pool size and the step-time formula
  ``step_base_ms + prefill_tokens × prefill_per_token_ms + decode_seqs × decode_per_seq_ms``
  (:mod:`narwhal_sim.engine_io`, with the requests and outputs).
* :class:`BlockPool` — vLLM's KV block pool: reference-counted blocks, a
  hash → block map of cached full blocks, and an LRU queue of free blocks
  (a freed full block stays cached until the queue hands it out again;
  :mod:`narwhal_sim.block_pool`).
* :class:`EngineCore` — requests in, steps, outputs out; a request inside it
  and the step in flight are :mod:`narwhal_sim.steps`'.

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

from collections import deque

from narwhal_sim.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, KvEvent
from narwhal_sim.engine_io import (
    DECODE_REMOTE,
    KINDS,
    PLAIN,
    PREFILL_REMOTE,
    EngineMetrics,
    EngineOutput,
    EngineRequest,
    Finished,
    Started,
    StepConfig,
    Tokens,
)
from narwhal_sim.steps import Seq, Step, next_step, run_alone, running_work

# The values and the pool live in narwhal_sim.engine_io and narwhal_sim.block_pool; they are named here too.
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

_EPS = 1e-12


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
        self._seqs: dict[str, Seq] = {}
        self._waiting: deque[Seq] = deque()
        #: Admitted requests in admission order (prefilling, decoding, loading KV, lingering).
        self._running: list[Seq] = []
        self._held: dict[str, Seq] = {}
        self._step: Step | None = None
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
        seq = self._new_seq(request)
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
            seq.release_blocks(self.pool)
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
            seq.cache_blocks(self.pool, self.config)
        else:
            # Recompute: back to the head of the queue as a plain request.
            self._running.remove(seq)
            seq.release_blocks(self.pool)
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
        seq.release_blocks(self.pool)
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
        seq = self._new_seq(request)
        config = self.config
        pool = self.pool
        prompt_tokens = request.prompt_tokens
        hits = pool.prefix_hits(request.block_hashes, prompt_tokens) if config.prefix_caching else []
        blocks = pool.take(seq.blocks_needed(config.block_size), hits)
        if blocks is None:
            self.add_request(request, now=now)  # it waits for blocks held for remote decodes
            return self.run_until_idle()
        t = now if now > self._now else self._now
        cached = seq.start(blocks, len(hits), config.block_size)
        if config.prefix_caching:
            self.prefix_cache_queries += prompt_tokens
            self.prefix_cache_hits += cached
        out, t, steps, computed = run_alone(seq, t, config, pool)
        self.steps += steps
        self.prompt_tokens_computed += computed
        self.generation_tokens += seq.generated
        out.append(self._ended(seq, t))
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

    def _new_seq(self, request: EngineRequest) -> Seq:
        """``request`` inside the core; ``ValueError`` if its ID is in use or it can never fit."""
        if request.request_id in self._seqs or request.request_id in self._held:
            raise ValueError(f"request id {request.request_id!r} is in use")
        if request.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}")
        if request.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        seq = Seq(request)
        config = self.config
        if seq.blocks_needed(config.block_size) > config.num_gpu_blocks:
            raise ValueError("request needs more KV blocks than the engine has")
        if (not config.chunked_prefill and request.kind != DECODE_REMOTE
                and request.prompt_tokens > config.max_num_batched_tokens):  # fmt: skip
            raise ValueError("prompt is longer than max_num_batched_tokens and chunked prefill is off")
        return seq

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

    def _split_run(self, step: Step, done: int) -> None:
        """The first ``done`` steps of a decode run ended: their tokens, then the rest runs on."""
        at, generated = step.split(done, self._out)
        self.steps += done
        self.generation_tokens += generated
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

    def _plan(self, now: float) -> None:
        """Schedule the step starting at ``now`` (or stay idle)."""
        config = self.config
        prefills, decodes, prefill_tokens, budget = running_work(
            self._running, config.max_num_batched_tokens, config.chunked_prefill
        )
        if self._waiting:
            prefill_tokens += self._admit_waiting(now, prefills, budget)
        self._step = next_step(now, config, prefills, prefill_tokens, decodes, self.coalesce)

    def _admit_waiting(self, now: float, prefills: list[tuple[Seq, int]], budget: int) -> int:
        """Admit waiting requests in arrival order while the budget, the slots and the pool allow.

        Each admitted request's first prefill chunk joins ``prefills``; their tokens are returned.
        """
        config = self.config
        pool = self.pool
        size = config.block_size
        chunked = config.chunked_prefill
        caching = config.prefix_caching
        max_seqs = config.max_num_seqs
        waiting = self._waiting
        running = self._running
        out = self._out
        prefill_tokens = 0
        while waiting and budget > 0 and len(running) < max_seqs:
            seq = waiting[0]
            needed = seq.blocks_needed(size)
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
            prompt_tokens = seq.prompt_tokens
            hits = pool.prefix_hits(seq.req.block_hashes, prompt_tokens) if caching else []
            cached = len(hits) * size
            to_compute = prompt_tokens - cached
            if not chunked and to_compute > budget:
                break
            blocks = pool.take(needed, hits)
            if blocks is None:
                break
            waiting.popleft()
            seq.start(blocks, len(hits), size)
            running.append(seq)
            if caching:
                self.prefix_cache_queries += prompt_tokens
                self.prefix_cache_hits += cached
            out.append(Started(seq.rid, now, cached))
            n = to_compute if to_compute <= budget else budget
            prefills.append((seq, n))
            prefill_tokens += n
            budget -= n
        return prefill_tokens

    def _end_step(self, step: Step) -> None:
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
                seq.cache_blocks(self.pool, self.config)
            if seq.computed >= seq.prompt_tokens:
                seq.generated = 1
                self.generation_tokens += 1
                out.append(Tokens(seq.rid, 1, at, dur))
                if seq.max_tokens <= 1:
                    self._finish(seq, at)
        self._step = None
        self._plan(at)

    def _finish(self, seq: Seq, at: float) -> None:
        if seq.req.linger and not (seq.kind == PREFILL_REMOTE or seq.req.hold):
            seq.state = "lingering"
            self._out.append(Finished(seq.rid, at, "length"))
            return
        self._running.remove(seq)
        del self._seqs[seq.rid]
        self._out.append(self._ended(seq, at))

    def _ended(self, seq: Seq, at: float) -> Finished:
        """A request out of the running set at its end: its blocks held (a prefill leg, ``hold``) or freed."""
        rid = seq.rid
        if seq.kind == PREFILL_REMOTE or seq.req.hold:
            seq.state = "held"
            self._held[rid] = seq
            return Finished(rid, at, "length", tuple(seq.blocks))
        seq.release_blocks(self.pool)
        seq.state = "done"
        return Finished(rid, at, "length")
