"""The prefix index: which prompt prefixes an engine probably holds in its KV cache.

An engine with prefix caching keeps the KV of the prompts it computed, in
blocks named by a chained hash of the tokens up to each block's end, and
evicts least recently used blocks when it needs room (vLLM V1:
``vllm/v1/core/single_type_kv_cache_manager.py``). Narwhal cannot see those
blocks, and has no tokenizer, so it keeps an approximation of its own per
engine (docs/design.md, "The prefix index"):

* :func:`prompt_key` — the bytes that decide what an engine renders and
  caches for a request, in prompt order, so that two requests whose rendered
  prompts share a beginning have keys sharing a beginning too;
* :func:`block_hashes` — chained hashes of the key's full blocks of
  :data:`BLOCK_BYTES` bytes (a size chosen for cost, not the engine's block
  size);
* :class:`PrefixIndex` — the hashes of what was sent to one engine, bounded
  by that engine's KV capacity, least recently used first out.

Everything here is a pure function of its arguments or an instance's own
state: no clock, no randomness, nothing at module level that changes.
"""

from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

import orjson
import xxhash

from .wire import RawFloat, RawInt

__all__ = [
    "BLOCK_BYTES",
    "BYTES_PER_TOKEN",
    "PrefixIndex",
    "block_hashes",
    "blocks_to_tokens",
    "estimated_tokens",
    "prompt_key",
    "tokens_to_blocks",
]

#: Bytes of prompt key per block of the approximate index (not the engine's
#: block size; chosen for cost: docs/design.md, "The prefix index").
BLOCK_BYTES: Final = 2048
#: Prompt key bytes per token, for turning blocks into expected tokens (the
#: simulator counts 4 characters a token, docs/simulator.md; a token ID is 4
#: bytes in the key).
BYTES_PER_TOKEN: Final = 4

# The key's structure is written with bytes that never occur in UTF-8 (0xF8
# to 0xFF), so a raw string value needs no escaping and no length in front
# of it: two strings sharing a beginning give keys sharing that beginning.
_CHAT: Final = b"\xfa"  # a chat key starts with it
_FIELD: Final = b"\xfd"  # a named field: name, _END, value
_MESSAGE: Final = b"\xfe"  # a chat message: role, content, then its other fields
_END: Final = b"\xff"  # ends a name or a value
_JSON: Final = b"\xfc"  # the value that follows is canonical JSON, not a raw string
_PROMPT: Final = b"\xfb"  # ends a completion key's fields; the prompt follows
_TRAILER: Final = b"\xf9"  # the chat fields that shape the end of the rendered prompt
_TOKEN_IDS: Final = b"\xf8ids"  # token IDs follow, 4 bytes each (4 bytes long: blocks stay token-aligned)
# Token IDs packed as unsigned 32-bit little-endian integers. ``array`` packs
# a list of ints in one C loop; "I" is 4 bytes on every platform CPython runs
# on, and the byte order is the machine's, swapped where it is big-endian.
_U32: Final = "I"
_SWAP: Final = array(_U32, [1]).tobytes() != b"\x01\x00\x00\x00"
_U32_MASK: Final = 0xFFFFFFFF

