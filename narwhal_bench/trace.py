"""Workloads for ``narwhal bench``: Mooncake traces, a session generator, and their prompts.

Pure: no I/O but reading the trace file you name, no clock, no global
randomness (the generator draws from its own seeded ``random.Random``).

A workload is a list of :class:`TraceRequest` — arrival time, prompt length,
output length and the prompt's blocks of :data:`BLOCK_TOKENS` tokens, named by
integer ids as in the Mooncake trace format (``docs/bench.md``). Two requests
whose leading ids are equal share that prefix. :class:`PromptSynth` turns the
ids into prompts: every id always becomes the same text (or the same token
ids), so shared ids are shared prefixes for any engine's prefix cache.

Text prompts use the simulator's token approximation (``docs/simulator.md``:
one token per 4 characters), so a block of 512 tokens is 2,048 characters and
a prompt of ``input_length`` tokens is ``4 * input_length`` characters.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

__all__ = [
    "BLOCK_TOKENS",
    "CHARS_PER_TOKEN",
    "TraceError",
    "TraceRequest",
    "load_mooncake",
    "parse_mooncake_lines",
    "SessionWorkload",
    "generate_sessions",
    "scale_arrivals",
    "limit",
    "PromptSynth",
]

#: Tokens per block of a Mooncake trace's ``hash_ids``.
BLOCK_TOKENS = 512
#: The simulator's documented approximation (docs/simulator.md).
CHARS_PER_TOKEN = 4


class TraceError(ValueError):
    """A trace line or generator setting that cannot be used; the message names it."""


@attrs.frozen(kw_only=True)
class TraceRequest:
    """One request of a workload."""

    #: Position in the workload (0-based), stable across runs.
    index: int
    #: Seconds from the start of the run at which the request is sent.
    arrival_s: float
    #: Prompt tokens.
    input_length: int
    #: Tokens to generate (``max_tokens``; the run asks the engine to ignore EOS).
    output_length: int
    #: The prompt's blocks of ``BLOCK_TOKENS`` tokens; the last one may be partial.
    hash_ids: tuple[int, ...]
    #: Session of a generated workload (``None`` for a trace).
    session: int | None = None


def parse_mooncake_lines(lines: Iterable[str], *, source: str = "trace") -> list[TraceRequest]:
    """Parse Mooncake JSON lines (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``)."""
    out: list[TraceRequest] = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        where = f"{source}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(data, dict):
            raise TraceError(f"{where}: a line must be a JSON object")
        ts, n_in, n_out, ids = (data.get(k) for k in ("timestamp", "input_length", "output_length", "hash_ids"))
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
            raise TraceError(f"{where}: timestamp must be a number of milliseconds >= 0")
        for name, value in (("input_length", n_in), ("output_length", n_out)):
            if type(value) is not int or value < 1:
                raise TraceError(f"{where}: {name} must be an integer >= 1")
        if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
            raise TraceError(f"{where}: hash_ids must be a non-empty list of integers")
        n_in_ok: int = n_in  # type: ignore[assignment]  # checked above
        n_out_ok: int = n_out  # type: ignore[assignment]
        if n_in_ok > BLOCK_TOKENS * len(ids):
            raise TraceError(
                f"{where}: input_length {n_in} needs more than its {len(ids)} blocks of {BLOCK_TOKENS} tokens"
            )
        out.append(
            TraceRequest(index=len(out), arrival_s=ts / 1000.0, input_length=n_in_ok, output_length=n_out_ok,
                         hash_ids=tuple(ids))  # fmt: skip
        )
    out.sort(key=lambda r: (r.arrival_s, r.index))
    return [attrs.evolve(r, index=i) for i, r in enumerate(out)]


def load_mooncake(path: str) -> list[TraceRequest]:
    """Read a Mooncake-format trace file."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_mooncake_lines(f, source=path)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None


