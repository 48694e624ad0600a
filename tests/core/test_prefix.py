"""The prefix index (docs/design.md, "The prefix index"): prompt keys, chained block hashes, the bounded LRU.

Oracles: a list-based LRU written from the docstrings (touch the request's
blocks last block first, forget the oldest past the capacity, match the
leading held hashes); for keys, the promises of docs/design.md — the key
covers every message, the tools and the template fields, it grows as a
conversation grows, and it does not depend on the order of an object's keys.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal_core import wire
from narwhal_core.prefix import (
    BLOCK_BYTES,
    BYTES_PER_TOKEN,
    PrefixIndex,
    block_hashes,
    blocks_to_tokens,
    estimated_tokens,
    prompt_key,
    tokens_to_blocks,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- the index against a list-based LRU


class ListLru:
    """The reference: a plain list, oldest first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: list[int] = []

    def insert(self, hashes: list[int]) -> None:
        for value in reversed(hashes):
            if value in self.held:
                self.held.remove(value)
            self.held.append(value)
        self.evict()

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.evict()

    def evict(self) -> None:
        while len(self.held) > self.capacity:
            self.held.pop(0)

    def matched(self, hashes: list[int]) -> int:
        count = 0
        for value in hashes:
            if value not in self.held:
                break
            count += 1
        return count


HASH_LISTS = st.lists(st.integers(0, 12), max_size=10)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), HASH_LISTS),
        st.tuples(st.just("match"), HASH_LISTS),
        st.tuples(st.just("resize"), st.integers(0, 9)),
        st.tuples(st.just("clear"), st.none()),
    ),
    max_size=40,
)


@SETTINGS
@given(capacity=st.integers(0, 9), ops=OPS)
def test_index_matches_a_list_lru_and_never_exceeds_its_bound(capacity: int, ops: list[tuple[str, Any]]) -> None:
    index, model = PrefixIndex(capacity), ListLru(capacity)
    for op, arg in ops:
        if op == "insert":
            index.insert(arg)
            model.insert(arg)
        elif op == "match":
            assert index.matched_blocks(arg) == model.matched(arg)
        elif op == "resize":
            index.resize(arg)
            model.resize(arg)
        else:
            index.clear()
            model.held.clear()
        assert len(index) == len(model.held) <= index.capacity_blocks == model.capacity
        # Every held block, and only those, matches on its own; the most recent matches a whole run.
        for value in range(13):
            assert index.matched_blocks([value]) == (value in model.held)
        assert index.matched_blocks(model.held[::-1]) == len(model.held)


CHAINS = st.lists(st.lists(st.sampled_from([b"aaaa", b"bbbb", b"cccc"]), max_size=6).map(b"".join), min_size=1, max_size=6)


@SETTINGS
@given(prompts=CHAINS, order=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12)), max_size=30))
def test_chains_of_block_hashes_keep_the_index_prefix_closed(prompts: list[bytes], order: list[tuple[int, int]]) -> None:
    # What the engine would hold: a block's predecessors are held whenever it is (docs/design.md).
    chains = [block_hashes(p, 4) for p in prompts]
    index = PrefixIndex(5)
    for which, capacity in order:
        if capacity > 10:
            index.resize(capacity - 8)
        else:
            index.insert(chains[which % len(chains)])
        for chain in chains:
            held = [index.matched_blocks([h]) == 1 for h in chain]
            matched = index.matched_blocks(chain)
            assert held == [True] * matched + [False] * (len(chain) - matched)


def test_insert_touches_the_last_block_first_so_the_tail_goes_first() -> None:
    index = PrefixIndex(3)
    index.insert([1, 2, 3])
    index.insert([7])  # over capacity: the request's last block (3) is its oldest
    assert index.matched_blocks([1, 2, 3]) == 2
    assert index.matched_blocks([7]) == 1
    index.insert([1, 2, 4, 5])  # four blocks into three: the first three stay
    assert index.matched_blocks([1, 2, 4, 5]) == 3
    assert len(index) == 3


def test_matched_blocks_changes_nothing() -> None:
    index = PrefixIndex(2)
    index.insert([1])
    index.insert([2])
    assert index.matched_blocks([1]) == 1  # a lookup is not a use:
    index.insert([3])
    assert index.matched_blocks([1]) == 0  # 1 was still the least recently used
    assert index.matched_blocks([2]) == index.matched_blocks([3]) == 1


