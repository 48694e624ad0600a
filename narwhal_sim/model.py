"""The engine model: what a simulated engine decides, with no sockets, clocks or loops.

Everything here is a plain value or a small state machine that takes the
current time as an argument (``now``), in the style of the router core:
the server's flows (:mod:`narwhal_sim.server` composes them) feed it and act on its answers.

* :class:`Prompt` — token ids (a tokenizer's, or the documented
  4-characters-per-token approximation), the prompt digest and the chained
  block hashes of the prefix cache (:mod:`narwhal_sim.tokens`).
* :func:`generate_tokens` — deterministic output text from (seed, prompt).
* :class:`KvLedger` — per-owner KV leases and their counters (the blocks
  themselves are pinned in the engine core, :mod:`narwhal_sim.engine`).
* :class:`Faults` — fault settings and their per-request decisions, each drawn
  from a hash of (seed, request id, fault name) so no shared RNG state exists.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from narwhal_sim.chat import ChatError
from narwhal_sim.tokens import CHARS_PER_TOKEN, block_hashes, pseudo_token_ids

if TYPE_CHECKING:
    from narwhal_sim.tokens import Tokenizer

__all__ = [
    "ROLES",
    "CHARS_PER_TOKEN",
    "Prompt",
    "PromptError",
    "generate_tokens",
    "KvEntry",
    "KvLedger",
    "Faults",
    "FaultPlan",
    "FaultsError",
    "fault_draw",
    "owner_key",
    "render_content",
]

#: The three engine roles (docs/simulator.md, "Roles").
ROLES = ("prefill", "decode", "mixed")

# --------------------------------------------------------------------------- prompts


class PromptError(ValueError):
    """The prompt cannot be modelled; carries the request field it came from."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class Prompt:
    """A prompt as the engine sees it: token count, digest, token ids and block hashes.

    Without a tokenizer, text counts one token per :data:`CHARS_PER_TOKEN`
    characters (rounded up, at least one) and its token ids are
    :func:`~narwhal_sim.tokens.pseudo_token_ids`. Token-id prompts, and text
    encoded by a tokenizer, count exactly.
    """

    __slots__ = ("text", "token_ids", "num_tokens", "digest", "_hashes")

    def __init__(self, *, text: str | None = None, token_ids: Sequence[int] | None = None) -> None:
        self.text = text
        self.token_ids = tuple(token_ids) if token_ids is not None else None
        self._hashes: tuple[int, list[int]] | None = None
        if self.token_ids is not None:
            self.num_tokens = max(len(self.token_ids), 1)
        else:
            self.num_tokens = max(-(-len(text or "") // CHARS_PER_TOKEN), 1)
        if text is not None:
            material = b"text:" + text.encode("utf-8", "surrogatepass")
        else:
            material = b"ids:" + ",".join(map(str, self.token_ids or ())).encode()
        #: Stable across processes: it seeds the output text and lets a decode
        #: engine check that the KV it pulled belongs to the same prompt.
        self.digest = hashlib.blake2b(material, digest_size=16).hexdigest()

    @classmethod
    def from_completion(cls, prompt: Any, tokenizer: Tokenizer | None = None, *, add_special_tokens: bool = True,
                        truncate: int = 0) -> Prompt:  # fmt: skip
        """The ``prompt`` of ``/v1/completions``: a string, one-string list, or token ids.

        A tokenizer encodes text with ``add_special_tokens`` (vLLM's default
        true for completions); ``truncate`` > 0 keeps the last that many
        tokens (``truncate_prompt_tokens``; pseudo-token text is not cut).
        """
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            return cls.of_text(prompt, tokenizer, add_special_tokens=add_special_tokens, truncate=truncate)
        if isinstance(prompt, list):
            if prompt and all(type(t) is int for t in prompt):
                return cls(token_ids=prompt[-truncate:] if truncate else prompt)
            if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
                raise PromptError("the simulator serves one prompt per request", "prompt")
        raise PromptError("prompt must be a string, a list of token ids or a one-element list", "prompt")

    @classmethod
    def of_text(cls, text: str, tokenizer: Tokenizer | None = None, *, add_special_tokens: bool = True,
                truncate: int = 0) -> Prompt:  # fmt: skip
        """Text, encoded by ``tokenizer`` when there is one."""
        if tokenizer is None:
            return cls(text=text)
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens, truncate=truncate)
        return cls(text=text, token_ids=ids)

    @classmethod
    def from_chat(cls, messages: Any, tools: Any = None, tokenizer: Tokenizer | None = None) -> Prompt:
        """Chat ``messages`` (and ``tools``), with every other field at vLLM's default (:meth:`from_chat_body`)."""
        return cls.from_chat_body({"messages": messages, "tools": tools}, tokenizer)

    @classmethod
    def from_chat_body(cls, body: Mapping[str, Any], tokenizer: Tokenizer | None = None, *,
                       truncate: int = 0) -> Prompt:  # fmt: skip
        """A chat request's prompt: as vLLM renders and encodes it with a tokenizer, else the built-in rendering.

        With a tokenizer every field vLLM reads counts (``add_generation_prompt``,
        ``continue_final_message``, ``chat_template_kwargs``, ``documents``,
        ``add_special_tokens``; :mod:`narwhal_sim.chat`). Without one (pseudo
        tokens) the prompt is ``<|role|>\ncontent\n`` per message, tools first,
        ``<|assistant|>\n`` last, whatever those fields say.
        """
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise PromptError("messages must be an array of objects", "messages")
        if tokenizer is not None:
            try:
                text, ids = tokenizer.chat_prompt(body, truncate=truncate)
            except ChatError as exc:
                raise PromptError(str(exc), exc.param) from None
            return cls(text=text, token_ids=ids)
        parts: list[str] = []
        if tools:
            parts.append("<|tools|>\n" + repr(tools) + "\n")
        for message in messages:
            role = message.get("role")
            parts.append(f"<|{role if isinstance(role, str) else 'user'}|>\n")
            parts.append(render_content(message.get("content")))
            parts.append("\n")
        parts.append("<|assistant|>\n")
        return cls(text="".join(parts))

    def ids(self, limit: int | None = None) -> Sequence[int]:
        """The prompt's token ids (pseudo ids for text without a tokenizer), the first ``limit`` if given."""
        if self.token_ids is not None:
            return self.token_ids if limit is None else self.token_ids[:limit]
        return pseudo_token_ids(self.text or "", limit)

    def block_token_ids(self, block_size: int) -> Sequence[int]:
        """The token ids of the prompt's full blocks."""
        return self.ids((self.num_tokens // block_size) * block_size)

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks (:func:`narwhal_sim.tokens.block_hashes`)."""
        cached = self._hashes
        if cached is not None and cached[0] == block_size:
            return cached[1]
        if self.num_tokens < block_size:
            hashes: list[int] = []
        else:
            hashes = block_hashes(self.block_token_ids(block_size), block_size)
        self._hashes = (block_size, hashes)
        return hashes

    #: The former name of :meth:`block_hashes`.
    block_keys = block_hashes


def render_content(content: Any) -> str:
    """A message's content as the built-in (pseudo-token) rendering writes it: parts joined with nothing."""
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
#: How many expired entries a ledger remembers for late pulls.
_EXPIRED_KEPT = 1024


class KvLedger:
    """KV owned per request on a prefill engine, each with a lease.

    Counters (cumulative, per owner and per block): ``held``, ``pulled``,
    ``released``, ``expired``. Expired entries are the leaks a router
    should have prevented (docs/simulator.md, "The PD protocol").
    """

    def __init__(self, lease_s: float, *, reaper_stops_at_first_live: bool = False) -> None:
        self.lease_s = lease_s
        #: The reaper of vLLM's lease era: it stops at the first unexpired entry in
        #: insertion order (vLLM issue 58222), so entries behind a renewed one stay held.
        self.reaper_stops_at_first_live = reaper_stops_at_first_live
        # Insertion order, as vLLM's ``_reqs_to_send`` dict: a renewal updates in place.
        self._entries: OrderedDict[str, KvEntry] = OrderedDict()
        # Recently expired entries: their blocks are free (maybe reused), but a late
        # pull still reads them, and vLLM tells nobody (vLLM issue 21570).
        self._expired: OrderedDict[str, KvEntry] = OrderedDict()
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

    def renew(self, owner: str, now: float) -> bool:
        """Extend ``owner``'s lease to ``now`` + two thirds of a lease (a heartbeat); ``False`` when not held.

        vLLM's ``_handle_heartbeat`` (``nixl/base_worker.py``) sets the expiry to
        ``max(old, now + kv_lease_duration * 2 // 3)`` in place, keeping the entry's
        position. An entry already expired (or pulled, released) is not brought back.
        """
        entry = self._entries.get(owner)
        if entry is None:
            return False
        entry.expires_at = max(entry.expires_at, now + self.lease_s * 2.0 / 3.0)
        return True

    def find_blocks(self, block_ids: list[int], *, expired: bool = False) -> KvEntry | None:
        """The held (``expired``: recently expired) entry whose blocks are ``block_ids`` (connector 1 names no owner)."""
        for entry in (self._expired if expired else self._entries).values():
            if entry.block_ids == block_ids:
                return entry
        return None

    def expired_entry(self, owner: str) -> KvEntry | None:
        """``owner``'s entry if its lease ran out recently: a pull now reads freed blocks."""
        return self._expired.get(owner)

    def owners(self) -> list[str]:
        """The owners held, oldest first."""
        return list(self._entries)

    def pull(self, owner: str) -> KvEntry | None:
        """A decode engine took the KV of ``owner``; ``None`` when nothing is held."""
        return self._end(owner, "pulled")

    def release(self, owner: str) -> KvEntry | None:
        """Free ``owner``'s KV on request; ``None`` (and nothing freed) when unknown."""
        return self._end(owner, "released")

    def expire_due(self, now: float) -> list[KvEntry]:
        """End every entry whose lease ran out at ``now`` (with the lease-era reaper: up to the first live one)."""
        due = []
        for entry in self._entries.values():
            if entry.expires_at > now:
                if self.reaper_stops_at_first_live:
                    break
                continue
            due.append(entry)
        expired = [self._end(entry.owner, "expired") for entry in due]
        for entry in due:
            self._expired[entry.owner] = entry
            if len(self._expired) > _EXPIRED_KEPT:
                self._expired.popitem(last=False)
        return [e for e in expired if e is not None]

    def next_deadline(self) -> float | None:
        """When the reaper frees the next entry, or ``None`` when nothing is held."""
        if self.reaper_stops_at_first_live:
            for entry in self._entries.values():
                return entry.expires_at
            return None
        return min((entry.expires_at for entry in self._entries.values()), default=None)

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
    #: The first sampled token is the end of sequence (``finish_reason: "stop"``), unless
    #: the request's ``min_tokens`` forbids it.
    eos: bool = False
    #: A decode leg's KV read fails (the prefill engine is not told; it keeps the blocks).
    pull_fail: bool = False
    #: A push-mode decode leg's registration never reaches the prefill engine.
    push_reg_lost: bool = False


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
    #: Share of requests whose first sampled token ends the sequence (vLLM's FINISHED_STOPPED).
    eos_rate: float = 0.0
    #: Share of decode legs whose KV read fails (then recompute or fail per ``kv_load_failure``).
    pull_fail_rate: float = 0.0
    #: Share of push-mode decode legs whose registration is lost (the prefill engine never writes).
    push_reg_lost_rate: float = 0.0
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
            or self.eos_rate > 0
            or self.pull_fail_rate > 0
            or self.push_reg_lost_rate > 0
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
            eos=fires("eos", self.eos_rate),
            pull_fail=fires("pull_fail", self.pull_fail_rate),
            push_reg_lost=fires("push_reg_lost", self.push_reg_lost_rate),
        )


_RATE_FIELDS = {
    "error_rate",
    "drop_rate",
    "delay_rate",
    "stall_rate",
    "drop_after_chunks_rate",
    "omit_kv_params_rate",
    "malformed_json_rate",
    "eos_rate",
    "pull_fail_rate",
    "push_reg_lost_rate",
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
