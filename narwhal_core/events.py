"""Values in and values out of the router.

An adapter feeds :class:`Event` values to ``Router.receive(event, now=...)``
and executes the :class:`Command` values it drains from
``Router.next_output()``. Connection handles (``conn``) are whatever
hashable object the adapter uses for a client socket; legs and control
requests are named by string keys the router chose.

Every value is immutable by contract. The ones that pass once or more per
request (``ClientData``, ``LegData``, ``Transmit``, ``StartLeg``,
``FinishLeg``, ``WriteJournal``) are plain slotted attrs classes rather than
frozen ones, because a frozen class's ``__init__`` sets each field through
``object.__setattr__``, which makes every construction dearer
(benchmarks/README.md, "Figures behind the code"); nothing may assign to them.
"""

from __future__ import annotations

import errno
from collections.abc import Hashable
from typing import Any, Final, Literal

import attrs

from .config import EngineAddress
from .fleet_change import FleetChanged

__all__ = [
    "ClientConnected", "ClientData", "ClientGone", "ClientStalled", "LegData", "LegFailed",
    "ControlDone", "CONTROL_BODY_LIMIT", "ShutdownRequested", "AuthenticatorChanged", "JournalHealth",
    "EngineResolved", "EnginesChanged", "KvEventsReceived", "KvStreamChanged", "PromptTokenized", "Event",
    "Transmit", "CloseClient", "StartLeg", "CancelLeg", "FinishLeg",
    "StartControl", "TokenizePrompt", "WriteJournal", "Log", "ShutdownComplete", "Command",
    "LegFailure", "LOCAL_ERRNOS", "local_failure",
]

# ----------------------------------------------------------------- events in


@attrs.frozen
class ClientConnected:
    """A client socket was accepted."""

    #: The adapter's handle for the socket.
    conn: Hashable
    #: The peer's IP address as text.
    peer_host: str
    #: The peer's port.
    peer_port: int


@attrs.define
class ClientData:
    """Bytes arrived from a client; ``b""`` means it closed its side (EOF)."""

    #: The socket.
    conn: Hashable
    #: What arrived.
    data: bytes


@attrs.frozen
class ClientGone:
    """A client socket broke (reset, write failure): nothing more can be sent to it."""

    #: The socket.
    conn: Hashable


@attrs.frozen
class ClientStalled:
    """The client is not taking its bytes, so the adapter stopped reading the engine leg that feeds it
    (``stalled=True``), or it caught up and the leg is read again (``stalled=False``).

    While a client is stalled its engine sends nothing because the adapter
    holds it back, so the time limits of its request's legs
    (``engine.stream_idle_timeout_s``, the prefill and decode timeouts) are
    suspended, for legs started meanwhile too; the client's own limit
    (``ingress.send_timeout_s``, the adapter's) and the request deadline
    apply.
    """

    #: The client connection.
    conn: Hashable
    stalled: bool


#: Why a leg's connection failed, as the adapter saw it. ``local_error``:
#: Narwhal itself could not open the connection (:func:`local_failure`), which
#: says nothing about the engine.
LegFailure = Literal["connect_failed", "connect_timeout", "dropped", "local_error"]

#: ``errno`` values of a failed connect that are the router's own shortage, not
#: the engine's fault: out of file descriptors (process or system), of buffer
#: space or memory, of local ports.
LOCAL_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})


def local_failure(exc: BaseException) -> bool:
    """Whether a failed connect (or control request) failed for want of local resources.

    Looks through the exception, its causes and contexts, and the members of
    exception groups (a connect to several addresses fails with each
    address's error grouped under one ``OSError``), for an ``OSError``
    whose ``errno`` is in :data:`LOCAL_ERRNOS`.
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen or len(seen) > 64:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in LOCAL_ERRNOS:
            return True
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        for linked in (e.__cause__, e.__context__):
            if linked is not None:
                todo.append(linked)
    return False


@attrs.define
class LegData:
    """Bytes arrived from an engine on a leg; ``b""`` means the engine closed (EOF)."""

    #: The leg's backend ID.
    leg: str
    #: What arrived.
    data: bytes


@attrs.frozen
class LegFailed:
    """A leg's connection failed before or while the request was written or read."""

    #: The leg's backend ID.
    leg: str
    #: What went wrong.
    reason: LegFailure
    #: The leg ran on a pooled keep-alive connection (a stale socket can fail
    #: this way without the engine having seen the request).
    reused: bool = False


