"""Both adapters' listeners hold a connection slot only for a connection, never for a socket that waits.

``ingress.max_connections`` is counted over every listening socket (an
address may resolve to IPv4 and IPv6). With one slot and two sockets, a
connection to either is accepted; once it holds the slot, the next waits
in the backlog until it is released (the shared loop,
narwhal_runtime/listening.py, with each runtime's waits: narwhal_trio/listener.py,
narwhal_asyncio/listener.py).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import trio

from narwhal_runtime.listening import listening_sockets

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

    try:
        if runtime == "trio":
            from narwhal_runtime.listening import Listener
            from narwhal_trio.listener import listener as trio_listener, serve

            async def main() -> None:
                listener = trio_listener(sockets, limit=1)
                held: list[Listener] = []

                def start_client(sock: socket.socket, slots: Listener) -> None:
                    order.append("v6" if sock.family == socket.AF_INET6 else "v4")
                    held.append(slots)
                    sock.close()  # its slot stays held until the test releases it

                async with trio.open_nursery() as nursery:
                    scope = await nursery.start(serve, listener, start_client)
                    for address in (second, second, first):
                        connect(address)
                        if held:
                            await trio.sleep(0.2)  # no slot: not accepted
                            order.append("released")
                            held.pop().release()
                        with trio.fail_after(5):
                            while len(order) < 2 * len(clients) - 1:
                                await trio.sleep(0.005)
                    scope.cancel()

            trio.run(main)
        else:
            from narwhal_asyncio.listener import Listener as AsyncioListener

            async def amain() -> None:
                held: list[Any] = []

                def start_client(sock: socket.socket, slots: Any) -> None:
                    order.append("v6" if sock.family == socket.AF_INET6 else "v4")
                    held.append(slots)
                    sock.close()  # its slot stays held until the test releases it

                listener = AsyncioListener(asyncio.get_running_loop(), sockets, start_client, limit=1)
                for address in (second, second, first):
                    connect(address)
                    if held:
                        await asyncio.sleep(0.2)  # no slot: not accepted
                        order.append("released")
                        held.pop().release()
                    async with asyncio.timeout(5):
                        while len(order) < 2 * len(clients) - 1:
                            await asyncio.sleep(0.005)
                listener.close()

            asyncio.run(amain())
    finally:
        for client in clients:
            client.close()
        for sock in sockets:
            sock.close()
    return order


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_one_slot_serves_whichever_socket_a_connection_comes_to(runtime: str) -> None:
    assert _accepted_in_order(runtime, _two_sockets()) == ["v6", "released", "v6", "released", "v4"]
