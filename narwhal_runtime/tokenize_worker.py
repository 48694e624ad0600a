"""Tokenizing prompts off the event loop: one worker thread, the same for trio and asyncio.

Under ``routing.policy = "kv"`` the router asks for a large prompt's token
ids with a :class:`~narwhal_core.events.TokenizePrompt` command instead of
tokenizing it inside ``Router.receive`` (docs/routing.md, "Tokenizing off the
event loop"). :class:`TokenizeWorker` runs the tokenizer's
``prompt_token_ids(body, chat)`` in a thread of its own, one prompt after
another in the order asked, and hands each answer to the event loop as a
:class:`~narwhal_core.events.PromptTokenized` through the ``deliver``
callable the adapter gives it (trio: the trio token's ``run_sync_soon``;
asyncio: ``loop.call_soon_threadsafe``). An exception of the tokenizer
becomes the answer's ``problem``.

One thread, not a pool: the tokenizer releases the GIL while it encodes
(:meth:`narwhal_runtime.tokenizer.EngineTokenizer.encode`), so one thread
already runs beside the loop on the other core; more threads would compete
with the loop for the cores (benchmarks/README.md, "Tokenizing like the
engine").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Final

from narwhal_core import PromptTokenized, Router, TokenizePrompt
from narwhal_core.kv_policy import PromptTokenizer

__all__ = ["TokenizeWorker", "make_tokenize_worker", "STOP_TIMEOUT_S"]

#: How long :meth:`TokenizeWorker.close` waits for the prompt in hand (a 48 KB prompt: tens of ms).
STOP_TIMEOUT_S: Final = 5.0


class TokenizeWorker:
    """A thread that tokenizes the prompts the router asks for and hands the ids back to the loop."""

    def __init__(self, tokenizer: PromptTokenizer, *, name: str = "narwhal-tokenizer") -> None:
        #: The runtime's tokenizer (the one the router's policy holds).
        self.tokenizer = tokenizer
        self.name = name
        self._queue: queue.SimpleQueue[TokenizePrompt | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._deliver: Callable[[PromptTokenized], object] | None = None
        #: Prompts tokenized so far (answers handed over, problems included).
        self.done = 0

    @property
    def alive(self) -> bool:
        """The thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, deliver: Callable[[PromptTokenized], object]) -> None:
        """Start the thread; ``deliver`` is called from it with each answer and must hand it to the loop."""
        if self._thread is not None:
            return
        self._deliver = deliver
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def submit(self, cmd: TokenizePrompt) -> None:
        """Queue one prompt (called on the loop; returns at once)."""
        self._queue.put(cmd)

    def close(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Stop the thread once the prompt in hand is done (the ones still queued are dropped); whether it ended."""
        thread = self._thread
        if thread is None:
            return True
        while True:  # drop what is queued: the router has ended, nobody waits for those
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        thread.join(timeout)
        return not thread.is_alive()

    def _run(self) -> None:
        deliver = self._deliver
        assert deliver is not None
        while (cmd := self._queue.get()) is not None:
            answer = self.tokenize(cmd)
            self.done += 1
            try:
                deliver(answer)
            except Exception:  # noqa: BLE001 - the loop has ended (trio.RunFinishedError, a closed loop)
                return

    def tokenize(self, cmd: TokenizePrompt) -> PromptTokenized:
        """The answer to ``cmd``: its ids, or what the tokenizer raised."""
        try:
            ids = self.tokenizer.prompt_token_ids(cmd.body, cmd.chat)
        except Exception as exc:  # noqa: BLE001 - the tokenizer's problem is the request's, routed without ids
            return PromptTokenized(cmd.key, None, f"{type(exc).__name__}: {exc}")
        return PromptTokenized(cmd.key, tuple(ids), None)


def make_tokenize_worker(router: Router) -> TokenizeWorker | None:
    """The worker for ``router``'s policy, when it tokenizes prompts (``kv``); else ``None``."""
    tokenizer = router.fleet.policy.prompt_tokenizer()
    return None if tokenizer is None else TokenizeWorker(tokenizer)