@attrs.frozen
class ControlDone:
    """A control request (probe, KV release) finished."""

    #: The key from :class:`StartControl`.
    key: str
    #: The engine's status, or ``None`` if no answer came.
    status: int | None
    #: Why there was no answer, if there was none.
    error: str | None = None
    #: It failed for want of local resources (:func:`local_failure`): no
    #: verdict on the engine's health.
    local: bool = False
    #: The start of the engine's answer body: at most
    #: :data:`CONTROL_BODY_LIMIT` bytes (adapters stop reading there).
    body: bytes = b""


#: How much of a control answer's body an adapter reads and passes on in
#: :class:`ControlDone` unless the request says otherwise
#: (:attr:`StartControl.body_limit`; an abort endpoint's answer is a few dozen bytes).
CONTROL_BODY_LIMIT: Final = 4096


@attrs.frozen
class ShutdownRequested:
    """SIGTERM/SIGINT: stop taking requests, drain, then report completion."""


@attrs.frozen
class AuthenticatorChanged:
    """The API keys file was reloaded (SIGHUP)."""

    #: The new authenticator (``narwhal_core.auth.Authenticator``).
    authenticator: Any


@attrs.frozen
class JournalHealth:
    """The journal writer's state: a failing journal makes ``/ready`` answer 503."""

    #: Whether the last write succeeded.
    ok: bool
    #: What failed, for ``/ready``'s body and the log.
    message: str | None = None


@attrs.frozen
class EngineResolved:
    """The adapter resolved an engine's host name (for a :class:`StartControl` with ``resolve`` set).

    Fed before the control request's :class:`ControlDone`. A prefill answer
    whose ``remote_host`` is one of these addresses names that engine's KV
    side channel (docs/configure.md, ``engine.kv_hosts``). A failed
    resolution is not fed: the probe fails, and the addresses of the last
    good one stay.
    """

    #: The engine, as in the :class:`StartControl`.
    engine: EngineAddress
    #: The IP addresses the name resolved to, as text.
    addresses: tuple[str, ...]


@attrs.frozen
class EnginesChanged:
    """Discovery found the engines of one phase: the whole new set (docs/operate.md, "Engines that come and go").

    Engines not in it are drained, engines new in it join after their first
    healthy probe; an empty set drains every engine of the phase. The
    runtime feeds it only when the set changed, never after a failed lookup.
    """

    #: ``"prefill"`` or ``"decode"``.
    phase: str
    #: Every engine of the phase, as discovery found them.
    engines: tuple[EngineAddress, ...]
    #: What found them (``"dns"``, ``"file"``), for the log.
    source: str = "discovery"


@attrs.frozen
class KvEventsReceived:
    """KV-cache events of one engine, in the order it published them (docs/routing.md, "KV events").

    The runtime's subscriber decodes the stream with
    :class:`~narwhal_core.kv_events.KvStream` (replaying gaps) and feeds the
    events of each message that applied, on the event loop.
    """

    #: The engine's URL (``EngineAddress.url``).
    url: str
    #: The events, in order.
    events: tuple[Any, ...]


@attrs.frozen
class KvStreamChanged:
    """An engine's KV-event stream came up or went down (docs/routing.md, "KV events")."""

    #: The engine's URL.
    url: str
    #: Whether events are arriving (connected, in order) now.
    live: bool
    #: Why, as one word for the log: ``connected``, ``disconnected``, ``replay_failed``, ``malformed``.
    reason: str


@attrs.frozen
class PromptTokenized:
    """The answer to a :class:`TokenizePrompt`: the prompt's token ids, or why there are none.

    (docs/routing.md, "Tokenizing off the event loop".) Fed on the event
    loop; one whose request has ended or moved on meanwhile is ignored.
    """

    #: The key of the :class:`TokenizePrompt`.
    key: str
    #: The token ids the engine computes for the prompt (``None``: the tokenizer raised).
    token_ids: tuple[int, ...] | None
    #: What the tokenizer raised, as ``Type: message`` (the request is then weighed from the approximate index).
    problem: str | None = None