@attrs.frozen(kw_only=True)
class SessionWorkload:
    """The built-in generator: chat sessions with shared system prompts and growing histories.

    Sessions start as a Poisson process (``session_rate`` per second). Each
    picks one of ``system_prompts`` shared system prompts and runs ``turns``
    turns; turn ``k + 1`` is sent an exponential think time (mean
    ``think_s``) after turn ``k`` was sent (open loop: it does not wait for
    the answer). A turn's prompt is the session's whole history — system
    prompt, earlier user messages and answers — plus a new user message, so
    consecutive turns share ever longer prefixes.
    """

    sessions: int = 50
    turns: int = 4
    system_prompts: int = 4
    system_tokens: int = 2048
    user_tokens: int = 256
    output_tokens: int = 128
    session_rate: float = 1.0
    think_s: float = 5.0
    seed: int = 0

    def check(self) -> None:
        for name in ("sessions", "turns", "system_prompts", "system_tokens", "user_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise TraceError(f"{name} must be >= 1")
        if not self.session_rate > 0 or self.think_s < 0:
            raise TraceError("session_rate must be > 0 and think_s >= 0")


def generate_sessions(spec: SessionWorkload) -> list[TraceRequest]:
    """The requests of ``spec``, sorted by arrival; the same spec gives the same list."""
    spec.check()
    rng = random.Random(spec.seed)
    # Block ids: system prompts take the low ids, each session's own blocks follow.
    sys_blocks = math.ceil(spec.system_tokens / BLOCK_TOKENS)
    next_id = spec.system_prompts * sys_blocks
    pending: list[tuple[float, int, int, int, int, tuple[int, ...]]] = []
    start = 0.0
    for session in range(spec.sessions):
        start += rng.expovariate(spec.session_rate)
        system = rng.randrange(spec.system_prompts)
        # The session's history as a token count laid over a growing list of blocks.
        # The system prompt fills whole blocks (rounded up); the session's own
        # messages start at the next block boundary.
        ids = [system * sys_blocks + b for b in range(sys_blocks)]
        tokens = len(ids) * BLOCK_TOKENS
        at = start
        for turn in range(spec.turns):
            if turn:
                at += rng.expovariate(1.0 / spec.think_s) if spec.think_s > 0 else 0.0
            user = max(1, int(rng.expovariate(1.0 / spec.user_tokens)))
            out = max(1, int(rng.expovariate(1.0 / spec.output_tokens)))
            tokens += user
            while len(ids) * BLOCK_TOKENS < tokens:
                ids.append(next_id)
                next_id += 1
            pending.append((at, session, turn, tokens, out, tuple(ids)))
            tokens += out  # the answer joins the history of the next turn
    pending.sort(key=lambda p: (p[0], p[1], p[2]))
    return [
        TraceRequest(index=i, arrival_s=at, input_length=n_in, output_length=n_out, hash_ids=ids, session=session)
        for i, (at, session, _turn, n_in, n_out, ids) in enumerate(pending)
    ]


def scale_arrivals(requests: Sequence[TraceRequest], *, time_scale: float = 1.0,
                   rate_scale: float = 1.0) -> list[TraceRequest]:  # fmt: skip
    """Arrivals multiplied by ``time_scale`` and divided by ``rate_scale``, shifted to start at 0."""
    if not time_scale > 0 or not rate_scale > 0:
        raise TraceError("time scale and request-rate scale must be > 0")
    factor = time_scale / rate_scale
    first = min((r.arrival_s for r in requests), default=0.0)
    return [attrs.evolve(r, arrival_s=(r.arrival_s - first) * factor) for r in requests]


def limit(requests: Sequence[TraceRequest], *, max_requests: int | None = None,
          duration_s: float | None = None) -> list[TraceRequest]:  # fmt: skip
    """The first ``max_requests`` requests arriving before ``duration_s`` (either may be ``None``)."""
    out = list(requests)
    if duration_s is not None:
        out = [r for r in out if r.arrival_s < duration_s]
    if max_requests is not None:
        out = out[:max_requests]
    return out


# Byte to character: lower-case letters, and a space one time in six (word-like runs).
_LETTERS = bytes((b" " if b % 6 == 0 else b"abcdefghijklmnopqrstuvwxyz"[b % 26 : b % 26 + 1])[0] for b in range(256))


class PromptSynth:
    """Block ids to prompts: each id is always the same ~512-token text (or token ids).

    Text: block ``i`` is exactly ``BLOCK_TOKENS * CHARS_PER_TOKEN`` characters
    (2,048), ``"[block i] "`` followed by letters and spaces, one per byte
    of a SHAKE-128 stream of ``(seed, i)``; a prompt is its blocks' texts joined,
    cut to ``CHARS_PER_TOKEN * input_length`` characters. Token ids: block
    ``i`` is ``BLOCK_TOKENS`` ids in ``[100, 100 + vocab)`` from the same
    stream, the prompt cut to ``input_length`` ids. Blocks are remembered
    (``cache_blocks`` of them, oldest dropped first).
    """

    def __init__(self, *, seed: int = 0, token_ids: bool = False, vocab: int = 32000,
                 cache_blocks: int = 65536) -> None:  # fmt: skip
        self.seed = seed
        self.token_ids = token_ids
        self.vocab = vocab
        self._cache: dict[int, Any] = {}
        self._cache_blocks = cache_blocks

    def block_text(self, block_id: int) -> str:
        text = self._cache.get(block_id)
        if text is None:
            width = BLOCK_TOKENS * CHARS_PER_TOKEN
            head = f"[block {block_id}] ".encode()
            stream = hashlib.shake_128(f"narwhal-bench:{self.seed}:{block_id}".encode()).digest(width - len(head))
            text = (head + stream.translate(_LETTERS)).decode("ascii")
            self._remember(block_id, text)
        return text  # type: ignore[no-any-return]

    def block_ids(self, block_id: int) -> list[int]:
        ids = self._cache.get(block_id)
        if ids is None:
            stream = hashlib.shake_128(f"narwhal-bench-ids:{self.seed}:{block_id}".encode()).digest(BLOCK_TOKENS * 2)
            ids = [100 + (stream[2 * k] << 8 | stream[2 * k + 1]) % self.vocab for k in range(BLOCK_TOKENS)]
            self._remember(block_id, ids)
        return ids  # type: ignore[no-any-return]

    def _remember(self, key: int, value: Any) -> None:
        if len(self._cache) >= self._cache_blocks:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = value

    def prompt(self, request: TraceRequest) -> str | list[int]:
        """The prompt of ``request``: a string, or a list of token ids with ``token_ids=True``."""
        if self.token_ids:
            ids: list[int] = []
            for block in request.hash_ids:
                ids.extend(self.block_ids(block))
            return ids[: request.input_length]
        text = "".join(self.block_text(block) for block in request.hash_ids)
        return text[: request.input_length * CHARS_PER_TOKEN]