# What changes the rendered prompt besides the messages, as vLLM's OpenAI
# server reads a request (vllm-project/vllm, vllm/entrypoints/openai/protocol.py
# ChatCompletionRequest and CompletionRequest, and serving_chat.py
# create_chat_completion's call to _preprocess_chat; vLLM 0.10, commit
# 0052bed3): each is (name, vLLM's default); a field at its default or null
# is left out of the key, so that it equals the key of a body without it.
# The chat fields that can change the prompt anywhere (the template, what it
# is given, the prefix cache's salt, truncation from the left) come before
# the messages; the ones that only shape its end come after them.
_CHAT_HEADER: Final = (
    ("cache_salt", None),  # salts every block hash of the engine's prefix cache
    ("chat_template", None),
    ("chat_template_kwargs", None),
    ("reasoning_effort", None),  # rendered into the system message by some templates
    ("tools", None),  # rendered before the conversation by the usual templates
    ("documents", None),
    ("mm_processor_kwargs", None),  # changes how images become prompt tokens
    ("add_special_tokens", False),  # a BOS token in front of the template's
    ("truncate_prompt_tokens", None),  # keeps the last N tokens: changes the beginning
)
_CHAT_TRAILER: Final = (
    ("add_generation_prompt", True),
    ("continue_final_message", False),
)
_COMPLETION_HEADER: Final = (
    ("cache_salt", None),
    ("add_special_tokens", True),
    ("truncate_prompt_tokens", None),
    ("prompt_embeds", None),
)
_COMPLETION_NAMES: Final = frozenset(name for name, _ in _COMPLETION_HEADER)
_CHAT_NAMES: Final = frozenset(name for name, _ in (*_CHAT_HEADER, *_CHAT_TRAILER, ("tool_choice", None)))
# The usual roles with their message's marker before and their end after:
# one lookup instead of an encode, for the common message.
_ROLE_PARTS: Final = MappingProxyType(
    {role: _MESSAGE + role.encode() + _END for role in ("system", "developer", "user", "assistant", "tool")}
)
# ``tool_choice`` changes the prompt only when it is "none" and the engine
# runs with --exclude-tools-when-tool-choice-none (the tools are then not
# rendered); other values only constrain the output. ``echo`` changes what
# is answered, never the prompt.
_TOOL_CHOICE_NONE: Final = (_FIELD, b"tool_choice", _END, b"none", _END)


def prompt_key(body: Mapping[str, Any], chat: bool) -> bytes:
    """The bytes that decide what an engine renders and caches for this request, in prompt order.

    ``body`` is a request body as decoded from JSON (after the contract's
    check); ``chat`` says it came on ``/v1/chat/completions``. A plain string
    prompt's key is its UTF-8 bytes. A chat's key is the fields that shape
    the whole rendered prompt (tools, template, salt...), then every message
    in order (role, content, then its other fields by name), then the fields
    that only shape its end: so the key of a conversation is a prefix of the
    key of the same conversation with messages appended. Equal bodies give
    equal keys whatever the order of their objects' keys; any value gives a
    key (a body the contract refuses too), and no exception escapes for a
    body decoded from JSON.
    """
    if chat:
        return _chat_key(body)
    prompt = body.get("prompt")
    if _COMPLETION_NAMES.isdisjoint(body):
        if type(prompt) is str:
            try:
                return prompt.encode()
            except UnicodeEncodeError:
                return _utf8(prompt)
        return _prompt_bytes(prompt)
    parts: list[bytes] = []
    _append_fields(parts, body, _COMPLETION_HEADER)
    if not parts:
        return _prompt_bytes(prompt)
    parts.append(_PROMPT)
    parts.append(_prompt_bytes(prompt))
    return b"".join(parts)


def _prompt_bytes(prompt: Any) -> bytes:
    """A completion's prompt: a string's UTF-8, token IDs packed 4 bytes each.

    A batch (a list of strings or of token-ID lists) is keyed by its first
    prompt: the router serves each prompt of a batch with a body of its own
    (docs/operate.md, "Batch prompts"), and a one-item list is that item.
    """
    if type(prompt) is str:
        return _utf8(prompt)
    if prompt is None:
        return b""
    if type(prompt) is list and prompt:
        first = prompt[0]
        if type(first) is str:
            return _utf8(first)
        if type(first) is list:
            return _prompt_bytes(first) if first and type(first[0]) is int else _JSON + _canonical(first)
        packed = _token_ids(prompt)
        if packed is not None:
            return packed
    return _JSON + _canonical(prompt)


def _token_ids(ids: list[Any]) -> bytes | None:
    """A token-id prompt's key: its marker, then the ids packed (``None`` when they are not all integers)."""
    packed = pack_token_ids(ids)
    return None if packed is None else _TOKEN_IDS + packed


def pack_token_ids(ids: Sequence[Any]) -> bytes | None:
    """``ids`` packed as 32-bit little-endian integers, or ``None`` when they are not all integers."""
    try:
        packed = array(_U32, ids)
    except TypeError:
        return None
    except OverflowError:
        # Out of range for the engine anyway (it refuses them): keep the low 32 bits.
        try:
            packed = array(_U32, [t & _U32_MASK for t in ids])
        except TypeError:
            return None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _chat_key(body: Mapping[str, Any]) -> bytes:
    parts = [_CHAT]
    if _CHAT_NAMES.isdisjoint(body):
        _append_messages(parts, body.get("messages"))
        return b"".join(parts)
    _append_fields(parts, body, _CHAT_HEADER)
    if body.get("tool_choice") == "none" and body.get("tools"):
        parts.extend(_TOOL_CHOICE_NONE)
    _append_messages(parts, body.get("messages"))
    trailer_at = len(parts)
    _append_fields(parts, body, _CHAT_TRAILER)
    if len(parts) > trailer_at:
        parts.insert(trailer_at, _TRAILER)
    return b"".join(parts)


