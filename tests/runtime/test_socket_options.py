"""The options each kind of connected socket gets on both runtimes (narwhal_runtime/socket_options.py).

On a real loopback connection. That each adapter applies them, on trio,
asyncio and uvloop alike, is shown end to end by
tests/e2e/test_runtime_parity.py (client and leg sockets) and
tests/runtime/test_control_adapters.py (control connections).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from narwhal_runtime.socket_options import (
    CLIENT_NOTSENT_LOWAT, CLIENT_OPTIONS, ENGINE_OPTIONS, set_up_client, set_up_engine,
)

TCP = socket.IPPROTO_TCP


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """``(accepted, connected)``: both ends of one loopback connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        connected = socket.create_connection(server.getsockname(), timeout=5)
        accepted, _ = server.accept()
    with accepted, connected:
        yield accepted, connected


def options(sock: socket.socket) -> tuple[int, int]:
    return sock.getsockopt(TCP, socket.TCP_NODELAY), sock.getsockopt(TCP, socket.TCP_NOTSENT_LOWAT)


def test_the_table_bounds_unsent_bytes_on_client_sockets_only() -> None:
    assert CLIENT_NOTSENT_LOWAT == 16 * 1024  # trio's own default, which the trio runtime always had
    assert CLIENT_OPTIONS == ((TCP, socket.TCP_NODELAY, 1), (TCP, socket.TCP_NOTSENT_LOWAT, CLIENT_NOTSENT_LOWAT))
    assert ENGINE_OPTIONS == ((TCP, socket.TCP_NODELAY, 1), (TCP, socket.TCP_NOTSENT_LOWAT, 0))


def test_an_accepted_client_socket_is_non_blocking_without_nagle_and_bounded(
        connection: tuple[socket.socket, socket.socket]) -> None:  # fmt: skip
    accepted, _ = connection
    assert options(accepted) == (0, 0)  # the kernel's defaults
    set_up_client(accepted)
    assert accepted.getblocking() is False
    assert options(accepted) == (1, CLIENT_NOTSENT_LOWAT)


def test_an_engine_socket_gets_no_bound_whatever_the_runtime_set_before(
        connection: tuple[socket.socket, socket.socket]) -> None:  # fmt: skip
    _, connected = connection
    connected.setsockopt(TCP, socket.TCP_NOTSENT_LOWAT, 2**14)  # as trio's SocketStream leaves it
    set_up_engine(connected)
    assert options(connected) == (1, 0)
    assert connected.getblocking() is True  # left to the adapter: its runtime drives the socket


def test_a_socket_that_refuses_an_option_is_left_to_its_first_read() -> None:
    class Gone:
        calls = 0

        def setsockopt(self, level: int, option: int, value: int, /) -> None:
            self.calls += 1
            raise OSError(22, "Invalid argument")

    gone = Gone()
    set_up_engine(gone)  # no exception: the connection's own read or write reports it
    assert gone.calls == 1