def test_resize_clear_and_bad_capacities() -> None:
    index = PrefixIndex(4)
    index.insert([1, 2, 3, 4])
    index.resize(2)
    assert len(index) == 2 and index.matched_blocks([1, 2]) == 2
    index.resize(10)
    assert index.capacity_blocks == 10 and len(index) == 2
    index.clear()
    assert len(index) == 0 and index.matched_blocks([1]) == 0
    assert PrefixIndex(0).capacity_blocks == 0
    zero = PrefixIndex(0)
    zero.insert([1, 2])
    assert len(zero) == 0
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ValueError):
            PrefixIndex(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            index.resize(bad)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        index.capacity_blocks = 3  # type: ignore[misc]


def test_instances_share_nothing() -> None:
    a, b = PrefixIndex(4), PrefixIndex(4)
    a.insert([1, 2])
    assert len(b) == 0 and b.matched_blocks([1]) == 0


# ----------------------------------------------------------------------------- block hashes


def key_of(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


@SETTINGS
@given(seed=st.integers(0, 2**32), blocks=st.integers(0, 24), tail=st.integers(0, BLOCK_BYTES - 1), data=st.data())
def test_equal_prefixes_equal_hashes_a_changed_byte_changes_its_block_and_after(
    seed: int, blocks: int, tail: int, data: st.DataObject
) -> None:
    key = key_of(seed, blocks * BLOCK_BYTES + tail)  # up to 48 KB and a partial block
    hashes = block_hashes(key)
    assert len(hashes) == blocks  # full blocks only
    other = key + key_of(seed + 1, data.draw(st.integers(0, 3 * BLOCK_BYTES)))
    assert block_hashes(other)[:blocks] == hashes  # a longer key with the same beginning
    if not key:
        return
    position = data.draw(st.integers(0, len(key) - 1))
    changed = bytearray(key)
    changed[position] ^= data.draw(st.integers(1, 255))
    changed_hashes = block_hashes(bytes(changed))
    first = position // BLOCK_BYTES
    assert changed_hashes[:first] == hashes[:first]
    assert all(a != b for a, b in zip(changed_hashes[first:], hashes[first:]))


def test_hashes_are_the_same_in_every_process() -> None:
    # Pinned values: a hash that varied with PYTHONHASHSEED (or per run) would fail here.
    key = bytes(range(256)) * (3 * BLOCK_BYTES // 256) + b"tail"
    assert block_hashes(key) == PINNED_HASHES
    assert block_hashes(b"abcdefgh", 4) == block_hashes(b"abcdefgh", 4)
    assert len(block_hashes(b"abcdefgh", 4)) == 2 and block_hashes(b"abcdefg", 4)[0] == block_hashes(b"abcd", 4)[0]


PINNED_HASHES = [15943310518510861568, 3915517667738680766, 2538500191705181167]


def test_block_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError):
        block_hashes(b"abc", 0)
    assert block_hashes(b"", 1) == []


def test_blocks_and_tokens() -> None:
    assert BYTES_PER_TOKEN == 4 and BLOCK_BYTES % BYTES_PER_TOKEN == 0
    assert blocks_to_tokens(3) == 3 * BLOCK_BYTES // 4
    assert tokens_to_blocks(blocks_to_tokens(7)) == 7
    assert tokens_to_blocks(blocks_to_tokens(7) + 1) == 7 and tokens_to_blocks(-5) == 0
    assert estimated_tokens(b"x" * 4000) == 1000


# ----------------------------------------------------------------------------- prompt keys: completions


def test_a_string_prompt_is_its_utf8_bytes() -> None:
    assert prompt_key({"prompt": "héllo", "max_tokens": 3}, False) == "héllo".encode()
    assert prompt_key({"prompt": ["héllo"]}, False) == "héllo".encode()
    assert prompt_key({"prompt": "\ud800x"}, False)  # a lone surrogate gives a key, no error


def test_token_id_prompts() -> None:
    key = prompt_key({"prompt": [1, 258, 70000]}, False)
    ids = key[-12:]
    assert ids == (1).to_bytes(4, "little") + (258).to_bytes(4, "little") + (70000).to_bytes(4, "little")
    assert len(key) % BYTES_PER_TOKEN == 0  # blocks stay token-aligned
    assert prompt_key({"prompt": [[1, 258, 70000]]}, False) == key  # one prompt in a list
    assert prompt_key({"prompt": [[1, 258, 70000], [5]]}, False) == key  # a batch: its first prompt
    longer = prompt_key({"prompt": [1, 258, 70000, 9]}, False)
    assert longer.startswith(key)
    # Token IDs and text never give the same key.
    assert prompt_key({"prompt": (1).to_bytes(4, "little").decode()}, False) != prompt_key({"prompt": [1]}, False)
    # Out-of-range IDs (the engine refuses them) still give a key.
    assert prompt_key({"prompt": [-1, 2**40]}, False)
    assert prompt_key({"prompt": [1, "a"]}, False) != prompt_key({"prompt": [1]}, False)


def test_completion_fields_that_change_the_prompt() -> None:
    base = {"prompt": "the same words"}
    key = prompt_key(base, False)
    for name, value in (
        ("cache_salt", "s1"),
        ("add_special_tokens", False),
        ("truncate_prompt_tokens", 5),
        ("prompt_embeds", "AAAA"),
    ):
        assert prompt_key({**base, name: value}, False) != key, name
    # At vLLM's default, or null, a field is as good as absent.
    assert prompt_key({**base, "add_special_tokens": True, "cache_salt": None}, False) == key
    # Fields that never change the prompt do not change the key.
    assert prompt_key({**base, "echo": True, "max_tokens": 9, "temperature": 0.5}, False) == key
    assert prompt_key({**base, "cache_salt": "s1"}, False) != prompt_key({**base, "cache_salt": "s2"}, False)


# ----------------------------------------------------------------------------- prompt keys: chats

TEXT = st.text(alphabet="ab\n\"é\x00", max_size=6)
SIMPLE_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT},
    optional={"name": TEXT},
)


