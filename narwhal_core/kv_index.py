"""What each engine really holds in its prefix cache, from its own KV events (docs/routing.md, "KV events").

The approximate index of :mod:`.prefix` guesses what an engine holds from
what Narwhal sent it; this one is told. Each engine publishes a
``BlockStored`` for every block its prefix cache gains and a
``BlockRemoved`` for every block it evicts (:mod:`.kv_events`); the
:class:`KvIndex` replays them into the set of blocks each engine holds, and
answers the one question routing asks: how many leading blocks of this
prompt does that engine hold?

**Narwhal's own hash.** An engine names its blocks with a hash of its own
(its algorithm, its seed, salted with LoRA and multimodal keys), which a
router cannot reproduce. So every block is re-hashed here from the token
ids the event carries, with a chain that depends on nothing but the
tokens: block *i*'s hash is XXH3-64 of its token ids (each a 4-byte
little-endian unsigned int) seeded with block *i - 1*'s hash, and the first
block's seed is 0 (:func:`token_block_hashes`; the same seeded chain as
:func:`.prefix.block_hashes`). A prompt's token ids hashed the same way
give the same hashes, whatever engine, version or seed. The engine's hash
of each block is kept, mapped to Narwhal's, for two things only: a
``BlockRemoved`` names blocks by the engine's hashes, and a
``BlockStored`` names its first block's parent by the engine's hash.

**A chain that cannot be placed.** When a ``BlockStored``'s parent is not
in the index (stored before the subscription began and never replayed, or
dropped by the bound below), its blocks' chain has no known beginning:
they are skipped and counted (:attr:`EngineView.unplaced`). Nothing is lost
for routing: a prompt is matched from its first block on and stops at the
first block missing, so blocks whose parent is unknown could never be
counted anyway.

**Bounded.** Each engine's entries are bounded by ``max_blocks`` (its KV
capacity in blocks: ``routing.kv_capacity_tokens`` or what the engine
reports, over ``routing.kv_block_size``). An engine cannot hold more; more
entries than that mean removals were missed, and the oldest stored entries
go first. Losing an entry only makes an engine look as if it held less
than it does (a miss, never a wrong hit).

**Trust.** An engine's entries are used only while its stream can be
trusted (:meth:`KvIndex.usable`); otherwise routing falls back to the
approximate index. They are dropped on ``AllBlocksCleared``, when the
engine leaves the fleet (:meth:`KvIndex.drop`), at once when a replay
failed (a hole nothing will fill), and when the stream has been lost for
``routing.kv_events_stale_s``. A stream silent that long while prefills
were sent there is not trusted either, but its entries are kept: the
events that come next are in order (the stream shows any gap and replays
it), so the entries are right again as soon as it speaks.

**Speculation.** A prefill just sent will be stored by the engine within
moments, before its events arrive: :meth:`KvIndex.sent` can hold its blocks
as speculative entries, each expiring ``routing.kv_speculative_ttl_s``
later unless an event stores it first.

Everything is pure: the time is passed in as ``now``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice, repeat, takewhile
from typing import Final

from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from .prefix import block_hashes, pack_token_ids

__all__ = ["KvIndex", "EngineView", "token_block_hashes", "INDEXED_MEDIA", "REPLAY_FAILED"]

#: The storage tiers whose blocks are indexed: the engine's GPU (``None``: a vLLM that does not say).
#: A block offloaded to a lower tier costs a load, not nothing; it counts as not held.
INDEXED_MEDIA: Final = frozenset({None, "GPU"})
#: The reason of a lost stream whose hole no replay will fill (:class:`~.events.KvStreamChanged`).
REPLAY_FAILED: Final = "replay_failed"

def token_block_hashes(token_ids: Sequence[int], block_size: int, seed: int = 0) -> list[int]:
    """Narwhal's chained hashes of the FULL blocks of ``token_ids`` (a partial last block has none).

    ``hashes[i]`` is XXH3-64 of block ``i``'s token ids, 4-byte
    little-endian each, seeded with ``hashes[i - 1]`` (``seed`` for the
    first: 0 for a prompt's first block, the parent's hash for a chain
    that continues one). Ids outside 0..2**32-1 keep their low 32 bits.
    The same chain as the prefix index's (:func:`~.prefix.block_hashes`
    over :func:`~.prefix.pack_token_ids`).
    """
    count = len(token_ids) // block_size
    if count == 0:
        return []
    packed = pack_token_ids(token_ids[: count * block_size])
    if packed is None:
        raise TypeError("token ids must be integers")
    return block_hashes(packed, block_size * 4, seed)


def _heard(view: EngineView) -> bool:
    """The engine's stream was heard from: live and trusted again; whether it was not already."""
    changed = view.live is not True or view.silent
    view.live = True
    view.stale = view.silent = False
    view.awaiting_since = None
    return changed


