"""A leg whose connection cannot be opened fails for the same reason on both runtimes.

One rule (:func:`narwhal_runtime.leg_connections.connect_failure`, docs/design.md):
``connect_timeout`` only when the leg's own time limit ran out; any socket
error -- the kernel's ``ETIMEDOUT`` included -- is ``connect_failed``, or
``local_error`` when Narwhal itself is short of descriptors, memory or
ports. The function is tested alone, then each adapter's ``Engines`` opens
a leg against real loopback sockets: a refusal, a listener whose full queue
drops the SYN (the deadline expires), and errors the kernel's ``connect``
returns (``ETIMEDOUT``, ``EADDRNOTAVAIL``), raised from ``socket.connect``
for one port, since a real ``ETIMEDOUT`` takes the kernel minutes.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal_core import Event, LegData, LegFailed, StartLeg
from narwhal_core.config import parse_engine_url
from narwhal_runtime.control import TimeLimitExpired
from narwhal_runtime.leg_connections import Engines, connect_failure

from ..helpers import on_runtime

RUNTIMES = ("trio", "asyncio")


def _oserror(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@pytest.mark.parametrize(("exc", "reason"), [
    (TimeLimitExpired(), "connect_timeout"),  # the router's own limit (Engines.connect)
    (TimeoutError(), "connect_failed"),  # asyncio's type for the kernel's ETIMEDOUT
    (_oserror(errno.ETIMEDOUT), "connect_failed"),  # the kernel's: a TimeoutError, yet the engine's
    (_oserror(errno.ECONNREFUSED), "connect_failed"),
    (_oserror(errno.EHOSTUNREACH), "connect_failed"),
    (_oserror(errno.EMFILE), "local_error"),
    (_oserror(errno.EADDRNOTAVAIL), "local_error"),
    # control.connect_first (both runtimes): an OSError without errno, caused by a group of each address's.
    (OSError("all attempts failed"), "connect_failed"),
])
def test_one_rule_names_a_failed_connect(exc: BaseException, reason: str) -> None:
    assert isinstance(_oserror(errno.ETIMEDOUT), TimeoutError)  # why asyncio once said connect_timeout
    assert connect_failure(exc) == reason


def test_a_local_shortage_is_found_among_the_addresses_errors() -> None:
    grouped = OSError("no address of the engine took the connection")
    grouped.__cause__ = ExceptionGroup("connect", [TimeLimitExpired(), _oserror(errno.EMFILE)])
    assert connect_failure(grouped) == "local_error"
    grouped.__cause__ = ExceptionGroup("connect", [TimeLimitExpired(), _oserror(errno.ETIMEDOUT)])
    assert connect_failure(grouped) == "connect_failed"  # an address's share ran out: not the leg's limit


# ------------------------------------------------------- on both adapters


def open_leg(runtime: str, port: int, *, connect_timeout: float = 5.0, host: str = "127.0.0.1",
             getaddrinfo: Any = None) -> list[Event]:
    """The events one leg to ``host:port`` feeds on ``runtime``, until its ``LegFailed`` or first ``LegData``.

    ``getaddrinfo``, if given, stands in for the runtime's resolver.
    """
    address = parse_engine_url(f"http://{host}:{port}", key="engine.decode")
    cmd = StartLeg("leg-1", address, b"GET / HTTP/1.1\r\nhost: e\r\n\r\n", None, connect_timeout)
    events: list[Event] = []

    async def body(io: Any, failed: Any) -> None:
        def feed(event: Event) -> None:  # synchronous, as the server's
            events.append(event)
            if isinstance(event, (LegFailed, LegData)):
                failed.set()

        engines = Engines(io, feed, 1)
        if getaddrinfo is not None:
            io.getaddrinfo = getaddrinfo
        engines.start_leg(cmd)
        async with io.time_limit(10):
            await failed.wait()
        engines.close_all()

    on_runtime(runtime, body)
    return events


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


@pytest.fixture
def kernel_says(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``kernel_says(code)``: the port of an address whose ``connect`` fails with ``code`` (and the tries)."""
    tries: list[int] = []
    real_connect = socket.socket.connect

    def make(code: int) -> tuple[int, list[int]]:
        port = free_port()

        def connect(sock: socket.socket, address: Any) -> None:
            if isinstance(address, tuple) and address[1] == port:
                tries.append(port)
                raise _oserror(code)
            real_connect(sock, address)

        monkeypatch.setattr(socket.socket, "connect", connect)
        return port, tries

    yield make


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_kernels_etimedout_is_a_failed_connect_not_a_timeout(runtime: str, kernel_says: Any) -> None:
    port, tries = kernel_says(errno.ETIMEDOUT)
    assert open_leg(runtime, port) == [LegFailed("leg-1", "connect_failed")]
    assert tries == [port]  # the kernel's answer was the one seen


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_out_of_local_ports_is_a_local_error(runtime: str, kernel_says: Any) -> None:
    port, tries = kernel_says(errno.EADDRNOTAVAIL)
    assert open_leg(runtime, port) == [LegFailed("leg-1", "local_error")]
    assert tries == [port]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_refusal_is_a_failed_connect(runtime: str) -> None:
    assert open_leg(runtime, free_port()) == [LegFailed("leg-1", "connect_failed")]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_legs_own_deadline_is_a_connect_timeout(runtime: str) -> None:
    # A listener whose queue is full drops the next SYN: the connect hangs until the deadline.
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        assert open_leg(runtime, listener.getsockname()[1], connect_timeout=0.2) == [
            LegFailed("leg-1", "connect_timeout")]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_named_engine_is_resolved_once_and_its_addresses_tried_in_turn(runtime: str, kernel_says: Any) -> None:
    # The connect both runtimes share (narwhal_runtime/leg_connections.py, Engines.connect): the adapter's
    # resolver, once, then each address it gave (trio's legs used to resolve by trio's own resolver).
    port, tries = kernel_says(errno.ECONNREFUSED)
    asked: list[str] = []

    async def getaddrinfo(host: str, port_: int, *, type: int) -> list[Any]:
        asked.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))] * 2

    events = open_leg(runtime, port, host="engine.invalid", getaddrinfo=getaddrinfo)
    assert events == [LegFailed("leg-1", "connect_failed")]
    assert asked == ["engine.invalid"]
    assert tries == [port, port]  # both addresses, in turn


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_address_that_drops_the_syn_gives_way_to_the_next_within_the_deadline(runtime: str) -> None:
    # Engines.connect: each address but the last gets its share of connect_timeout
    # (control.connect_first). Before, the first address held the connect until the
    # deadline: connect_timeout, the second address never tried.
    with socket.socket() as dropping, socket.socket() as filler, socket.create_server(("127.0.0.1", 0)) as good:
        dropping.bind(("127.0.0.1", 0))
        dropping.listen(0)
        filler.connect(dropping.getsockname())  # its queue is full: the next SYN is dropped
        good.settimeout(10)
        received: list[bytes] = []

        def engine() -> None:
            conn, _ = good.accept()
            with conn:
                conn.settimeout(10)
                data = b""
                while b"\r\n\r\n" not in data and (more := conn.recv(4096)):
                    data += more
                received.append(data)  # then close: the connection was made

        serving = threading.Thread(target=engine)
        serving.start()

        async def getaddrinfo(host: str, port: int, *, type: int) -> list[Any]:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", address)
                    for address in (dropping.getsockname(), good.getsockname())]

        events = open_leg(runtime, 80, host="engine.invalid", connect_timeout=1.0, getaddrinfo=getaddrinfo)
        serving.join(10)
    assert received == [b"GET / HTTP/1.1\r\nhost: e\r\n\r\n"]  # the leg's request, on the second address
    assert events[0] == LegData("leg-1", b"")  # then the engine's close, as each runtime reports it
    assert LegFailed("leg-1", "connect_timeout") not in events
