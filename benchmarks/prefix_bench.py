"""Micro-benchmark of the prefix index's per-request work (``narwhal_core.prefix``).

What the ``prefix`` routing policy does once per request (docs/design.md,
"The prefix index"): build the prompt's key (:func:`prompt_key`), hash its
full blocks (:func:`block_hashes`), ask each of the 4 prefill engines'
indexes how many leading blocks they hold (:meth:`PrefixIndex.matched_blocks`)
and record the blocks on the chosen one (:meth:`PrefixIndex.insert`).

Three tables, in one run:

1. **Chained block hashing, by hash and block size**: CPU µs to hash a 1 KB
   and a 48 KB key (≈ 12k tokens) into chained block hashes, for each
   candidate: CRC-32 continued block to block (``zlib``), a
   64-bit ``blake2b`` continued with ``.copy()``, ``sha1`` likewise,
   ``xxhash``'s XXH3-64 seeded with the previous block's hash (when the
   ``xxhash`` package is installed), and Python's ``hash()`` (shown for
   scale only: it changes with ``PYTHONHASHSEED``, so the core cannot use it).
   The whole-key hash speed of each (one call over 48 KB) is shown beside it.
2. **Prompt keys**: µs for a 1 KB and a 48 KB string prompt, a chat of 21
   messages, and a 12k token-ID prompt; beside it, for scale, the JSON work
   the core does on the same body anyway (decoding it, encoding two legs).
3. **Per request**: ``prompt_key`` + ``block_hashes`` + ``matched_blocks``
   on 4 engines + ``insert`` on one, for the 1 KB and 48 KB string prompt
   and the 48 KB chat, with the module's hash (and each candidate hash in its
   place), in two states: *cold* (no engine holds any block: new prompts
   that evict old ones from full indexes) and *hot* (all 4 engines hold the
   whole prompt: every lookup walks every block).

Usage::

    python benchmarks/prefix_bench.py [--seconds 0.3] [--block-sizes 512,1024,2048,4096]

CPU time per operation (``time.thread_time``: other load on the host does
not count), best of 5 rounds of ``--seconds`` each.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import random
import time
import zlib
from collections.abc import Callable
from typing import Any

from narwhal_core import prefix, wire
from narwhal_core.prefix import PrefixIndex, block_hashes, prompt_key, tokens_to_blocks

try:
    import xxhash
except ImportError:  # an optional candidate: the table says it was not measured
    xxhash = None

ENGINES = 4
#: KV capacity per engine, in tokens (docs/simulator.md's pressure runs use 2M).
ENGINE_TOKENS = 2_000_000


def cpu_us(operation: Callable[[], Any], seconds: float) -> float:
    """Best-of-5 CPU µs per call of ``operation``."""
    best = float("inf")
    for _ in range(5):
        count = 0
        start = time.thread_time()
        deadline = start + seconds
        now = start
        while now < deadline:
            for _ in range(20):
                operation()
            count += 20
            now = time.thread_time()
        best = min(best, (now - start) / count)
    return best * 1e6


# ----------------------------------------------------------------------------- the candidate hashes


def crc32_chain(key: bytes, block_bytes: int) -> list[int]:
    view = memoryview(key)
    out: list[int] = []
    append = out.append
    crc = zlib.crc32
    value = 0
    for start in range(0, len(view) - block_bytes + 1, block_bytes):
        value = crc(view[start : start + block_bytes], value)
        append(value)
    return out


def blake2b_chain(key: bytes, block_bytes: int) -> list[int]:
    view = memoryview(key)
    out: list[int] = []
    state = hashlib.blake2b(digest_size=8)
    for start in range(0, len(view) - block_bytes + 1, block_bytes):
        state.update(view[start : start + block_bytes])
        out.append(int.from_bytes(state.copy().digest(), "little"))
    return out


def sha1_chain(key: bytes, block_bytes: int) -> list[int]:
    view = memoryview(key)
    out: list[int] = []
    state = hashlib.sha1()
    for start in range(0, len(view) - block_bytes + 1, block_bytes):
        state.update(view[start : start + block_bytes])
        out.append(int.from_bytes(state.copy().digest()[:8], "little"))
    return out


def xxh3_chain(key: bytes, block_bytes: int) -> list[int]:
    view = memoryview(key)
    out: list[int] = []
    append = out.append
    xxh = xxhash.xxh3_64_intdigest
    value = 0
    for start in range(0, len(view) - block_bytes + 1, block_bytes):
        value = xxh(view[start : start + block_bytes], value)
        append(value)
    return out


def builtin_hash_chain(key: bytes, block_bytes: int) -> list[int]:
    out: list[int] = []
    value = 0
    for start in range(0, len(key) - block_bytes + 1, block_bytes):
        value = hash((value, key[start : start + block_bytes]))
        out.append(value)
    return out


CANDIDATES: dict[str, tuple[Callable[[bytes, int], list[int]], Callable[[bytes], object]]] = {
    "crc32 (zlib) chain, 32-bit": (crc32_chain, zlib.crc32),
    "blake2b-64 + copy()": (blake2b_chain, lambda k: hashlib.blake2b(k, digest_size=8).digest()),
    "sha1 + copy(), 64 bits kept": (sha1_chain, lambda k: hashlib.sha1(k).digest()),
}
if xxhash is not None:
    CANDIDATES["xxh3-64 (xxhash) seeded chain"] = (xxh3_chain, xxhash.xxh3_64_intdigest)
# (A bytes object caches its hash: the whole-key figure hashes a fresh copy, the copy included.)
CANDIDATES["hash() [varies per process: not usable]"] = (builtin_hash_chain, lambda k: hash(k[1:]))


# ----------------------------------------------------------------------------- the bodies


@functools.cache
def corpus() -> str:
    rnd = random.Random(0)
    words = ["the", "router", "sends", "each", "leg", "to", "an", "engine", "with", "room,", "and", "KV\n", '"quoted"']
    return " ".join(rnd.choice(words) for _ in range(200_000))


def prose(size: int, seed: int) -> str:
    """``size`` characters of text, a different window of one corpus for each seed."""
    text = corpus()
    start = (seed * 4099) % (len(text) - size)
    return text[start : start + size]


def chat_body(size: int, seed: int) -> dict[str, Any]:
    """A system prompt of a sixth of ``size`` (which ``seed`` chooses) and 20 turns sharing the rest."""
    system = prose(size // 6, seed)
    turn = (size - len(system)) // 20
    messages = [{"role": "system", "content": system}]
    for i in range(20):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": prose(turn, 10**6 + i)})
    return {"model": "m", "messages": messages, "max_tokens": 64, "stream": True}


def completion_body(size: int, seed: int) -> dict[str, Any]:
    return {"model": "m", "prompt": prose(size, seed), "max_tokens": 64}


def token_body(tokens: int, seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    return {"model": "m", "prompt": [rnd.randrange(150_000) for _ in range(tokens)], "max_tokens": 64}


# ----------------------------------------------------------------------------- per request


def full_indexes(block_bytes: int, seed: int) -> list[PrefixIndex]:
    """4 indexes at capacity, filled with unrelated prompts' blocks (so a cold insert evicts)."""
    capacity = tokens_to_blocks(ENGINE_TOKENS, block_bytes)
    rnd = random.Random(seed)
    indexes = []
    for _ in range(ENGINES):
        index = PrefixIndex(capacity)
        index.insert([rnd.getrandbits(64) for _ in range(capacity)])
        indexes.append(index)
    return indexes


