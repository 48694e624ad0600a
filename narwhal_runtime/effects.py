"""The driver's effects on both runtimes: one object per server, built once (:class:`ServingEffects`).

:meth:`~.driver.Driver.flush` performs a batch through it
(:class:`~.driver.Effects`): the journal write (and the span exporter's copy
of the records), the process-log lines, the fleet's changes, prompts to
the tokenizer thread, the client writes. The engine commands go to
:attr:`ServingEffects.engines`, the server's engine connections, once it
serves. Nothing here depends on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from narwhal_core import Config, Event, FleetChanged, PromptTokenized, TokenizePrompt
from narwhal_core.ids import PREFILL

from .client_connections import ClientConnection
from .journal_writer import JournalWriter
from .kv_subscriber import KvSubscriber, kv_sources
from .leg_connections import Engines
from .log import log_event
from .tokenize_worker import TokenizeWorker

__all__ = ["ServingEffects"]


class ServingEffects:
    """The I/O of one server's batches (:class:`~.driver.Effects`), the same on trio and asyncio."""

    def __init__(self, config: Config, journal: JournalWriter, *, tracer: Any, kv_subscriber: KvSubscriber | None,
                 tokenize_worker: TokenizeWorker | None, feed_now: Callable[[Event], None]) -> None:
        """``feed_now`` is the adapter's feed for events from no socket (a prompt no thread will tokenize)."""
        self.config = config
        self.journal = journal
        #: The span exporter ([tracing] endpoint; docs/operate.md, "Tracing"), ``None`` when off or closed.
        self.tracer = tracer
        self.kv_subscriber = kv_subscriber
        self.tokenize_worker = tokenize_worker
        self._feed_now = feed_now
        #: Where leg and control commands go: the server's engine connections, set once it serves.
        self.engines: Engines | None = None
        # The two effects of every request are fields chosen here, not methods: each
        # is the callee itself, so a batch costs no interpreted call more for them
        # (a method would add three per request: benchmarks/README.md, "Instructions
        # per request").
        #: Append the batch's records in one write; whether the journal is healthy.
        self.write_journal: Callable[[list[bytes]], bool] = (
            journal.write_lines if tracer is None else self._write_and_export)
        #: Send ``data`` to client ``conn`` (the router's handle is the connection), then close it if ``close``.
        self.send: Callable[[ClientConnection, bytes, bool], None] = ClientConnection.send

    def _write_and_export(self, lines: list[bytes]) -> bool:
        # With [tracing]: the exporter takes a copy of the records (until it is closed).
        ok = self.journal.write_lines(lines)
        if self.tracer is not None:
            self.tracer.take(lines)
        return ok

    def journal_error(self) -> str | None:
        """Why the journal is not healthy."""
        return self.journal.error

    def log(self, event: str, fields: dict[str, Any]) -> None:
        """One process-log line."""
        log_event(event, **fields)

    def fleet_changed(self, cmd: FleetChanged) -> None:
        """An engine joined or was forgotten: the KV-event subscriber follows the prefill engines now.

        Only prefill engines' streams are read: a prefill leg is placed by
        what an engine holds, decode legs go by load (docs/routing.md).
        """
        if cmd.phase == PREFILL and self.kv_subscriber is not None:
            self.kv_subscriber.set_engines(kv_sources(self.config, cmd.engines))

    def tokenize(self, cmd: TokenizePrompt) -> None:
        """Hand a prompt to the tokenizer thread (:mod:`.tokenize_worker`); its ids come back as an event."""
        if self.tokenize_worker is None:  # (the router asks only when its policy tokenizes: never here)
            self._feed_now(PromptTokenized(cmd.key, None, "no tokenizer thread"))
            return
        self.tokenize_worker.submit(cmd)

    def flush_failed(self, exc: Exception) -> None:
        """A batch's effect raised ``exc``: log it (``flush_error``); the server goes on."""
        log_event("flush_error", level="error", error=f"{type(exc).__name__}: {exc}")
