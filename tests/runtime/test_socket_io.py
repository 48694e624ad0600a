"""The socket calls both runtimes share (narwhal_runtime/socket_io.py), with each runtime's waits.

Real socket pairs and a real listening socket on 127.0.0.1; each runtime
lends its own waits (its ``IO``, in each adapter's ``io.py``).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from narwhal_runtime.socket_io import connect, receive, send_all

RUNTIMES = ("trio", "asyncio")


def _run(runtime: str, body: Callable[[Any], Awaitable[Any]]) -> Any:
    """``body(waits)`` on ``runtime``, with that runtime's socket waits (its ``IO``)."""
    if runtime == "trio":
        from narwhal_trio.io import IO as TrioIO

        async def trio_main() -> Any:
            async with trio.open_nursery() as nursery:
                return await body(TrioIO(nursery))

        return trio.run(trio_main)
    from narwhal_asyncio.io import IO as AsyncioIO

    async def main() -> Any:
        return await body(AsyncioIO(asyncio.get_running_loop()))

    return asyncio.run(main())


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_megabyte_goes_across_and_the_peers_close_reads_as_empty(runtime: str) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB: more than a socket takes at once

    async def body(waits: Any) -> tuple[bytes, bytes]:
        a, b = _pair()
        received = bytearray()
        with a, b:

            async def read() -> None:
                while len(received) < len(data):
                    received.extend(await receive(b, waits.readable))

            if runtime == "trio":
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read)
                    await send_all(a, data, waits.writable)
            else:
                reader = asyncio.ensure_future(read())
                await send_all(a, data, waits.writable)
                await reader
            a.close()
            return bytes(received), await receive(b, waits.readable)

    received, after_close = _run(runtime, body)
    assert received == data and after_close == b""


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_refused_connect_raises_the_kernels_errno_and_an_open_one_connects(runtime: str) -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: a connect to it is refused
        refused_at = closed.getsockname()

        async def body(waits: Any) -> tuple[int | None, Any]:
            with socket.socket() as sock:
                sock.setblocking(False)
                try:
                    await connect(sock, refused_at, waits.writable)
                except OSError as exc:
                    code = exc.errno
                else:
                    code = None
            with socket.socket() as sock:
                sock.setblocking(False)
                await connect(sock, listening.getsockname(), waits.writable)
                return code, sock.getpeername()

        code, peer = _run(runtime, body)
        assert code == errno.ECONNREFUSED
        assert peer == listening.getsockname()


def test_asyncios_wait_cancelled_after_its_socket_closed_leaves_the_next_sockets_watch_alone() -> None:
    """A closed socket's number is soon another's: the cancelled wait must not stop watching the new one."""
    from narwhal_asyncio.io import IO as AsyncioWaits

    async def main() -> bytes:
        waits = AsyncioWaits(asyncio.get_running_loop())
        a, b = _pair()
        first = asyncio.ensure_future(waits.readable(a))
        await asyncio.sleep(0)  # it watches a
        number = a.fileno()
        waits.close_socket(a)
        b.close()
        c, d = _pair()
        with c, d:
            assert number in (c.fileno(), d.fileno())  # POSIX: the lowest free number comes first
            mine, other = (c, d) if c.fileno() == number else (d, c)
            second = asyncio.ensure_future(waits.readable(mine))
            await asyncio.sleep(0)  # it watches the same number
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            other.send(b"x")
            async with asyncio.timeout(5):
                await second  # still watched: the cancelled wait left it alone
            return mine.recv(1)

    assert asyncio.run(main()) == b"x"
