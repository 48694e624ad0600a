"""Both adapters' listeners hold a connection slot only for a connection, never for a socket that waits.

``ingress.max_connections`` is counted over every listening socket (an
address may resolve to IPv4 and IPv6). With one slot and two sockets, a
connection to either is accepted; once it holds the slot, the next waits
in the backlog until it is released (the shared loop,
narwhal_runtime/listening.py, with each runtime's waits and tasks:
narwhal_trio/io.py, narwhal_asyncio/io.py).
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from narwhal_runtime.listening import Listener, listening_sockets

from ..harness import LogCapture
from ..helpers import on_runtime

RUNTIMES = ("trio", "asyncio")


def _two_sockets() -> list[socket.socket]:
    try:
        return listening_sockets("127.0.0.1", 0) + listening_sockets("::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback")


def _accepted_in_order(runtime: str, sockets: list[socket.socket]) -> list[str]:
    """What is accepted, in order, with one slot: a connection to the second socket; another to it while
    the first holds the slot (accepted once it is released); then one to the first socket."""
    order: list[str] = []
    second = sockets[1].getsockname()[:2]
    first = sockets[0].getsockname()[:2]
    clients: list[socket.socket] = []

    def connect(address: Any) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        client = socket.socket(family)
        client.connect(address)  # the kernel completes it: accepting is the listener's
        clients.append(client)

    async def body(io: Any, _: Any) -> None:
        listener = Listener(sockets, limit=1, io=io)
        held: list[Listener] = []

        async def sleep(seconds: float) -> None:
            await io.sleep_until(io.now() + seconds)

        def start_client(sock: socket.socket, slots: Listener) -> None:
            order.append("v6" if sock.family == socket.AF_INET6 else "v4")
            held.append(slots)
            sock.close()  # its slot stays held until the test releases it

        listener.start(start_client)
        for address in (second, second, first):
            connect(address)
            if held:
                await sleep(0.2)  # no slot: not accepted
                order.append("released")
                held.pop().release()
            async with io.time_limit(5):
                while len(order) < 2 * len(clients) - 1:
                    await sleep(0.005)
        listener.close()

    try:
        on_runtime(runtime, body)
    finally:
        for client in clients:
            client.close()
        for sock in sockets:
            sock.close()
    return order


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_one_slot_serves_whichever_socket_a_connection_comes_to(runtime: str) -> None:
    assert _accepted_in_order(runtime, _two_sockets()) == ["v6", "released", "v6", "released", "v4"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_accept_that_runs_after_the_listener_closed_ends_without_a_word(runtime: str) -> None:
    # At shutdown the listener cancels its tasks and closes its sockets at once; a task already
    # scheduled to run then finds its socket closed (EBADF): that is the close, not a failed accept.
    sockets = listening_sockets("127.0.0.1", 0)
    accepted: list[socket.socket] = []

    async def body(io: Any, _: Any) -> None:
        listener = Listener(sockets, limit=4, io=io)
        listener.close()
        async with io.time_limit(5):
            await listener.accept(sockets[0], lambda sock, slots: accepted.append(sock))

    with LogCapture() as log:
        on_runtime(runtime, body)
    assert accepted == [] and [e for e in log.events() if e["event"] == "accept_failed"] == []
