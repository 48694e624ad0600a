"""A control request to an engine (health probe, KV release), sans-IO: its bytes out, its answer in.

The router asks for control requests with ``StartControl`` and hears how
each went with ``ControlDone`` (docs/embedding.md). Both adapters run them
the same way, so everything but the socket calls and the deadline lives
here: the request is encoded by the core's own engine-side codec, the one
the legs use (:class:`~narwhal_core.http.EngineConnection`), on a
connection of its own that carries this one request (``connection:
close``), and the answer is parsed back by it, up to
``StartControl.body_limit`` bytes of body (by default
:data:`~narwhal_core.CONTROL_BODY_LIMIT`): an abort endpoint's answer is a
few dozen bytes, a decode release's is read for its verdict, an engine's
``/metrics`` is asked for with a larger limit.

:func:`run_control` runs one :class:`ControlExchange` per ``StartControl``,
the same on both runtimes, with the primitives the adapter lends it
(:class:`~.runtime_io.RuntimeIO`: its time limit, ``getaddrinfo``, a
socket's readiness waits and close; the socket calls are
:mod:`.socket_io`'s)::

    exchange = ControlExchange(cmd)
    data = exchange.request()            # before connecting: may refuse
    infos = await resolve(...)           # if cmd.resolve: feed exchange.resolved(infos)
    sock = await connect_first(infos, io.writable, io.time_limit, cmd.timeout)
    exchange.connected()
    done = await exchange.converse(data, send_all, receive_some)   # then close
    failures: exchange.failed(exc), exchange.timed_out(), exchange.cancelled()

(:meth:`ControlExchange.converse` writes, then reads until the outcome is
known, feeding :meth:`~ControlExchange.receive_data`; after a ``decode_abort``
request, ``hang_up``, it reads nothing: :meth:`~ControlExchange.sent`.) Both
runtimes connect the same way: to the addresses resolved once, each in
turn and each but the last within its share of the time
(:func:`connect_first`), so a probe that tells the router what its
engine's name resolved to connects to one of those very addresses.

The request carries the engine credential where the router put it; no
error text made here holds a request header, so the credential reaches
neither the log nor the journal (docs/security.md).
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

from narwhal_core import ControlDone, Event, StartControl, local_failure
from narwhal_core.errors import LocalProtocolError, RemoteProtocolError
from narwhal_core.events import EngineResolved
from narwhal_core.http import NEED_DATA, BodyData, EngineConnection, ResponseEnd, ResponseHead

from . import socket_io
from .engine_probe import addresses_of, describe_failure, shorten
from .runtime_io import RuntimeIO
from .socket_options import set_up_engine

__all__ = [
    "ControlExchange", "ControlRefused", "TimeLimitExpired", "CONTROL_HEADERS",
    "run_control", "resolve", "connect_first",
]

#: Added to every control request (``decode_abort``'s raw request aside):
#: the answer's bytes are read as they come (a KV release's body is parsed,
#: never decompressed), and the connection carries this one request.
CONTROL_HEADERS: Final = ((b"accept-encoding", b"identity"), (b"connection", b"close"))


class ControlRefused(Exception):
    """The codec refused to encode the request (a header HTTP/1.1 does not allow).

    Its message names no header value: the refused one may be the engine
    credential.
    """


class TimeLimitExpired(Exception):
    """A time limit ran out: raised by the adapter's ``time_limit`` (:meth:`~.runtime_io.RuntimeIO.time_limit`).

    Not the runtime's own exception: trio's is ``TooSlowError``; asyncio's
    is a ``TimeoutError``, which a socket raises too for the kernel's
    ``ETIMEDOUT``, and that one is a failure of the connection, not of the
    limit.
    """


async def run_control(cmd: StartControl, io: RuntimeIO, feed: Callable[[Event], object]) -> None:
    """Run one control request on ``io`` and ``feed`` what came of it (``EngineResolved`` first, if it resolves).

    ``feed`` is synchronous, so the router hears a cancellation while the
    runtime cancels the request.

    The request is encoded before connecting (a header the codec refuses
    costs no connection); the whole exchange runs under ``cmd.timeout``.
    Its outcome, the same on both runtimes: the answer; a socket error or
    the codec's refusal as a failure naming why; the deadline as
    ``timeout`` (``connect timeout`` before the connection opened); a
    cancellation (shutdown) as ``cancelled``, fed before it goes on.
    """
    exchange = ControlExchange(cmd)
    host, port = cmd.engine.host, cmd.engine.port
    failures: tuple[type[BaseException], ...] = (OSError, ControlRefused, *io.CONTROL_BROKEN)
    try:
        async with io.time_limit(cmd.timeout):
            data = exchange.request()
            infos = await resolve(host, port, io.getaddrinfo)
            if cmd.resolve:
                # Resolved at every probe: the addresses may name the KV side channel.
                feed(exchange.resolved(infos))
            sock = await connect_first(infos, io.writable, io.time_limit, cmd.timeout)
            try:
                set_up_engine(sock)
                exchange.connected()
                done = await exchange.converse(
                    data, functools.partial(socket_io.send_all, sock, writable=io.writable),
                    functools.partial(socket_io.receive, sock, io.readable),
                )
            finally:
                io.close_socket(sock)
    except TimeLimitExpired:
        done = exchange.timed_out()
    except failures as exc:
        done = exchange.failed(exc)
    except BaseException:
        feed(exchange.cancelled())
        raise
    feed(done)


async def resolve(host: str, port: int, getaddrinfo: Callable[..., Awaitable[Sequence[Any]]]) -> Sequence[Any]:
    """``getaddrinfo`` for ``host`` (stream sockets): at once for an IP address, else by the runtime's resolver."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        return await getaddrinfo(host, port, type=socket.SOCK_STREAM)