Event = (
    ClientConnected | ClientData | ClientGone | ClientStalled | LegData | LegFailed | ControlDone
    | ShutdownRequested | AuthenticatorChanged | JournalHealth | EngineResolved | EnginesChanged
    | KvEventsReceived | KvStreamChanged | PromptTokenized
)

# -------------------------------------------------------------- commands out


@attrs.define
class Transmit:
    """Write ``data`` to a client socket, after anything written before it."""

    #: The socket.
    conn: Hashable
    #: The bytes.
    data: bytes


@attrs.frozen
class CloseClient:
    """Close a client socket once everything transmitted before has been written."""

    #: The socket.
    conn: Hashable


@attrs.define
class StartLeg:
    """Send a leg's request to an engine and feed its answer back as :class:`LegData`."""

    #: The leg's backend ID (its key in later events and commands).
    leg: str
    #: The engine.
    engine: EngineAddress
    #: The complete HTTP request.
    data: bytes
    #: The client socket the answer is for (for flow control).
    conn: Hashable
    #: Seconds allowed to open a new connection.
    connect_timeout: float
    #: Do not take a pooled connection (a retry after a stale one).
    fresh_connection: bool = False


@attrs.frozen
class CancelLeg:
    """Stop a leg: close its engine connection (the engine aborts the request)."""

    #: The leg's backend ID.
    leg: str


@attrs.define
class FinishLeg:
    """A leg's answer is complete: return its connection to the pool, or close it."""

    #: The leg's backend ID.
    leg: str
    #: Whether the connection may carry another request.
    reusable: bool


@attrs.frozen
class StartControl:
    """A control request to an engine (health probe or KV release); answer with :class:`ControlDone`."""

    #: The key to answer with.
    key: str
    #: The engine.
    engine: EngineAddress
    #: HTTP method.
    method: str
    #: Request target (path).
    target: str
    #: Headers to send (the engine credential among them, where configured).
    headers: tuple[tuple[bytes, bytes], ...]
    #: Request body.
    body: bytes
    #: Seconds allowed in all.
    timeout: float
    #: Write the request and close the connection at once, without reading an
    #: answer (``kv_release = "decode_abort"``): ``data`` holds the raw request.
    drop_after_send: bool = False
    #: The raw HTTP request for ``drop_after_send``.
    data: bytes = b""
    #: Resolve the engine's host name first and feed the addresses as
    #: :class:`EngineResolved` (health probes of prefill engines named by a
    #: name rather than an address).
    resolve: bool = False
    #: Most bytes of the answer's body the adapter reads and passes on in
    #: :class:`ControlDone` (an engine's ``/metrics`` is far longer than an
    #: abort endpoint's answer).
    body_limit: int = CONTROL_BODY_LIMIT


@attrs.frozen
class TokenizePrompt:
    """Compute a prompt's token ids off the event loop; answer with :class:`PromptTokenized`.

    (docs/routing.md, "Tokenizing off the event loop".) Asked only under
    ``routing.policy = "kv"``, for a prompt larger than
    ``routing.tokenize_inline_max_bytes``: call the runtime's tokenizer's
    ``prompt_token_ids(body, chat)`` (the one passed to the router) in a
    worker thread, and feed the result back on the event loop.
    """

    #: The key to answer with: the request's rid and the prompt's number (``rid:0``; a batch's next: ``rid:1``...).
    key: str
    #: The request's body, its ``prompt`` the one to tokenize (a copy of the router's: nothing changes it).
    body: dict[str, Any]
    #: The body came on ``/v1/chat/completions`` (its messages are rendered by the chat template).
    chat: bool


@attrs.define
class WriteJournal:
    """Append one record to the journal (one line, flushed)."""

    #: The encoded line, newline included.
    line: bytes
    #: Whether it is a terminal record.
    terminal: bool


@attrs.frozen
class Log:
    """One structured log line about the process (not about a single request)."""

    #: What happened (``engine_down``, ``engine_up``, ``draining``...).
    event: str
    #: Details.
    fields: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class ShutdownComplete:
    """Draining finished: every request has its terminal record; the adapter may exit."""


Command = (
    Transmit | CloseClient | StartLeg | CancelLeg | FinishLeg | StartControl | TokenizePrompt
    | WriteJournal | Log | ShutdownComplete | FleetChanged
)
