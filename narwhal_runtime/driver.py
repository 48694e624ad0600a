"""The driver: what both runtime adapters do after an event that is not I/O.

The router (:mod:`narwhal_core`) turns events into commands. Between it and
the sockets sits this driver, sans-IO like the router: it owns no socket and
reads no clock (``now=`` is passed in). An adapter hands it each event
(:meth:`Driver.feed`) and each due timer (:meth:`Driver.fire_timer`); the
driver drains the router's commands into one *batch*, and when the adapter
decides the batch is over (at the end of a scheduler batch or loop
iteration, or at once under light load) it calls :meth:`Driver.flush` with
an :class:`Effects` object that performs the I/O. The driver decides:

* **the order of effects** (docs/design.md): the batch's journal records
  first, in one write, then its process-log lines, then the engine commands
  (leg starts, finishes, cancels, control requests; prompts to tokenize off
  the loop; the fleet's changes) and the queued leg requests, then the
  clients' bytes. So a journal record is in the file
  before the answer or the leg it describes leaves the process (the
  contract of narwhal_runtime/journal_writer.py);
* **per-client write coalescing**: all the bytes a client got in a batch
  leave in one send, closing it (a lingering close, :data:`LINGER_S`) after
  them when the router said so;
* **error containment**: an exception raised by the router while it handles
  an event, a timer or while its commands are drained ends what the event
  concerned (500 ``internal_error``, its journal record) and never reaches
  the adapter (:func:`contain`); one raised by an effect ends the flush
  (what is left waits for the next) and is handed to
  :meth:`Effects.flush_failed`, never raised to the adapter's loop;
* **journal health**: a journal write that starts or stops failing is fed
  back to the router (``/ready``), within the same flush;
* **the timer**: only a deadline earlier than the armed one re-arms it;
* **busy polling** (:class:`BusyPoll`).
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from narwhal_core import (
    CancelLeg,
    CloseClient,
    Event,
    FinishLeg,
    FleetChanged,
    JournalHealth,
    Log,
    Router,
    ShutdownComplete,
    StartControl,
    StartLeg,
    TokenizePrompt,
    Transmit,
    WriteJournal,
)

__all__ = [
    "Driver", "Effects", "EngineCommands", "BusyPoll", "contain", "keep_lingering",
    "HIGH_WATER", "LINGER_S", "LINGER_BYTES",
]

# Client-socket policy both runtimes follow (for a client that does not
# take its bytes: narwhal_runtime/slow_clients.py).

#: Bytes unsent to one client beyond which what feeds it (an engine leg
#: relaying a stream) waits until all are sent: trio's feeding task waits
#: for the writer, asyncio stops reading the legs.
HIGH_WATER = 1 << 20
#: After Narwhal closes a connection (an error answer, ``connection: close``):
#: how long, and for how many bytes, it goes on reading and discarding what
#: the client still sends, its own side already shut, before closing the
#: socket. Closing with unread bytes makes the kernel reset the connection,
#: and the client could lose the answer (a 413 or 503 in the middle of an
#: upload) before reading it.
LINGER_S = 2.0
LINGER_BYTES = 4 << 20


def keep_lingering(discarded: int) -> bool:
    """During a lingering close: go on dropping what the client sends, having dropped ``discarded`` bytes?"""
    return discarded <= LINGER_BYTES


class EngineCommands(Protocol):
    """The engine side of an adapter (its ``Engines``), as the driver calls it."""

    def start_leg(self, cmd: StartLeg) -> None: ...
    def finish_leg(self, key: str, reusable: bool) -> None: ...
    def cancel_leg(self, key: str) -> None: ...
    def start_control(self, cmd: StartControl) -> None: ...
    def write_unsent(self) -> None:
        """Write the leg requests queued on pooled engine connections."""


class Effects(Protocol):
    """The I/O an adapter performs for :meth:`Driver.flush`, called in this order."""

    def write_journal(self, lines: list[bytes]) -> bool:
        """Append the records (one write); whether the journal is healthy."""

    def journal_error(self) -> str | None:
        """Why the journal is not healthy (asked when :meth:`write_journal`'s answer changes)."""

    def log(self, event: str, fields: dict[str, Any]) -> None:
        """Write one process-log line."""

    @property
    def engines(self) -> EngineCommands | None:
        """Where leg and control commands go (the adapter's ``Engines``; set once it serves)."""

    def tokenize(self, cmd: TokenizePrompt) -> None:
        """Hand a prompt to the tokenizer thread (:mod:`narwhal_runtime.tokenize_worker`); its ids come back as an event."""

    def fleet_changed(self, cmd: FleetChanged) -> None:
        """An engine joined or was forgotten: follow the fleet as it is now (the KV-event subscriber)."""

    def send(self, conn: Any, data: bytes, close: bool) -> None:
        """Send ``data`` (maybe empty) to client ``conn``; then close it (lingering) if ``close``."""

    def flush_failed(self, exc: Exception) -> None:
        """An effect raised ``exc``: the flush stopped there (logged as ``flush_error``; the server goes on)."""


def contain(router: Router, event: Event | None, exc: Exception) -> list[tuple[str, dict[str, Any]]]:
    """The router raised while handling ``event`` (``None``: a timer): end what it was about.

    The request the event belongs to (if any) ends as ``failed`` with 500
    ``internal_error`` and its terminal record (docs/contract.md); the router
    logs the error once, with its traceback (``internal_error``). Returns
    the log lines left for the adapter to write: one, if the router could
    not even contain the failure.
    """
    problem = f"{type(exc).__name__}: {exc}"
    trace = "".join(traceback.format_exception(exc))
    try:
        router.contain_failure(event, problem, trace)
    except Exception as again:  # noqa: BLE001 - the router is broken beyond one request
        return [("internal_error", {
            "level": "error", "rid": None, "problem": problem,
            "during": "deadline" if event is None else type(event).__name__, "traceback": trace,
            "containment": f"{type(again).__name__}: {again}",
        })]
    return []


#: What :meth:`Driver.fire_timer` feeds: the armed deadline is due (a failure is contained as a timer's).
_DEADLINE: Any = object()
#: What :meth:`Driver.drain` feeds: nothing, only take what the router queued on its own.
_QUEUED: Any = object()


class Driver:
    """Feeds a :class:`~narwhal_core.Router` and gathers what it asks for into ordered batches."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._journal: list[bytes] = []
        self._logs: list[tuple[str, dict[str, Any]]] = []
        self._engine: list[StartLeg | FinishLeg | CancelLeg | StartControl | TokenizePrompt | FleetChanged] = []
        #: Each client's bytes in this batch, in order; a client closed in it has an entry too.
        self._outboxes: dict[Hashable, list[bytes]] = {}
        #: The clients the router closed in this batch.
        self._closes: set[Hashable] = set()
        self._journal_ok = True
        #: The time of the last event or timer fed.
        self._now = 0.0
        #: Clients the last :meth:`feed` transmitted to (trio's backpressure looks at them).
        self.transmitted: list[Any] = []
        #: The router said every connection is closed and the drain is over.
        self.shutdown_complete = False
        #: The deadline the adapter's timer is armed for (``inf``: none).
        self.armed = math.inf
        #: Set by a drain that moved the deadline earlier: arm the timer for it.
        self.rearm = False
        #: Drains so far, and at the end of the last scheduler batch (:meth:`batch_ended`).
        self.drains = 0
        self._drains_at_batch_end = 0
        #: :meth:`pending`, kept up to date by each drain and flush: an adapter
        #: that asks once per scheduler batch reads it without a call.
        self.unflushed = False
        #: Called with the router after each flush (a worker of a group
        #: snapshots its metrics: narwhal_runtime/group_metrics.py), if set.
        self.after_flush: Callable[[Router], object] | None = None
        #: A :meth:`flush` runs.
        self.flushing = False

    # ------------------------------------------------------------ the router

    def feed(self, event: Event, now: float) -> bool:
        """Hand the router one event and gather its commands; nothing it raises escapes.

        Returns :meth:`pending` (the caller schedules a flush on it, and
        asking again would cost a call per event). The one loop taking the
        router's commands is here, not in a method of its own: this runs
        once per event, the hottest path of the driver, and a call costs
        (so does a keyword argument: the adapters pass ``now`` by position).
        """
        self.transmitted.clear()
        self._now = now
        router = self.router
        next_output = router.next_output
        outboxes = self._outboxes
        transmitted = self.transmitted
        contained = False
        while True:
            try:
                if not contained:  # (once contained: only take what the containment queued)
                    if event is _DEADLINE:
                        router.handle_deadline(now=now)
                    elif event is not _QUEUED:
                        router.receive(event, now=now)
                while (cmd := next_output()) is not None:
                    kind = type(cmd)
                    if kind is Transmit:
                        conn = cmd.conn  # type: ignore[union-attr]
                        parts = outboxes.get(conn)
                        if parts is None:
                            outboxes[conn] = [cmd.data]  # type: ignore[union-attr]
                        elif not (self._closes and conn in self._closes):  # nothing after the close
                            parts.append(cmd.data)  # type: ignore[union-attr]
                        transmitted.append(conn)
                    elif kind is WriteJournal:
                        self._journal.append(cmd.line)  # type: ignore[union-attr]
                    elif (kind is StartLeg or kind is FinishLeg or kind is CancelLeg or kind is StartControl
                          or kind is TokenizePrompt):  # (compared, not looked up in a set: cheaper)
                        self._engine.append(cmd)  # type: ignore[arg-type]
                    elif kind is CloseClient:
                        conn = cmd.conn  # type: ignore[union-attr]
                        if conn not in outboxes:
                            outboxes[conn] = []
                        self._closes.add(conn)
                    elif kind is Log:
                        self._logs.append((cmd.event, cmd.fields))  # type: ignore[union-attr]
                    elif kind is ShutdownComplete:
                        self.shutdown_complete = True
                    elif kind is FleetChanged:  # (last: the rarest)
                        self._engine.append(cmd)  # type: ignore[arg-type]
                break
            except Exception as exc:  # noqa: BLE001 - one bad event (or timer) must not stop the server
                if contained:  # the router is broken beyond one request
                    self._logs.append(("internal_error", {
                        "level": "error", "rid": None, "problem": f"{type(exc).__name__}: {exc}", "during": "drain"}))
                    break
                # Raised by receive, handle_deadline or next_output (then the commands not yet
                # taken stay queued): end what the event was about, then take what is queued, once more.
                contained = True
                self._logs += contain(router, None if event is _DEADLINE or event is _QUEUED else event, exc)
        self.drains += 1
        deadline = router.get_deadline()
        if deadline is not None and deadline < self.armed:
            # Only an earlier deadline re-arms; a later one waits for this one to fire.
            self.armed = deadline
            self.rearm = True
        self.unflushed = pending = bool(self._journal or self._outboxes or self._engine or self._logs)
        return pending

    def fire_timer(self, *, now: float) -> None:
        """The armed deadline is due: let the router handle it, gather its commands."""
        self.armed = math.inf
        self.feed(_DEADLINE, now)

    def drain(self) -> None:
        """Gather what the router queued on its own (at start: the first health probes)."""
        self.feed(_QUEUED, self._now)

    def batch_ended(self) -> bool:
        """The scheduler's batch is over: was the load light (one drain in it, or none)?

        Then an adapter that can choose does better performing each batch at
        once than at the end of the scheduler's next batch (trio: the engine's
        answer finds the process awake more often; benchmarks/README.md).
        """
        light = self.drains - self._drains_at_batch_end <= 1
        self._drains_at_batch_end = self.drains
        return light

    # ------------------------------------------------------------- the batch

    def pending(self) -> bool:
        """Something waits for :meth:`flush`."""
        return bool(self._journal or self._outboxes or self._engine or self._logs)

    def closing(self, conn: Any) -> bool:
        """The router closed ``conn`` in this batch (its close is not performed yet)."""
        return conn in self._closes

    def pending_bytes(self, conn: Any) -> int:
        """Bytes for ``conn`` waiting in this batch."""
        return sum(len(part) for part in self._outboxes.get(conn, ()))

    def flush(self, out: Effects, *, now: float | None = None) -> bool:
        """Perform the batch through ``out``: journal, logs, engines and the fleet, legs, then clients.

        An effect that feeds the router again (journal health, a client
        admitted when a slot frees) adds to the batch; the loop runs until
        nothing is left, keeping the order for what was added. A change of
        the journal's health is fed at ``now``, by default the time of the
        last event fed (the batch's; reading the clock per flush would cost
        more than it tells). An effect that raises ends the flush there:
        what is left waits for the next one, and the exception goes to
        :meth:`Effects.flush_failed` (a failed write must not stop the
        server). Returns whether it fed the router (act on that drain).

        A flush asked for while one runs (an effect fed an event, and its adapter
        flushes at once after each) returns at once: the running one performs it.
        """
        if self.flushing:
            return False
        self.flushing = True
        drains = self.drains
        try:
            while True:
                fed = self.drains  # (all a batch holds comes from a drain)
                if self._journal:
                    lines, self._journal = self._journal, []
                    ok = out.write_journal(lines)
                    if ok != self._journal_ok:
                        self._journal_ok = ok
                        self.feed(JournalHealth(ok, out.journal_error()), self._now if now is None else now)
                        continue  # the health change's own records go first
                if self._logs:
                    logs, self._logs = self._logs, []
                    for event, fields in logs:
                        out.log(event, fields)
                if self._engine:
                    commands: list[Any] = self._engine  # (told apart by type below: mypy cannot narrow by `is`)
                    self._engine = []
                    engines = out.engines
                    assert engines is not None  # the router starts nothing before the adapter serves
                    started = False
                    for cmd in commands:
                        kind = type(cmd)
                        if kind is StartLeg:
                            engines.start_leg(cmd)
                            started = True
                        elif kind is FinishLeg:
                            engines.finish_leg(cmd.leg, cmd.reusable)
                        elif kind is CancelLeg:
                            engines.cancel_leg(cmd.leg)
                        elif kind is TokenizePrompt:
                            out.tokenize(cmd)
                        elif kind is FleetChanged:
                            out.fleet_changed(cmd)
                        else:
                            engines.start_control(cmd)
                    if started:  # only a leg started here can have queued a request on a pooled connection
                        engines.write_unsent()
                outboxes = self._outboxes
                if outboxes:
                    self._outboxes = {}
                    closes = self._closes
                    send = out.send
                    if closes:
                        self._closes = set()
                        for conn, parts in outboxes.items():
                            send(conn, parts[0] if len(parts) == 1 else b"".join(parts), conn in closes)
                    else:
                        for conn, parts in outboxes.items():
                            send(conn, parts[0] if len(parts) == 1 else b"".join(parts), False)
                if self.drains == fed:
                    break  # no effect fed the router: nothing was added
            self.unflushed = False
        except Exception as exc:  # noqa: BLE001 - a failed effect must not stop the server (nor trio's instrument)
            self.unflushed = self.pending()  # what is left waits for the next flush
            out.flush_failed(exc)
        finally:
            self.flushing = False
        if self.after_flush is not None:
            self.after_flush(self.router)
        return self.drains != drains


class BusyPoll:
    """``ingress.busy_poll_us``: keep the loop polling, not sleeping, for a while after each event.

    Each event fed opens (or extends) a window of ``seconds`` on the real
    clock (it stands for CPU spent; a test's mock clock does not move while
    a task is runnable); while the window is open the adapter keeps
    something runnable, so its wait for I/O returns at once and a socket
    that becomes ready is served without the process being woken.
    """

    __slots__ = ("seconds", "until", "polling", "polls")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.until = 0.0
        #: The adapter's poller is running (or woken).
        self.polling = False
        #: Loop iterations (trio: scheduler batches) spent polling, so far.
        self.polls = 0

    def event_fed(self, now: float) -> bool:
        """An event was fed at ``now``: open the window; ``True`` if the poller must be started."""
        self.until = now + self.seconds
        if self.polling:
            return False
        self.polling = True
        return True

    def keep_polling(self, now: float) -> bool:
        """One more turn of polling at ``now``? (``False`` ends it until the next event.)"""
        if now < self.until:
            self.polls += 1
            return True
        self.polling = False
        return False

    def stop(self) -> None:
        """Shutting down: no more polling."""
        self.seconds = 0.0
        self.until = 0.0
