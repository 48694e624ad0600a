"""The engine model: what a simulated engine decides, with no sockets, clocks or loops.

Everything here is a plain value or a small state machine that takes the
current time as an argument (``now``), in the style of the router core:
the server in :mod:`narwhal_sim.server` feeds it and acts on its answers.

* :class:`LatencyModel` — how long prefill, one decode step and a KV transfer take.
* :class:`Prompt` — the documented token-count approximation, the prompt digest
  and the 16-token block keys of the prefix cache.
* :func:`generate_tokens` — deterministic output text from (seed, prompt).
* :class:`BlockPool`, :class:`PrefixCache`, :class:`KvLedger`,
  :class:`Scheduler` — KV capacity, prefix hits, per-owner KV leases and the
  ``max_num_seqs`` cap with its waiting queue.
* :class:`Faults` — fault settings and their per-request decisions, each drawn
  from a hash of (seed, request id, fault name) so no shared RNG state exists.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "ROLES",
    "CHARS_PER_TOKEN",
    "LatencyModel",
    "Prompt",
    "PromptError",
    "generate_tokens",
    "BlockPool",
    "PrefixCache",
    "KvEntry",
    "KvLedger",
    "Ticket",
    "Scheduler",
    "Faults",
    "FaultPlan",
    "FaultsError",
    "fault_draw",
    "owner_key",
]

#: The three engine roles of SPEC §9.
ROLES = ("prefill", "decode", "mixed")

#: Token-count approximation: one token per 4 characters (code points) of
#: prompt text, rounded up, at least one. Token-id prompts count exactly.
CHARS_PER_TOKEN = 4

# --------------------------------------------------------------------------- latency


@attrs.frozen(kw_only=True)
class LatencyModel:
    """Modelled GPU time, in milliseconds per unit; defaults fit an 8B model on one H100.

    The server divides every result by ``--speed`` (and sleeps not at all at speed 0).
    """

    #: Fixed cost of one prefill (scheduling, one forward pass launch).
    prefill_base_ms: float = 15.0
    #: Cost per prompt token that misses the prefix cache (~12.5k tokens/s).
    prefill_per_token_ms: float = 0.08
    #: Time of one decode step with a batch of one sequence.
    decode_step_ms: float = 7.0
    #: Extra decode-step time per further sequence in the running batch.
    decode_per_seq_ms: float = 0.05
    #: Fixed cost of pulling KV from a prefill engine.
    kv_transfer_base_ms: float = 2.0
    #: Cost per 16-token KV block pulled (2 MiB per block for Llama-3.1-8B).
    kv_transfer_per_block_ms: float = 0.05

    def prefill_s(self, computed_tokens: int) -> float:
        """Seconds to prefill ``computed_tokens`` tokens (the prompt minus cache hits)."""
        return (self.prefill_base_ms + self.prefill_per_token_ms * computed_tokens) / 1000.0

    def itl_s(self, batch: int) -> float:
        """Seconds per output token while ``batch`` sequences are running."""
        return (self.decode_step_ms + self.decode_per_seq_ms * max(batch - 1, 0)) / 1000.0

    def transfer_s(self, blocks: int) -> float:
        """Seconds to pull ``blocks`` KV blocks from the prefill engine."""
        return (self.kv_transfer_base_ms + self.kv_transfer_per_block_ms * blocks) / 1000.0


# --------------------------------------------------------------------------- prompts


class PromptError(ValueError):
    """The prompt cannot be modelled; carries the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Prompt:
    """A prompt as the engine sees it: its token count, digest and cache-block keys.

    Text is counted with the approximation of :data:`CHARS_PER_TOKEN`; a
    block of ``block_size`` tokens is ``block_size * CHARS_PER_TOKEN``
    characters. Token-id prompts (a list of integers) are counted exactly.
    """

    __slots__ = ("text", "token_ids", "num_tokens", "digest")

    def __init__(self, *, text: str | None = None, token_ids: Sequence[int] | None = None) -> None:
        self.text = text
        self.token_ids = tuple(token_ids) if token_ids is not None else None
        if self.token_ids is not None:
            self.num_tokens = max(len(self.token_ids), 1)
            material = b"ids:" + ",".join(map(str, self.token_ids)).encode()
        else:
            text = text or ""
            self.num_tokens = max(-(-len(text) // CHARS_PER_TOKEN), 1)
            material = b"text:" + text.encode("utf-8", "surrogatepass")
        #: Stable across processes: it seeds the output text and lets a decode
        #: engine check that the KV it pulled belongs to the same prompt.
        self.digest = hashlib.blake2b(material, digest_size=16).hexdigest()

    @classmethod
    def from_completion(cls, prompt: Any) -> Prompt:
        """The ``prompt`` of ``/v1/completions``: a string, one-string list, or token ids."""
        if isinstance(prompt, str):
            return cls(text=prompt)
        if isinstance(prompt, list):
            if prompt and all(type(t) is int for t in prompt):
                return cls(token_ids=prompt)
            if len(prompt) == 1:
                only = prompt[0]
                if isinstance(only, str):
                    return cls(text=only)
                if isinstance(only, list) and only and all(type(t) is int for t in only):
                    return cls(token_ids=only)
            if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
                raise PromptError("the simulator serves one prompt per request", "prompt")
        raise PromptError("prompt must be a string, a list of token ids or a one-element list", "prompt")

    @classmethod
    def from_chat(cls, messages: Any, tools: Any = None) -> Prompt:
        """Render chat ``messages`` (and ``tools``) with a fixed template, then count it."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise PromptError("messages must be an array of objects", "messages")
        parts: list[str] = []
        if tools:
            parts.append("<|tools|>\n" + repr(tools) + "\n")
        for message in messages:
            role = message.get("role")
            parts.append(f"<|{role if isinstance(role, str) else 'user'}|>\n")
            parts.append(_render_content(message.get("content")))
            parts.append("\n")
        parts.append("<|assistant|>\n")
        return cls(text="".join(parts))

    def block_keys(self, block_size: int) -> list[int]:
        """Chained keys of the prompt's full blocks (a key names its whole prefix)."""
        keys: list[int] = []
        key = 0
        if self.token_ids is not None:
            ids = self.token_ids
            for start in range(0, len(ids) - block_size + 1, block_size):
                key = hash((key, ids[start : start + block_size]))
                keys.append(key)
        else:
            text = self.text or ""
            width = block_size * CHARS_PER_TOKEN
            for start in range(0, len(text) - width + 1, width):
                key = hash((key, text[start : start + width]))
                keys.append(key)
        return keys


def _render_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                pieces.append(text if isinstance(text, str) else f"<{part.get('type', 'part')}>")
            else:
                pieces.append(str(part))
        return "".join(pieces)
    return "" if content is None else str(content)


# --------------------------------------------------------------------------- text

#: 64 words, so six bits of the generator pick one.
_VOCABULARY = (
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
    "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has",
    "there", "been", "if", "more", "when", "will", "would", "who", "so", "no", "narwhal",
    "tusk", "arctic", "whale", "ice", "sea", "cold", "deep", "pod", "song", "light", "wave",
    "north", "blue", "tide",
)  # fmt: skip


_SPACED = tuple(" " + w for w in _VOCABULARY)


def generate_tokens(seed: int, digest: str, count: int, *, chat: bool = False) -> list[str]:
    """``count`` output tokens, a pure function of (seed, prompt digest).

    Each token is one word of a fixed 64-word vocabulary, picked by one byte
    of a SHAKE-128 stream of (seed, digest), with a leading space (a chat
    answer's first token has none). The stream's prefix does not depend on
    its length, so a prefill engine's one token equals the first token a
    decode engine produces for the same prompt and seed.
    """
    if count <= 0:
        return []
    stream = hashlib.shake_128(f"{seed}:{digest}".encode()).digest(count)
    tokens = [_SPACED[b & 63] for b in stream]
    if chat:
        tokens[0] = tokens[0][1:]
    return tokens


def owner_key(seed: int, request_id: str, sequence: int) -> str:
    """The KV owner key an engine hands out: the request id plus an 8-hex suffix.

    vLLM (since 0.14) makes internal request ids unique by suffixing the
    received ``X-Request-Id``; ``remote_request_id`` names that internal id.
    The suffix is derived from (seed, request id, per-engine sequence).
    """
    material = f"{seed}\x00{request_id}\x00{sequence}".encode()
    return f"{request_id}-{hashlib.blake2b(material, digest_size=4).hexdigest()}"


# --------------------------------------------------------------------------- KV blocks


class BlockPool:
    """The engine's KV blocks: a fixed number of ids handed out and given back."""

    __slots__ = ("total", "_free")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.total = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free_count(self) -> int:
        """Blocks not owned by any request."""
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` block ids, or ``None`` when not enough are free."""
        if count > len(self._free):
            return None
        if count == 0:
            return []
        ids = self._free[-count:]
        del self._free[-count:]
        ids.reverse()
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Give ``block_ids`` back."""
        self._free.extend(block_ids)


class PrefixCache:
    """Which prompt prefixes are cached, as an LRU of chained 16-token block keys."""

    __slots__ = ("capacity", "_keys", "enabled")

    def __init__(self, capacity_blocks: int, *, enabled: bool = True) -> None:
        self.capacity = capacity_blocks
        self.enabled = enabled and capacity_blocks > 0
        self._keys: OrderedDict[int, None] = OrderedDict()

    def lookup_and_insert(self, prompt: Prompt, block_size: int) -> int:
        """Cached tokens of ``prompt``'s leading blocks; then remember all its full blocks.

        Like vLLM, at least one prompt token is always computed, so a prompt
        whose every block hits reports one block less.
        """
        if not self.enabled:
            return 0
        keys = prompt.block_keys(block_size)
        limit = (prompt.num_tokens - 1) // block_size
        hits = 0
        cache = self._keys
        for key in keys:
            if key not in cache:
                break
            hits += 1
        hits = min(hits, limit)
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > self.capacity:
            cache.popitem(last=False)
        return hits * block_size


@attrs.define(slots=True, eq=False, kw_only=True)
class KvEntry:
    """KV blocks a prefill engine holds for one owner key until pulled, released or expired."""

    #: The owner key (``remote_request_id``).
    owner: str
    #: The block ids, as announced in ``remote_block_ids``.
    block_ids: list[int]
    #: Prompt tokens the blocks cover.
    prompt_tokens: int
    #: :attr:`Prompt.digest` of the prompt they were computed for.
    prompt_digest: str
    #: Monotonic time when the lease runs out.
    expires_at: float
    #: ``held`` until it becomes ``pulled``, ``released`` or ``expired``.
    outcome: str = "held"
    #: Opaque tag of the server (the request record).
    tag: Any = None


_KV_OUTCOMES = ("held", "pulled", "released", "expired")


class KvLedger:
    """KV owned per request on a prefill engine, each with a lease.

    Counters (cumulative, per owner and per block): ``held``, ``pulled``,
    ``released``, ``expired``. Expired entries are the leaks a router
    should have prevented (SPEC §9).
    """

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        # One lease length for all entries: insertion order is deadline order.
        self._entries: OrderedDict[str, KvEntry] = OrderedDict()
        self.held_blocks = 0
        self.counts = dict.fromkeys(_KV_OUTCOMES, 0)
        self.block_counts = dict.fromkeys(_KV_OUTCOMES, 0)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, owner: object) -> bool:
        return owner in self._entries

    def get(self, owner: str) -> KvEntry | None:
        """The held entry of ``owner``, if any."""
        return self._entries.get(owner)

    def hold(
        self,
        owner: str,
        block_ids: list[int],
        *,
        now: float,
        prompt_tokens: int,
        prompt_digest: str,
        tag: Any = None,
    ) -> KvEntry:
        """Start holding ``block_ids`` for ``owner`` until ``now + lease_s``."""
        if owner in self._entries:
            raise ValueError(f"KV owner {owner!r} is already held")
        entry = KvEntry(
            owner=owner,
            block_ids=block_ids,
            prompt_tokens=prompt_tokens,
            prompt_digest=prompt_digest,
            expires_at=now + self.lease_s,
            tag=tag,
        )
        self._entries[owner] = entry
        self.held_blocks += len(block_ids)
        self._count("held", entry)
        return entry

    def pull(self, owner: str) -> KvEntry | None:
        """A decode engine took the KV of ``owner``; ``None`` when nothing is held."""
        return self._end(owner, "pulled")

    def release(self, owner: str) -> KvEntry | None:
        """Free ``owner``'s KV on request; ``None`` (and nothing freed) when unknown."""
        return self._end(owner, "released")

    def expire_due(self, now: float) -> list[KvEntry]:
        """End every entry whose lease ran out at ``now``."""
        expired = []
        entries = self._entries
        while entries:
            entry = next(iter(entries.values()))
            if entry.expires_at > now:
                break
            expired.append(self._end(entry.owner, "expired"))
        return [e for e in expired if e is not None]

    def next_deadline(self) -> float | None:
        """When the oldest lease runs out, or ``None`` when nothing is held."""
        for entry in self._entries.values():
            return entry.expires_at
        return None

    def reset_counts(self) -> None:
        """Zero the cumulative counters (held entries stay held)."""
        for table in (self.counts, self.block_counts):
            for key in table:
                table[key] = 0

    def _end(self, owner: str, outcome: str) -> KvEntry | None:
        entry = self._entries.pop(owner, None)
        if entry is None:
            return None
        entry.outcome = outcome
        self.held_blocks -= len(entry.block_ids)
        self._count(outcome, entry)
        return entry

    def _count(self, outcome: str, entry: KvEntry) -> None:
        self.counts[outcome] += 1
        self.block_counts[outcome] += len(entry.block_ids)


# --------------------------------------------------------------------------- scheduling


class Ticket:
    """One request's claim on a sequence slot and its KV blocks."""

    __slots__ = ("blocks_needed", "block_ids", "state", "waiter")

    def __init__(self, blocks_needed: int) -> None:
        self.blocks_needed = blocks_needed
        self.block_ids: list[int] = []
        #: ``new`` → ``waiting`` → ``running`` → ``done``.
        self.state = "new"
        #: Opaque to the model: the server's wake-up handle.
        self.waiter: Any = None


class Scheduler:
    """The ``max_num_seqs`` cap and a first-come-first-served waiting queue.

    A request runs when a sequence slot is free *and* the pool has its
    blocks; otherwise it waits. Blocks held for a KV owner stay allocated,
    so leaked KV shrinks the engine's capacity until its lease expires.
    """

    def __init__(self, max_num_seqs: int, pool: BlockPool) -> None:
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        self.max_num_seqs = max_num_seqs
        self.pool = pool
        self.running = 0
        self.waiting: deque[Ticket] = deque()

    def submit(self, ticket: Ticket) -> bool:
        """Run ``ticket`` now (``True``) or queue it (``False``)."""
        if ticket.blocks_needed > self.pool.total:
            raise ValueError("request needs more KV blocks than the engine has")
        if not self.waiting and self._try_start(ticket):
            return True
        ticket.state = "waiting"
        self.waiting.append(ticket)
        return False

    def withdraw(self, ticket: Ticket) -> None:
        """Take a waiting ticket out of the queue (its client left)."""
        if ticket.state == "waiting":
            self.waiting.remove(ticket)
            ticket.state = "done"

    def finish(self, ticket: Ticket, *, keep_blocks: bool = False) -> list[Ticket]:
        """End a running ticket, freeing its slot (and blocks unless ``keep_blocks``).

        Returns the tickets that start running as a result.
        """
        if ticket.state != "running":
            return []
        ticket.state = "done"
        self.running -= 1
        if not keep_blocks:
            self.pool.free(ticket.block_ids)
        ticket.block_ids = []
        return self.drain()

    def drain(self) -> list[Ticket]:
        """Start waiting tickets, in order, while slots and blocks allow."""
        started = []
        while self.waiting and self._try_start(self.waiting[0]):
            started.append(self.waiting.popleft())
        return started

    def _try_start(self, ticket: Ticket) -> bool:
        if self.running >= self.max_num_seqs:
            return False
        block_ids = self.pool.allocate(ticket.blocks_needed)
        if block_ids is None:
            return False
        ticket.block_ids = block_ids
        ticket.state = "running"
        self.running += 1
        return True


# --------------------------------------------------------------------------- faults


class FaultsError(ValueError):
    """A fault setting is unknown or has the wrong type or range."""


def fault_draw(seed: int, request_id: str, name: str) -> float:
    """A number in [0, 1) that is a pure function of (seed, request id, fault name)."""
    material = f"{seed}\x00{request_id}\x00{name}".encode()
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "big") / 2.0**64


@attrs.frozen(kw_only=True)
class FaultPlan:
    """The faults one completion request gets, decided when it arrives."""

    #: Close the connection without answering.
    drop: bool = False
    #: Seconds to wait before doing anything else.
    delay_s: float = 0.0
    #: Answer this status in the error envelope instead of completing.
    error_status: int | None = None
    #: Stop sending (connection kept open) after this many chunks.
    stall_after: int | None = None
    #: Close the connection after this many chunks.
    drop_after: int | None = None
    #: A prefill answer without ``kv_transfer_params`` (``null``; no KV held).
    omit_kv_params: bool = False
    #: A 200 answer whose body is not valid JSON.
    malformed_json: bool = False


@attrs.frozen(kw_only=True)
class Faults:
    """Fault settings, from flags or ``POST /sim/faults`` (which replaces them all).

    Rates are probabilities in [0, 1]; each request's decision is
    :func:`fault_draw` ``< rate`` for that fault's name. Faults apply to
    the completion routes only, except ``unhealthy`` (``/health`` answers 503).
    Chunks are SSE events of a stream; a non-streaming answer is one chunk.
    """

    #: Share of requests answered with ``error_status``.
    error_rate: float = 0.0
    #: Status of injected errors.
    error_status: int = 503
    #: Share of requests whose connection is closed without an answer.
    drop_rate: float = 0.0
    #: Seconds added before a request is handled (wall clock, not scaled by speed).
    delay_s: float = 0.0
    #: Share of requests that get ``delay_s``.
    delay_rate: float = 1.0
    #: Stop sending after this many chunks and keep the connection open.
    stall_after_chunks: int | None = None
    #: Share of requests that stall.
    stall_rate: float = 1.0
    #: Close the connection after this many chunks.
    drop_after_chunks: int | None = None
    #: Share of requests dropped after ``drop_after_chunks``.
    drop_after_chunks_rate: float = 1.0
    #: Share of prefill answers sent with ``kv_transfer_params: null``.
    omit_kv_params_rate: float = 0.0
    #: Share of 200 answers whose JSON is cut short.
    malformed_json_rate: float = 0.0
    #: ``/health`` answers 503.
    unhealthy: bool = False
    #: Chat answers carry the text in ``reasoning_content`` and ``content: ""``.
    reasoning_only: bool = False

    @classmethod
    def from_json(cls, data: Any) -> Faults:
        """Strictly build settings from a JSON object (absent keys take defaults)."""
        if not isinstance(data, Mapping):
            raise FaultsError("faults must be a JSON object")
        fields = attrs.fields_dict(cls)
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise FaultsError(f"unknown fault setting {unknown[0]!r}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            values[name] = _check_fault(name, value)
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """The settings as a JSON object."""
        return attrs.asdict(self)

    @property
    def active(self) -> bool:
        """Whether any completion-route fault can fire."""
        return (
            self.error_rate > 0
            or self.drop_rate > 0
            or (self.delay_s > 0 and self.delay_rate > 0)
            or (self.stall_after_chunks is not None and self.stall_rate > 0)
            or (self.drop_after_chunks is not None and self.drop_after_chunks_rate > 0)
            or self.omit_kv_params_rate > 0
            or self.malformed_json_rate > 0
        )

    def plan(self, seed: int, request_id: str) -> FaultPlan:
        """Decide every fault for one request."""

        def fires(name: str, rate: float) -> bool:
            if rate <= 0:
                return False
            return rate >= 1 or fault_draw(seed, request_id, name) < rate

        return FaultPlan(
            drop=fires("drop", self.drop_rate),
            delay_s=self.delay_s if self.delay_s > 0 and fires("delay", self.delay_rate) else 0.0,
            error_status=self.error_status if fires("error", self.error_rate) else None,
            stall_after=(
                self.stall_after_chunks
                if self.stall_after_chunks is not None and fires("stall", self.stall_rate)
                else None
            ),
            drop_after=(
                self.drop_after_chunks
                if self.drop_after_chunks is not None
                and fires("drop_after_chunks", self.drop_after_chunks_rate)
                else None
            ),
            omit_kv_params=fires("omit_kv_params", self.omit_kv_params_rate),
            malformed_json=fires("malformed_json", self.malformed_json_rate),
        )


_RATE_FIELDS = {
    "error_rate",
    "drop_rate",
    "delay_rate",
    "stall_rate",
    "drop_after_chunks_rate",
    "omit_kv_params_rate",
    "malformed_json_rate",
}


def _check_fault(name: str, value: Any) -> Any:
    if name in _RATE_FIELDS:
        if type(value) not in (int, float) or not 0.0 <= value <= 1.0:
            raise FaultsError(f"{name} must be a number between 0 and 1")
        return float(value)
    if name == "delay_s":
        if type(value) not in (int, float) or not 0.0 <= value < math.inf:
            raise FaultsError("delay_s must be a non-negative number")
        return float(value)
    if name == "error_status":
        if type(value) is not int or not 400 <= value <= 599:
            raise FaultsError("error_status must be an integer between 400 and 599")
        return value
    if name in ("stall_after_chunks", "drop_after_chunks"):
        if value is not None and (type(value) is not int or value < 0):
            raise FaultsError(f"{name} must be a non-negative integer or null")
        return value
    if type(value) is not bool:
        raise FaultsError(f"{name} must be a boolean")
    return value