def _append_messages(parts: list[bytes], messages: Any) -> None:
    """Every message in order: its role, its content, then its other fields by name."""
    if type(messages) is not list:
        if messages is not None:
            parts.extend((_MESSAGE, _JSON, _canonical(messages), _END))
        return
    append = parts.append
    role_part_of = _ROLE_PARTS.copy().get  # a plain dict's: faster than through the proxy
    end = _END
    for message in messages:
        # The usual message, {"role": a usual role, "content": a string}, in the fewest steps;
        # anything else (or a string that needs _utf8) the general way, to the same bytes.
        try:
            if len(message) == 2:
                role_part = role_part_of(message["role"])
                if role_part is not None:
                    content = message["content"].encode()
                    append(role_part)
                    append(content)
                    append(end)
                    continue
        except (TypeError, KeyError, AttributeError, UnicodeEncodeError):
            pass
        _append_message(parts, message)


def _append_message(parts: list[bytes], message: Any) -> None:
    if not isinstance(message, Mapping):
        parts.extend((_MESSAGE, _JSON, _canonical(message), _END))
        return
    parts.append(_MESSAGE)
    _append_value(parts, message.get("role"))
    _append_content(parts, message.get("content"))
    if len(message) != 2 or "role" not in message or "content" not in message:
        _append_other_fields(parts, message)


def _append_fields(parts: list[bytes], body: Mapping[str, Any], table: tuple[tuple[str, Any], ...]) -> None:
    """The fields of ``table`` that ``body`` sets to something other than vLLM's default, in table order."""
    get = body.get
    for name, default in table:
        value = get(name)
        if value is None or value is default:
            continue
        parts.append(_FIELD)
        parts.append(name.encode())
        parts.append(_END)
        _append_value(parts, value)


def _utf8(text: str) -> bytes:
    """``text`` in UTF-8, never failing: a lone surrogate becomes its 3 bytes (never a marker's byte).

    Text decoded from JSON holds none (the decoder refuses them).
    """
    try:
        return text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _append_value(parts: list[bytes], value: Any) -> None:
    if type(value) is str:
        parts.append(_utf8(value))
    else:
        parts.append(_JSON)
        parts.append(_canonical(value))
    parts.append(_END)


def _append_content(parts: list[bytes], content: Any) -> None:
    """A message's content: text parts as raw text (so one text part keys like the same string), others as JSON."""
    if type(content) is not list:
        _append_value(parts, content)
        return
    for part in content:
        text = part.get("text") if type(part) is dict and len(part) == 2 and part.get("type") == "text" else None
        _append_value(parts, part if text is None else text)


def _append_other_fields(parts: list[bytes], message: Mapping[Any, Any]) -> None:
    """A message's fields besides role and content, by name (so the order of its keys does not matter)."""
    others = [name for name in message if name != "role" and name != "content"]
    others.sort(key=_name)
    for name in others:
        parts.append(_FIELD)
        parts.append(_utf8(_name(name)))
        parts.append(_END)
        _append_value(parts, message[name])


def _name(name: Any) -> str:
    return name if type(name) is str else repr(name)