@SETTINGS
@given(a=st.lists(SIMPLE_MESSAGE, max_size=4), b=st.lists(SIMPLE_MESSAGE, max_size=4))
def test_chat_keys_are_equal_exactly_when_the_messages_are(a: list[Any], b: list[Any]) -> None:
    assert (prompt_key({"messages": a}, True) == prompt_key({"messages": b}, True)) == (a == b)


CONTENT = st.one_of(
    TEXT,
    st.none(),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
            st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": TEXT})}),
        ),
        max_size=3,
    ),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": CONTENT},
    optional={
        "name": TEXT,
        "tool_call_id": TEXT,
        "reasoning_content": TEXT,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {"id": TEXT, "type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT, "arguments": TEXT})}
            ),
            max_size=2,
        ),
    },
)
CHANGES = st.sampled_from(["role", "content", "append_text", "name", "tool_calls", "drop_field", "new_field"])


def changed(message: dict[str, Any], how: str) -> dict[str, Any]:
    out = dict(message)
    if how == "role":
        out["role"] = out["role"] + "x"
    elif how == "content":
        out["content"] = [{"type": "image_url", "image_url": {"url": "u"}}] if out["content"] != [] else "z"
        if out["content"] == message["content"]:
            out["content"] = "zz"
    elif how == "append_text":  # "!" is not in TEXT's alphabet
        out["content"] = (out["content"] if isinstance(out["content"], str) else "") + "!"
    elif how == "name":
        out["name"] = str(out.get("name", "")) + "n"
    elif how == "tool_calls":
        out["tool_calls"] = [*out.get("tool_calls", []), {"id": "c", "type": "function", "function": {"name": "f"}}]
    elif how == "drop_field" and len(out) > 2:
        del out[sorted(k for k in out if k not in ("role", "content"))[0]]
    else:
        out["weight"] = 1
    return out


@SETTINGS
@given(messages=st.lists(MESSAGE, min_size=1, max_size=5), data=st.data(), how=CHANGES)
def test_changing_any_message_changes_the_key(messages: list[Any], data: st.DataObject, how: str) -> None:
    where = data.draw(st.integers(0, len(messages) - 1))
    other = [*messages]
    other[where] = changed(messages[where], how)
    assert prompt_key({"messages": other}, True) != prompt_key({"messages": messages}, True)


def shuffled(value: Any, rnd: random.Random) -> Any:
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        items = [(k, shuffled(v, rnd)) for k, v in value.items()]
        rnd.shuffle(items)
        return dict(items)
    if isinstance(value, list):
        return [shuffled(v, rnd) for v in value]
    return value


