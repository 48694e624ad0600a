"""What goes into and comes out of the engine core (:mod:`narwhal_sim.engine`): settings, requests, outputs.

Pure values: :class:`StepConfig` (scheduler limits, pool size, the step-time
formula), :class:`EngineRequest` and the kinds of request, the outputs
(:class:`Started`, :class:`Tokens`, :class:`Finished`) and :class:`EngineMetrics`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

__all__ = ["PLAIN", "PREFILL_REMOTE", "DECODE_REMOTE", "KINDS", "StepConfig", "EngineRequest", "Started", "Tokens",
           "Finished", "EngineOutput", "EngineMetrics"]  # fmt: skip

#: Prefill and decode both here.
PLAIN = "plain"
#: A prefill leg: one token, then the prompt's KV stays pinned for a remote decode.
PREFILL_REMOTE = "prefill_remote"
#: A decode leg whose prompt KV comes from another engine (the driver moves it).
DECODE_REMOTE = "decode_remote"
KINDS = (PLAIN, PREFILL_REMOTE, DECODE_REMOTE)


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