COLD_VARIANTS = 256  # more prompts than fit in one engine's index at any block size here: a cycle stays cold


def per_request(
    body_of: Callable[[int], dict[str, Any]], chat: bool, hasher: Callable[[bytes, int], list[int]], block_bytes: int,
    hot: bool,
) -> Callable[[], object]:
    indexes = full_indexes(block_bytes, 7)
    if hot:
        body = body_of(11)
        hashes = hasher(prompt_key(body, chat), block_bytes)
        for index in indexes:
            index.insert(hashes)
        bodies = [body]
    else:
        bodies = [body_of(1000 + i) for i in range(COLD_VARIANTS)]
    cycle = itertools.cycle(bodies)

    def request() -> object:
        body = next(cycle)
        key = prompt_key(body, chat)
        hashes = hasher(key, block_bytes)
        matched = [index.matched_blocks(hashes) for index in indexes]
        best = matched.index(max(matched))
        indexes[best].insert(hashes)
        return best

    return request


def completion_1k(seed: int) -> dict[str, Any]:
    return completion_body(1024, seed)


def completion_48k(seed: int) -> dict[str, Any]:
    return completion_body(48 * 1024, seed)


def chat_48k(seed: int) -> dict[str, Any]:
    return chat_body(48 * 1024, seed)