TOOLS = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": TEXT, "parameters": st.dictionaries(TEXT, st.integers() | TEXT, max_size=3)}
            ),
        }
    ),
    max_size=2,
)


@SETTINGS
@given(messages=st.lists(MESSAGE, max_size=4), tools=TOOLS, seed=st.integers())
def test_the_order_of_an_objects_keys_does_not_matter(messages: list[Any], tools: list[Any], seed: int) -> None:
    body = {"messages": messages, "tools": tools, "chat_template_kwargs": {"a": 1, "b": [2, {"c": 3, "d": 4}]}}
    assert prompt_key(body, True) == prompt_key(shuffled(body, random.Random(seed)), True)


@SETTINGS
@given(messages=st.lists(MESSAGE, min_size=1, max_size=5), tools=TOOLS)
def test_appending_messages_extends_the_key(messages: list[Any], tools: list[Any]) -> None:
    for k in range(len(messages)):
        shorter = prompt_key({"messages": messages[:k], "tools": tools}, True)
        longer = prompt_key({"messages": messages, "tools": tools}, True)
        assert longer.startswith(shorter) and len(longer) > len(shorter)
        # Fields that shape only the end of the prompt keep the messages' prefix shared.
        ending = {"add_generation_prompt": False}
        shorter_ending = prompt_key({"messages": messages[:k], "tools": tools, **ending}, True)
        assert os.path.commonprefix([shorter_ending, longer]) == shorter


def long_conversation(turns: int, seed: int) -> list[dict[str, str]]:
    rnd = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta\n", "é", '"quoted"']
    messages = [{"role": "system", "content": " ".join(rnd.choice(words) for _ in range(900))}]
    for turn in range(turns):
        role = "user" if turn % 2 == 0 else "assistant"
        messages.append({"role": role, "content": " ".join(rnd.choice(words) for _ in range(rnd.randint(50, 700)))})
    return messages


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), turns=st.integers(2, 12))
def test_a_multi_turn_chat_shares_the_earlier_turns_blocks(seed: int, turns: int) -> None:
    conversation = long_conversation(turns, seed)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    earlier = prompt_key({"messages": conversation[:-1], "tools": tools}, True)
    later = prompt_key({"messages": conversation, "tools": tools}, True)
    earlier_hashes, later_hashes = block_hashes(earlier), block_hashes(later)
    assert earlier_hashes and later_hashes[: len(earlier_hashes)] == earlier_hashes
    assert len(later_hashes) >= len(earlier_hashes)
    # The engine of the earlier turn holds every full block of it.
    index = PrefixIndex(1000)
    index.insert(earlier_hashes)
    assert index.matched_blocks(later_hashes) == len(earlier_hashes)
    # Another system prompt shares nothing from the first block on.
    other = [{"role": "system", "content": "x" + conversation[0]["content"]}, *conversation[1:]]
    assert index.matched_blocks(block_hashes(prompt_key({"messages": other, "tools": tools}, True))) == 0


HEADER_CHANGES: list[tuple[str, Any]] = [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat_template", "{{ messages }}"),
    ("chat_template_kwargs", {"enable_thinking": False}),
    ("documents", [{"title": "t", "text": "x"}]),
    ("cache_salt", "salt"),
    ("reasoning_effort", "high"),
    ("mm_processor_kwargs", {"fps": 2}),
    ("add_special_tokens", True),
    ("truncate_prompt_tokens", 100),
    ("add_generation_prompt", False),
    ("continue_final_message", True),
]


@pytest.mark.parametrize(("name", "value"), HEADER_CHANGES, ids=[n for n, _ in HEADER_CHANGES])
def test_tools_and_template_fields_change_the_key(name: str, value: Any) -> None:
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    assert prompt_key({**body, name: value}, True) != prompt_key(body, True)


def test_fields_that_do_not_change_the_prompt_leave_the_key() -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "u"}]}
    key = prompt_key(body, True)
    same = {
        **body, "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
        "echo": True, "max_tokens": 5, "stream": True, "temperature": 0.2, "tool_choice": "auto", "model": "m",
        "chat_template": None,
    }  # fmt: skip
    assert prompt_key(same, True) == key
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = prompt_key({**body, "tools": tools}, True)
    assert prompt_key({**body, "tools": tools, "tool_choice": "required"}, True) == with_tools
    # "none" can keep the tools out of the rendered prompt (--exclude-tools-when-tool-choice-none).
    assert prompt_key({**body, "tools": tools, "tool_choice": "none"}, True) != with_tools