class EngineView:
    """One engine's entries and the state of its event stream."""

    __slots__ = (
        "by_engine", "held", "speculative", "max_blocks", "live", "lost_at", "awaiting_since", "stale", "silent",
        "unplaced", "overflowed", "problem",
    )

    def __init__(self, max_blocks: int) -> None:
        #: The engine's hash of each block held -> Narwhal's, oldest stored first.
        self.by_engine: Final[OrderedDict[int, int]] = OrderedDict()
        #: Narwhal's hash of each block held -> how many of the engine's blocks have it.
        self.held: Final[dict[int, int]] = {}
        #: Blocks of prefills just sent, not yet stored by an event -> when they expire, soonest first.
        self.speculative: Final[dict[int, float]] = {}
        self.max_blocks = max_blocks
        #: ``None``: never heard from; ``True``: its stream is live; ``False``: lost at :attr:`lost_at`.
        self.live: bool | None = None
        self.lost_at = 0.0
        #: When the first prefill sent there since its last event was sent (``None``: none since).
        self.awaiting_since: float | None = None
        #: Its entries were dropped as stale: it falls back until its stream is heard from again.
        self.stale = False
        #: Silent too long while prefills were sent there: it falls back until its next event.
        self.silent = False
        #: Blocks stored whose chain could not be placed, and entries dropped by the bound, since start.
        self.unplaced = 0
        self.overflowed = 0
        #: Why some of its events could not be used (reported once).
        self.problem: str | None = None

    def clear(self) -> None:
        """Forget every entry (the stream's state stays)."""
        self.by_engine.clear()
        self.held.clear()
        self.speculative.clear()


