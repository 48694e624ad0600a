"""Routing policy ``kv``: the prefix policy's cost model, fed with what the engines say they hold.

(docs/routing.md, "KV events"; docs/configure.md, ``[routing]``.)

:class:`KvEventsPolicy` is :class:`~narwhal_core.routing.Prefix` with a second, precise
index: a prefill engine's expected time to first token is still (its queued
prompt tokens + the prompt's tokens it does not hold), but the tokens it
holds come from its own KV events (:class:`~narwhal_core.kv_index.KvIndex`)
while its event stream is live. An engine whose stream is not live (never
heard from, or lost or silent past ``routing.kv_events_stale_s``) is
weighed from the approximate index exactly as ``prefix`` weighs it; that
index is fed as under ``prefix`` all along, so it is ready when needed.

The precise index is keyed by token ids, which only a tokenizer gives: the
core never loads one, the runtime passes a :class:`PromptTokenizer` in
(``Router(..., tokenizer=...)``). A request the tokenizer cannot render is
weighed from the approximate index on every engine.

**Tokenizing only what can hit.** Tokenizing a large prompt as the engine
does costs about a microsecond a token (tens of milliseconds for a long
one, benchmarks/README.md), and most prompts share no block with anything
an engine holds. A tokenizer that can encode a prompt's head
(:meth:`PromptTokenizer.head_token_ids`) is asked first, on the loop, for
the first :data:`HEAD_CHARS_PER_BLOCK` x ``block_size`` characters. The
precise index counts an engine's leading blocks up to the first one it
lacks: when every candidate whose events are trusted lacks one of the
head's blocks, each one's answer is known from the head alone, whatever
the rest of the prompt is, so the request is weighed at once without the
whole prompt's ids (the head's blocks are what a speculative entry then
holds). Only when some engine holds the whole head is the whole prompt
tokenized (off the loop). The head's last block is not used: the tokens
near the cut may differ from the whole prompt's.

What the head look found is a value, :class:`HeadProbe`, that the caller
hands to the plan of the same prompt (``Routing.plan(..., probe=...)``):
the head's blocks, and each candidate's answer from the precise index,
which the weighing then reads instead of asking the index again. The
policy keeps nothing of one request for the next call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol

import attrs

from .contract import CHAT
from .kv_index import KvIndex, token_block_hashes
from .policies import APPROXIMATE, Clock, Plan, Policy, Prefix, StoppedClock

if TYPE_CHECKING:
    from .config import RoutingConfig
    from .contract import Route
    from .events import PromptTokenized
    from .fleet import EngineState
    from .kv_events import KvEvent

__all__ = ["PromptTokenizer", "HeadProbe", "KvKey", "KvEventsPolicy", "PRECISE", "HEAD_CHARS_PER_BLOCK"]

#: The journal's name of the precise index (docs/operate.md, "The journal").
PRECISE: Final = "kv"
#: Characters of a prompt's head tokenized per token of a block, to see whether any engine holds its first
#: block (module docstring): 64 x 16 = 1,024 characters, some 250 tokens of English: many blocks.
HEAD_CHARS_PER_BLOCK: Final = 64


class PromptTokenizer(Protocol):
    """What the router needs of a tokenizer: the token ids the ENGINE computes for a request's prompt.

    Completions: the ``prompt`` (one string, or one list of token ids,
    returned as is). Chat: the ``messages`` and ``tools`` rendered by the
    model's chat template, then tokenized. It may raise for a body it
    cannot render: the request is then weighed without it.
    """

    def prompt_token_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The prompt's token ids (``chat``: the body came on ``/v1/chat/completions``)."""
        ...

    # Optional (a tokenizer without it has every large prompt tokenized whole):
    # def head_token_ids(self, body: dict[str, Any], chat: bool, chars: int) -> list[int] | None:
    #     """The ids of the prompt's text cut after ``chars`` characters (``None``: no head, e.g. truncation)."""


@attrs.frozen
class HeadProbe:
    """What a large prompt's head told :meth:`KvEventsPolicy.probe_head`, when it settles how the prompt is weighed.

    (Module docstring, "Tokenizing only what can hit".) Every candidate
    whose events are trusted lacks one of the head's blocks, so the head's
    blocks stand for the whole prompt's. The caller passes it to the plan
    of the same prompt (``Routing.plan``/``replan``, ``probe=``), at the
    same instant: the answers are those of the index at :attr:`now` and
    :attr:`version`, and a plan made later asks the index again.
    """

    #: Narwhal's chained hashes of the head's blocks, but its last (the tokens near the cut).
    hashes: tuple[int, ...]
    #: Each candidate asked, by URL, and how many leading blocks of :attr:`hashes` the precise index says it
    #: holds (``None``: its events are not trusted: weighed from the approximate index).
    matched: tuple[tuple[str, int | None], ...]
    #: The instant the index was asked at, and its :attr:`~narwhal_core.kv_index.KvIndex.version` after.
    now: float
    version: int