class ControlExchange:
    """One control request: the bytes to write, and the ``ControlDone`` its answer (or failure) makes."""

    __slots__ = ("cmd", "hang_up", "_codec", "_status", "_body", "_connected")

    def __init__(self, cmd: StartControl) -> None:
        self.cmd = cmd
        #: ``decode_abort``: write the raw request and close the connection, reading nothing.
        self.hang_up = cmd.drop_after_send
        # The answer is read only up to cmd.body_limit: no body limit (whatever
        # follows is never read), the codec's head limit.
        self._codec = EngineConnection(max_body_bytes=None)
        self._status: int | None = None
        self._body = bytearray()
        self._connected = False

    def request(self) -> bytes:
        """The bytes to write on a new connection to ``cmd.engine``; raises :class:`ControlRefused`."""
        cmd = self.cmd
        if self.hang_up:
            return cmd.data
        try:
            return self._codec.send_request(cmd.method, cmd.target, (*cmd.headers, *CONTROL_HEADERS), cmd.body)
        except LocalProtocolError:
            pass
        # Raised outside the handler: the codec's message, which quotes the
        # header, is not even its context.
        raise ControlRefused("cannot encode the request: a header HTTP/1.1 does not allow (value not shown)")

    def resolved(self, infos: Iterable[Any]) -> EngineResolved:
        """What the engine's name resolved to (``cmd.resolve``), for the router (docs/configure.md)."""
        return EngineResolved(self.cmd.engine, addresses_of(infos))

    def connected(self) -> None:
        """The connection is open: a timeout from now on may have let the request reach the engine."""
        self._connected = True

    async def converse(self, data: bytes, send_all: Callable[[bytes], Awaitable[object]],
                       receive_some: Callable[[], Awaitable[bytes]]) -> ControlDone:
        """Write ``data`` on the open connection, then read until the outcome is known."""
        await send_all(data)
        if self.hang_up:
            return self.sent()
        while (done := self.receive_data(await receive_some())) is None:
            pass
        return done

    def sent(self) -> ControlDone:
        """A ``decode_abort`` request was written and the connection closed: nothing comes back."""
        return ControlDone(self.cmd.key, None)

    def receive_data(self, data: bytes) -> ControlDone | None:
        """Bytes from the engine (``b""``: it closed); the outcome once known, else ``None``."""
        codec = self._codec
        codec.receive_data(data)
        body = self._body
        try:
            while True:
                event = codec.next_event()
                if event is NEED_DATA:
                    return None
                if type(event) is ResponseHead:
                    self._status = event.status
                elif type(event) is BodyData:
                    body += event.data
                    if len(body) >= self.cmd.body_limit:
                        break  # enough to know what the engine said
                else:
                    assert type(event) is ResponseEnd
                    break
        except RemoteProtocolError as exc:
            # The engine's bytes broke HTTP/1.1 or stopped short: the
            # message quotes at most the engine's own bytes.
            return ControlDone(self.cmd.key, None, shorten(str(exc)))
        assert self._status is not None
        return ControlDone(self.cmd.key, self._status, None, False, bytes(body[: self.cmd.body_limit]))

    def failed(self, exc: BaseException) -> ControlDone:
        """The request failed with ``exc`` (a socket error, :class:`ControlRefused`): why, in a few words."""
        if isinstance(exc, ControlRefused):
            return ControlDone(self.cmd.key, None, str(exc))
        return ControlDone(self.cmd.key, None, describe_failure(exc), local_failure(exc))

    def timed_out(self) -> ControlDone:
        """``cmd.timeout`` ran out.

        ``connect timeout`` before the connection opened: nothing was sent,
        which a KV release's record says (docs/operate.md); ``timeout``
        otherwise.
        """
        return ControlDone(self.cmd.key, None, "timeout" if self._connected else "connect timeout")

    def cancelled(self) -> ControlDone:
        """The adapter is shutting down and stopped the request."""
        return ControlDone(self.cmd.key, None, "cancelled")


async def connect_first(infos: Sequence[Any], writable: socket_io.Wait,
                        time_limit: Callable[[float], AbstractAsyncContextManager[object]], budget: float) -> socket.socket:
    """A socket connected to the first address of ``infos`` that takes it (:func:`.socket_io.connect`, waiting by ``writable``).

    Each address is tried in turn. ``budget`` is the time the caller's
    deadline gives the whole connect: every address but the last gets at
    most its share, ``budget / len(infos)`` (``time_limit(seconds)``, the
    runtime's: :meth:`~.runtime_io.RuntimeIO.time_limit`), so an address that drops the SYN
    cannot hold the others off until that deadline; the last has what is
    left of it. If none takes the connection, the ``OSError`` raised keeps
    each address's own error (a refusal on every address is named as one
    by :func:`~.engine_probe.describe_failure`), where Python 3.11's
    ``loop.create_connection`` sums them up in one ``OSError`` without an
    errno.
    """
    errors: list[Exception] = []
    share = budget / len(infos) if infos else budget
    for n, (family, kind, proto, _, address) in enumerate(infos, 1):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            if n < len(infos):
                async with time_limit(share):
                    await socket_io.connect(sock, address, writable)
            else:
                await socket_io.connect(sock, address, writable)
            return sock
        except (OSError, TimeLimitExpired) as exc:  # (the latter: the address's share ran out)
            sock.close()
            errors.append(exc)
        except BaseException:
            sock.close()
            raise
    if not errors:
        raise OSError("the engine's name resolved to no address")
    raise OSError("no address of the engine took the connection") from ExceptionGroup("connect", errors)