def test_tools_come_before_the_messages_and_text_parts_key_like_strings() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"messages": [{"role": "user", "content": "hello there"}], "tools": tools}
    key = prompt_key(body, True)
    assert key.index(b'"name":"f"') < key.index(b"hello there")
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}], "tools": tools}
    assert prompt_key(parts, True) == key


def test_chat_and_completion_keys_differ() -> None:
    chat = prompt_key({"messages": [{"role": "user", "content": "hi"}]}, True)
    assert prompt_key({"prompt": chat.decode("latin-1")}, False) != chat
    assert chat != prompt_key({"prompt": "hi"}, False)


def test_exact_numbers_from_the_wire() -> None:
    raw = b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"t": 0.10000000000000000555}}'
    other = raw.replace(b"555}", b"556}")
    assert prompt_key(wire.loads(raw), True) != prompt_key(wire.loads(other), True)
    big = b'{"messages": [], "chat_template_kwargs": {"n": 123456789012345678901234567890}}'
    assert b"123456789012345678901234567890" in prompt_key(wire.loads(big), True)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=12,
)


@SETTINGS
@given(body=st.dictionaries(st.sampled_from(["prompt", "messages", "tools", "cache_salt", "add_special_tokens",
                                             "tool_choice", "chat_template_kwargs", "x"]), JSON), chat=st.booleans())  # fmt: skip
def test_any_json_body_gives_a_key(body: dict[str, Any], chat: bool) -> None:
    key = prompt_key(body, chat)
    assert isinstance(key, bytes)
    assert key == prompt_key(body, chat)


def test_odd_values_give_a_key() -> None:
    odd: list[Any] = [
        {"messages": [{"role": None}, "not an object", {1: "x", "role": "user"}], "tools": {"\ud800": 2**70}},
        {"messages": "text", "chat_template_kwargs": float("nan")},
        {"prompt": [[]]}, {"prompt": [["a"]]}, {"prompt": []}, {"prompt": 3}, {"prompt": [1.5]},
        {"prompt": "x", "cache_salt": object()},
    ]  # fmt: skip
    for body in odd:
        for chat in (True, False):
            assert isinstance(prompt_key(body, chat), bytes)
    deep: Any = []
    for _ in range(400):
        deep = [deep]
    assert isinstance(prompt_key({"messages": [{"role": "user", "content": deep}]}, True), bytes)


ODD_TEXT = st.text(alphabet=["a", "é", "\x00", "\udcfe", "\udcff", "\ud800", "\U0001f600"], max_size=4) | st.sampled_from(["user", "tool"])


@SETTINGS
@given(
    messages=st.lists(st.fixed_dictionaries({"role": ODD_TEXT, "content": ODD_TEXT}), min_size=1, max_size=4),
    extra=st.sampled_from([{}, {"name": "n"}, {"content": [{"type": "text", "text": "t"}]}]),
)
def test_plain_and_other_messages_key_the_same_way(messages: list[Any], extra: dict[str, Any]) -> None:
    # The usual message (a usual role, a string content) is keyed in fewer steps than the others, which
    # take the general way: both give the same bytes, odd text included.
    plain = prompt_key({"messages": messages}, True)
    mixed = prompt_key({"messages": [*messages, {"role": "user", "content": "x", **extra}]}, True)
    assert mixed.startswith(plain)
    with_fields = prompt_key({"messages": messages, "documents": [{"text": "d"}]}, True)
    assert with_fields.endswith(plain[1:])


@SETTINGS
@given(message=st.fixed_dictionaries({"role": ODD_TEXT, "content": ODD_TEXT}) | MESSAGE)
def test_the_short_way_for_usual_messages_gives_the_general_ways_bytes(message: dict[str, Any]) -> None:
    from narwhal_core.prefix import _append_message, _append_messages

    short: list[bytes] = []
    _append_messages(short, [message])
    general: list[bytes] = []
    _append_message(general, message)
    assert b"".join(short) == b"".join(general)