BODIES: tuple[tuple[Callable[[int], dict[str, Any]], bool], ...] = (
    (completion_1k, False), (completion_48k, False), (chat_48k, True),
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--block-sizes", default="512,1024,2048,4096")
    args = parser.parse_args()
    seconds = args.seconds
    sizes = [int(s) for s in args.block_sizes.split(",")]
    key1k = prose(1024, 1).encode()
    key48k = prose(48 * 1024, 2).encode()

    print(f"module: BLOCK_BYTES={prefix.BLOCK_BYTES}, xxhash {'installed' if xxhash else 'not installed'}")
    print("\n1. chained block hashing: CPU µs per key (whole-key hash of 48 KB in one call for scale)")
    header = f"{'hash':42s} {'48K whole':>9s}" + "".join(f" {f'{b}B:1K':>9s} {f'{b}B:48K':>9s}" for b in sizes)
    print(header)
    for name, (chain, whole) in CANDIDATES.items():
        row = f"{name:42s} {cpu_us(lambda: whole(key48k), seconds):9.2f}"
        for block in sizes:
            row += f" {cpu_us(lambda: chain(key1k, block), seconds):9.2f}"
            row += f" {cpu_us(lambda: chain(key48k, block), seconds):9.2f}"
        print(row)

    print("\n2. prompt_key: CPU µs per body (for scale: the core's own JSON work on it, wire.loads + 2 x wire.dumps)")
    keys = {
        "completion, 1 KB string": (completion_body(1024, 3), False),
        "completion, 48 KB string": (completion_body(48 * 1024, 4), False),
        "chat, 1 KB (1 message)": ({"messages": [{"role": "user", "content": prose(1024, 5)}]}, True),
        "chat, 48 KB (21 messages)": (chat_body(48 * 1024, 6), True),
        "completion, 12k token IDs (48 KB)": (token_body(12 * 1024, 7), False),
    }
    for name, (body, chat) in keys.items():
        raw = wire.dumps(body)
        json_us = cpu_us(lambda: (wire.dumps(wire.loads(raw)), wire.dumps(body)), seconds)
        print(f"{name:42s} {cpu_us(lambda: prompt_key(body, chat), seconds):9.2f}   key {len(prompt_key(body, chat))} B,"
              f" JSON {json_us:.1f} µs")  # fmt: skip

    print(f"\n3. per request: prompt_key + hashes + matched_blocks x{ENGINES} + insert, CPU µs")
    print(f"{'hash':42s} {'block':>6s} {'1K cold':>9s} {'1K hot':>9s} {'48K cold':>9s} {'48K hot':>9s}"
          f" {'chat48K cold':>12s} {'chat48K hot':>12s}")  # fmt: skip
    rows: list[tuple[str, Callable[[bytes, int], list[int]]]] = [("module: block_hashes", block_hashes)]
    rows += [(name, chain) for name, (chain, _) in CANDIDATES.items() if "hash()" not in name]
    for name, chain in rows:
        for block in sizes:
            if chain is block_hashes and block != prefix.BLOCK_BYTES:
                continue
            cells = []
            for body_of, chat in BODIES:
                for hot in (False, True):
                    cells.append(cpu_us(per_request(body_of, chat, chain, block, hot), seconds))
            print(f"{name:42s} {block:6d} " + " ".join(f"{c:9.2f}" if i < 4 else f"{c:12.2f}" for i, c in enumerate(cells)))


if __name__ == "__main__":
    main()