class KvKey(list[int]):
    """A plan's hashes under ``kv``: the approximate index's (the list itself, as ``prefix`` reads them)...

    ...and, riding along, :attr:`exact`: Narwhal's chained hashes of the
    prompt's token blocks (:func:`~narwhal_core.kv_index.token_block_hashes`),
    what the precise index is asked about; and that index's answers so far
    (:meth:`KvEventsPolicy.matched_blocks`): a request is weighed, picked at admission
    and picked again at its leg's start, each time over every candidate.
    """

    __slots__ = ("exact", "matched", "asked")

    def __init__(self, approximate: Sequence[int], exact: list[int], probe: HeadProbe | None = None) -> None:
        super().__init__(approximate)
        self.exact: Final = exact
        #: The precise index's answers by engine URL (the head look's, if the key is its head's)...
        self.matched: Final[dict[str, int | None]] = {} if probe is None else dict(probe.matched)
        #: ...and the instant and index version they hold for (``None``: none yet).
        self.asked: tuple[float, int] | None = None if probe is None else (probe.now, probe.version)


class KvEventsPolicy(Prefix):
    """``kv``: least expected TTFT, the tokens each prefill engine holds told by its KV events."""

    name: ClassVar[str] = "kv"
    names_index: ClassVar[bool] = True
    tokenizes: ClassVar[bool] = True
    __slots__ = ("tokenizer", "head_ids", "index", "block_size", "clock", "log")

    def __init__(
        self, capacity_tokens: int, tokenizer: PromptTokenizer, *, block_size: int = 16, stale_s: float = 30.0,
        speculative_ttl_s: float = 2.0, clock: Clock | None = None, miss_cost: float = 1.0,
    ) -> None:  # fmt: skip
        super().__init__(capacity_tokens, miss_cost)
        self.tokenizer: Final = tokenizer
        #: The tokenizer's ``head_token_ids``, if it has one (module docstring).
        self.head_ids: Final[Callable[[dict[str, Any], bool, int], list[int] | None] | None] = getattr(
            tokenizer, "head_token_ids", None
        )
        #: Tokens per block of the precise index: the engines' ``--block-size``.
        self.block_size: Final = block_size
        self.index: Final = KvIndex(
            block_size, stale_s=stale_s, speculative_ttl_s=speculative_ttl_s,
            max_blocks=capacity_tokens // block_size,
        )
        #: Where the time of the event being handled is read (the router's context, once bound).
        self.clock: Clock = clock if clock is not None else StoppedClock()
        #: Where an engine falling back (or trusted again) is logged (the router's, once bound).
        self.log: Callable[..., None] | None = None

    def prompt_tokenizer(self) -> PromptTokenizer:
        return self.tokenizer

    @classmethod
    def from_config(cls, config: RoutingConfig, tokenizer: PromptTokenizer | None = None) -> Policy:
        if tokenizer is None:
            raise ValueError('routing.policy = "kv" needs a tokenizer (model.tokenizer)')
        return cls(
            config.kv_capacity_tokens, tokenizer, block_size=config.kv_block_size,
            stale_s=config.kv_events_stale_s, speculative_ttl_s=config.kv_speculative_ttl_s,
            miss_cost=config.miss_cost,
        )

    def bind(self, clock: Clock, log: Callable[..., None] | None = None) -> None:
        self.clock = clock
        self.log = log

    def report(self) -> None:
        """Log the engines whose trust changed with no word from their stream (found stale, or speaking again).

        ``kv_events_stale`` (warning): weighed from the approximate index
        from now on, ``reason`` ``lost`` (the stream lost for
        ``kv_events_stale_s``: what its events said is dropped) or
        ``silent`` (no event that long though prefills were sent there);
        ``kv_events_live`` with ``reason`` ``events``: its events are
        trusted again.
        """
        changes = self.index.changes
        log = self.log
        if log is not None:
            for url, why in changes:
                if why == "events":
                    log("kv_events_live", engine=url, reason=why)
                else:
                    log("kv_events_stale", level="warning", engine=url, reason=why, index="approximate",
                        stale_s=self.index.stale_s)
        changes.clear()

    def probe_head(
        self, body: dict[str, Any], route: Route, candidates: Sequence[EngineState]
    ) -> HeadProbe | None:
        """What the prompt's head settles: every trusted candidate lacks one of its blocks; ``None``: tokenize it whole.

        (Module docstring, "Tokenizing only what can hit".) ``None`` too
        when the head cannot tell: no ``head_token_ids``, the tokenizer
        raised or gave no head, a head shorter than two blocks.
        """
        head_ids = self.head_ids
        if head_ids is None:
            return None
        size = self.block_size
        try:
            ids = head_ids(body, route == CHAT, HEAD_CHARS_PER_BLOCK * size)
        except Exception:  # the whole prompt's tokenizing says the same, and the request is weighed without ids
            return None
        if ids is None:
            return None
        exact = token_block_hashes(ids[: len(ids) - size], size)  # (not the last block: tokens near the cut)
        if not exact:
            return None  # a head too short to tell
        index, now, whole = self.index, self.clock.now, len(exact)
        matched: list[tuple[str, int | None]] = []
        held = False
        for e in candidates:
            blocks = index.matched_blocks(e.url, exact, now)
            if blocks == whole:
                held = True
                break
            matched.append((e.url, blocks))
        if index.changes:
            self.report()
        if held:
            return None
        return HeadProbe(tuple(exact), tuple(matched), now, index.version)

    def key(
        self, body: dict[str, Any], route: Route, tokenized: PromptTokenized | None = None,
        probe: HeadProbe | None = None,
    ) -> tuple[Sequence[int], int]:  # fmt: skip
        """Both indexes' hashes; the token ids from ``tokenized`` if given (computed off the loop), else asked here.

        A prompt whose ``probe`` (:meth:`probe_head`) settled it keeps its
        head's blocks, with the answers the index gave for them, and the
        approximate token count.
        """
        hashes, tokens = Prefix.key(self, body, route)
        if tokenized is None and probe is not None:
            return KvKey(hashes, list(probe.hashes), probe), tokens
        ids: Sequence[int] | None
        if tokenized is not None:
            ids = tokenized.token_ids  # None: the tokenizer raised in the worker
        else:
            try:
                ids = self.tokenizer.prompt_token_ids(body, route == CHAT)
            except Exception:  # the tokenizer is the runtime's: whatever it raises, weigh without it
                ids = None
        if ids is None:
            return hashes, tokens
        return KvKey(hashes, token_block_hashes(ids, self.block_size)), len(ids) or 1

    def uncached(self, engine: EngineState, plan: Plan) -> int:
        hashes = plan.hashes
        if type(hashes) is KvKey:
            matched = self.matched_blocks(engine.url, hashes)
            if matched is not None:
                return max(0, plan.tokens - matched * self.block_size)
        return Prefix.uncached(self, engine, plan)

    def matched_blocks(self, url: str, hashes: KvKey) -> int | None:
        """The precise index's answer for ``hashes`` on ``url``, asked once per key, instant and index state.

        The answers are kept on the key (:attr:`KvKey.matched`), so the
        policy holds nothing of one request between calls.
        """
        index = self.index
        now = self.clock.now
        memo = hashes.matched
        asked = (now, index.version)
        if asked != hashes.asked:
            memo.clear()
            hashes.asked = asked
        elif url in memo:
            return memo[url]
        matched = memo[url] = index.matched_blocks(url, hashes.exact, now)
        if index.version != asked[1]:  # the question itself changed the index (an engine found stale)
            memo.clear()
            hashes.asked = (now, index.version)
            self.report()
        return matched

    def index_name(self, engine: EngineState, plan: Plan) -> str:
        """Which index weighs ``plan`` on ``engine`` now: :data:`PRECISE` or the approximate one."""
        usable = type(plan.hashes) is KvKey and self.index.usable(engine.url, self.clock.now)
        if self.index.changes:
            self.report()
        return PRECISE if usable else APPROXIMATE

    def sent(self, engine: EngineState, plan: Plan) -> None:
        Prefix.sent(self, engine, plan)
        hashes = plan.hashes
        if type(hashes) is KvKey:
            self.index.sent(engine.url, hashes.exact, self.clock.now)

    def forget(self, engine: EngineState) -> None:
        Prefix.forget(self, engine)
        self.index.forget_speculation(engine.url)

    def drop(self, engine: EngineState) -> None:
        Prefix.drop(self, engine)
        self.index.drop(engine.url)

    def capacity(self, engine: EngineState, tokens: int) -> None:
        Prefix.capacity(self, engine, tokens)
        self.index.resize(engine.url, tokens // self.block_size)

    def kv_events(self, url: str, events: Sequence[KvEvent], now: float) -> str | None:
        problem = self.index.apply(url, events, now)
        if self.index.changes:
            self.report()
        return problem

    def kv_stream(self, url: str, live: bool, reason: str, now: float) -> bool:
        return self.index.stream(url, live, reason, now)

    def kv_live(self, urls: Sequence[str], now: float) -> dict[str, bool]:
        live = {url: self.index.usable(url, now) for url in urls}
        if self.index.changes:
            self.report()  # (asking found an engine stale: its log line goes out now, not at its next request)
        return live

    def kv_stale_due(self, url: str, now: float) -> None:
        self.index.usable(url, now)
        self.report()