class KvIndex:
    """Every engine's blocks, by URL, from its KV events (see the module docstring)."""

    __slots__ = ("block_size", "stale_s", "speculative_ttl_s", "max_blocks", "engines", "version", "changes")

    def __init__(self, block_size: int, *, stale_s: float, speculative_ttl_s: float, max_blocks: int) -> None:
        if block_size < 1 or max_blocks < 0:
            raise ValueError(f"block_size must be at least 1 and max_blocks at least 0: {block_size}, {max_blocks}")
        #: Tokens per block: the engines' ``--block-size`` (``routing.kv_block_size``).
        self.block_size: Final = block_size
        self.stale_s: Final = stale_s
        #: 0: no speculative entries.
        self.speculative_ttl_s: Final = speculative_ttl_s
        #: Each engine's bound until it reports its capacity (:meth:`resize`).
        self.max_blocks: Final = max_blocks
        self.engines: Final[dict[str, EngineView]] = {}
        #: Counts the changes to any engine's entries or state: equal counts, equal answers (at one ``now``).
        self.version = 0
        #: Engines whose trust changed without a word from their stream, for the log, oldest first:
        #: (URL, ``"lost"`` / ``"silent"``: it fell back; ``"events"``: it is trusted again).
        self.changes: Final[list[tuple[str, str]]] = []

    def view(self, url: str) -> EngineView:
        """``url``'s entries, made empty the first time."""
        view = self.engines.get(url)
        if view is None:
            view = self.engines[url] = EngineView(self.max_blocks)
        return view

    # ------------------------------------------------------------------ events

    def apply(self, url: str, events: Iterable[KvEvent], now: float) -> str | None:
        """``url``'s events, in order: its stream is heard from (live). Returns a new problem, once."""
        view = self.view(url)
        self.version += 1
        if _heard(view):
            self.changes.append((url, "events"))  # trusted again (or for the first time) without a word
        problem = None
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                assert isinstance(event, BlockStored)
                found = self._stored(view, event)
                if found is not None and view.problem is None:
                    view.problem = problem = found
            elif kind is BlockRemoved:
                assert isinstance(event, BlockRemoved)
                if event.medium in INDEXED_MEDIA and not event.group_idx:
                    self._removed(view, event.block_hashes)
            elif kind is AllBlocksCleared:
                view.clear()
        return problem

    def _stored(self, view: EngineView, event: BlockStored) -> str | None:
        if event.medium not in INDEXED_MEDIA or event.group_idx:
            return None  # another tier or KV-cache group: not what a prefill reuses as is
        hashes = event.block_hashes
        if event.block_size != self.block_size:
            view.unplaced += len(hashes)
            return f"block_size {event.block_size}, not routing.kv_block_size {self.block_size}"
        if len(event.token_ids) != event.block_size * len(hashes):
            view.unplaced += len(hashes)
            return f"BlockStored with {len(event.token_ids)} tokens for {len(hashes)} blocks of {event.block_size}"
        parent = event.parent_block_hash
        seed = 0
        if parent is not None:
            known = view.by_engine.get(parent)
            if known is None:
                view.unplaced += len(hashes)
                return None
            seed = known
        ours = token_block_hashes(event.token_ids, self.block_size, seed)
        by_engine, held, speculative = view.by_engine, view.held, view.speculative
        if speculative:
            deque(map(speculative.pop, ours, repeat(None)), 0)  # confirmed: held now (the loop in C)
        before = len(by_engine), len(held)
        if by_engine.keys().isdisjoint(hashes) and held.keys().isdisjoint(ours):
            # The usual event: blocks new on both sides, stored in C.
            by_engine.update(zip(hashes, ours))
            held.update(zip(ours, repeat(1)))
            if len(by_engine) - before[0] == len(held) - before[1] == len(hashes):
                return self._bound(view)
            # (A hash twice in one event: undo, and store them one by one.)
            for theirs in hashes:
                by_engine.pop(theirs, None)
            for mine in ours:
                held.pop(mine, None)
        for theirs, mine in zip(hashes, ours):
            old = by_engine.get(theirs)
            if old is not None:
                by_engine.move_to_end(theirs)
                if old == mine:
                    continue
                _release(held, old)
            by_engine[theirs] = mine
            held[mine] = held.get(mine, 0) + 1
        return self._bound(view)

    @staticmethod
    def _bound(view: EngineView) -> None:
        """Past its bound, the engine's oldest stored entries go."""
        by_engine, held = view.by_engine, view.held
        over = len(by_engine) - view.max_blocks
        if over > 0:
            view.overflowed += over
            popitem = by_engine.popitem
            for _ in range(over):
                _release(held, popitem(False)[1])

    @staticmethod
    def _removed(view: EngineView, hashes: Iterable[int]) -> None:
        by_engine, held = view.by_engine, view.held
        for theirs in hashes:
            mine = by_engine.pop(theirs, None)
            if mine is not None:
                _release(held, mine)

    def stream(self, url: str, live: bool, reason: str, now: float) -> bool:
        """``url``'s stream came up or went down; whether that changed what is known of it.

        Lost, its entries are kept (a reconnection's replay fills the gap)
        until :attr:`stale_s` has passed, except after a failed replay:
        then the hole will never be filled, and they are dropped at once.
        """
        view = self.view(url)
        self.version += 1
        if live:
            return _heard(view)
        if reason == REPLAY_FAILED or view.live is None:
            # A hole nothing will fill, or nothing heard yet: nothing to trust until it is heard from.
            view.clear()
            view.stale = True
        if view.live is False:
            return False
        view.live = False
        view.lost_at = now
        return True

    # ----------------------------------------------------------------- routing

    def usable(self, url: str, now: float) -> bool:
        """Whether routing may trust ``url``'s entries now (else: the approximate index).

        Not before its stream is first heard from; not once it has been
        lost for :attr:`stale_s` (then its entries are dropped, until it is
        heard from again); not while it has been silent that long though
        prefills were sent there (until its next event).
        """
        view = self.engines.get(url)
        return view is not None and self._usable(url, view, now)

    def _usable(self, url: str, view: EngineView, now: float) -> bool:
        if view.live is None or view.stale or view.silent:
            return False
        if view.live is False:
            if now - view.lost_at < self.stale_s:
                return True  # a reconnection's replay may yet fill the gap
            self.version += 1
            view.stale = True
            view.clear()
            self.changes.append((url, "lost"))
            return False
        since = view.awaiting_since
        if since is not None and now - since >= self.stale_s:
            self.version += 1
            view.silent = True
            self.changes.append((url, "silent"))
            return False
        return True

    def matched_blocks(self, url: str, hashes: Sequence[int], now: float) -> int | None:
        """How many LEADING blocks of ``hashes`` (:func:`token_block_hashes`) ``url`` holds; ``None``: not known.

        One pass, stopping at the first block missing (a block counts if
        held, or speculative and not expired); the loops run in C.
        """
        view = self.engines.get(url)
        if view is None or not self._usable(url, view, now):
            return None
        held = view.held
        speculative = view.speculative
        if not hashes or (hashes[0] not in held and hashes[0] not in speculative):
            return 0  # the usual miss, in one lookup
        # Runs of held blocks and of speculative ones, each found in C, until neither goes on.
        count = 0
        while True:
            start = count
            count += len(list(takewhile(held.__contains__, islice(hashes, count, None))))
            if speculative:
                run = list(takewhile(speculative.__contains__, islice(hashes, count, None)))
                if run and min(map(speculative.__getitem__, run)) <= now:
                    run = run[: next(i for i, value in enumerate(run) if speculative[value] <= now)]
                count += len(run)
            if count == start:
                return count

    def sent(self, url: str, hashes: Sequence[int], now: float) -> None:
        """A prefill of ``hashes`` was sent to ``url``: its events should follow; hold its blocks speculatively."""
        view = self.view(url)
        self.version += 1
        if view.awaiting_since is None:
            view.awaiting_since = now
        ttl = self.speculative_ttl_s
        if ttl <= 0 or not hashes:
            return
        speculative = view.speculative
        if speculative and next(iter(speculative.values())) <= now:
            _expire(speculative, now)
        speculative.update(zip(hashes, repeat(now + ttl)))  # (in C: a prompt's every block, held or not)
        over = len(speculative) - view.max_blocks
        for value in list(speculative)[:over] if over > 0 else ():
            del speculative[value]  # the first inserted

    # ------------------------------------------------------------- the fleet

    def forget_speculation(self, url: str) -> None:
        """``url`` left rotation: the prefills sent there may never be stored."""
        view = self.engines.get(url)
        self.version += 1
        if view is not None:
            view.speculative.clear()
            view.awaiting_since = None

    def drop(self, url: str) -> None:
        """``url`` left the fleet: keep nothing of it."""
        self.engines.pop(url, None)
        self.version += 1

    def resize(self, url: str, max_blocks: int) -> None:
        """``url`` reported its capacity: its bound from now on (a smaller one drops the oldest entries)."""
        view = self.view(url)
        self.version += 1
        view.max_blocks = max(0, max_blocks)
        self._bound(view)

    def blocks(self, url: str) -> frozenset[int]:
        """Narwhal's hashes of the blocks ``url`` holds (not speculative ones), for tests and introspection."""
        view = self.engines.get(url)
        return frozenset() if view is None else frozenset(view.held)


def _release(held: dict[int, int], value: int) -> None:
    left = held[value] - 1
    if left:
        held[value] = left
    else:
        del held[value]


def _expire(speculative: dict[int, float], now: float) -> None:
    """Drop the speculative entries expired by ``now`` (a query ignores them anyway: this bounds the memory)."""
    live = [(value, until) for value, until in speculative.items() if until > now]
    speculative.clear()
    speculative.update(live)