def _canonical(value: Any) -> bytes:
    """``value`` as JSON with sorted keys: equal values, equal bytes, whatever their objects' key order."""
    try:
        return orjson.dumps(value, default=_exact_number, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        pass
    # What orjson refuses: lone surrogates, integers beyond 64 bits, very deep nesting, other types.
    try:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return _utf8(text)


def _exact_number(value: Any) -> Any:
    if isinstance(value, (RawFloat, RawInt)):
        return orjson.Fragment(value.text)
    raise TypeError


def block_hashes(key: bytes, block_bytes: int = BLOCK_BYTES, seed: int = 0) -> list[int]:
    """Chained hashes of the key's FULL blocks: ``hashes[i]`` names ``key[:(i+1)*block_bytes]``.

    So equal prefixes give equal leading hashes, and a difference anywhere in
    block ``i`` changes hashes ``i`` and after. A trailing partial block has
    no hash (the engine does not cache a partial block either).

    Each block is hashed with XXH3-64 seeded with the previous block's hash
    (the first with ``seed``, 0 unless a chain continues one): 64 bits, the same in every process and on every
    machine, at C speed (docs/design.md, "The prefix index", has the
    figures). It is not meant to resist a chosen collision, which would only
    make one engine look as if it held a block it does not: the engine's own
    cache is keyed by its own hashes.
    """
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be at least 1, not {block_bytes}")
    if len(key) < block_bytes:
        return []
    view = memoryview(key)
    hashes: list[int] = []
    append = hashes.append
    xxh3 = xxhash.xxh3_64_intdigest
    value = seed
    for start in range(0, len(view) - block_bytes + 1, block_bytes):
        value = xxh3(view[start : start + block_bytes], value)
        append(value)
    return hashes


def blocks_to_tokens(blocks: int, block_bytes: int = BLOCK_BYTES) -> int:
    """The prompt tokens ``blocks`` blocks of key stand for."""
    return blocks * block_bytes // BYTES_PER_TOKEN


def tokens_to_blocks(tokens: int, block_bytes: int = BLOCK_BYTES) -> int:
    """How many whole blocks of key ``tokens`` tokens of KV hold (an engine's capacity, as index blocks)."""
    return max(0, tokens) * BYTES_PER_TOKEN // block_bytes


def estimated_tokens(key: bytes) -> int:
    """The prompt tokens a key stands for, at :data:`BYTES_PER_TOKEN` bytes a token."""
    return len(key) // BYTES_PER_TOKEN


class PrefixIndex:
    """What one engine probably holds: block hashes, LRU, bounded.

    The index is told what was sent to the engine (:meth:`insert`) and
    forgets the least recently used blocks past its capacity, as the engine
    evicts its own. A request's blocks are touched last block first, so its
    first block is the most recent: that is the order in which vLLM frees a
    finished request's blocks, "so that the tail blocks are evicted first"
    (``SingleTypeKVCacheManager.free``,
    ``vllm/v1/core/single_type_kv_cache_manager.py``, vLLM 0.9-0.10), and it
    keeps the index prefix-closed: a held block's predecessors are held too.
    Every operation costs O(1) per block.
    """

    __slots__ = ("_blocks", "_capacity")

    def __init__(self, capacity_blocks: int) -> None:
        self._capacity = _checked_capacity(capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @property
    def capacity_blocks(self) -> int:
        """The most blocks the index holds."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._blocks)

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """How many LEADING hashes the index holds (it stops at the first miss); changes nothing."""
        blocks = self._blocks
        if not hashes or hashes[0] not in blocks:
            return 0  # the usual miss, in one lookup
        count = 0
        for value in hashes:
            if value not in blocks:
                break
            count += 1
        return count

    def insert(self, hashes: Sequence[int]) -> None:
        """The request was sent there: all its blocks are now held, the most recently used.

        The last block is touched first and the first last; past the
        capacity, the least recently used blocks are forgotten.
        """
        if not hashes:
            return
        blocks = self._blocks
        move_to_end = blocks.move_to_end
        for value in reversed(hashes):
            if value in blocks:
                move_to_end(value)
            else:
                blocks[value] = None
        self._evict()

    def clear(self) -> None:
        """Forget every block (the engine restarted, or reset its prefix cache)."""
        self._blocks.clear()

    def resize(self, capacity_blocks: int) -> None:
        """A capacity learned later (from the engine's metrics); a smaller one evicts at once."""
        self._capacity = _checked_capacity(capacity_blocks)
        self._evict()

    def _evict(self) -> None:
        blocks = self._blocks
        popitem = blocks.popitem
        for _ in range(len(blocks) - self._capacity):
            popitem(False)  # the least recently used


def _checked_capacity(capacity_blocks: int) -> int:
    if type(capacity_blocks) is not int or capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be an integer of at least 0, not {capacity_blocks!r}")
    return capacity_blocks
