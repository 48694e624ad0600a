"""How the asyncio adapter reads engine answers: into one buffer per router on asyncio's own loop, plain protocols on uvloop.

(:class:`narwhal_asyncio.engines.BufferedReads`; why: benchmarks/README.md, stop 38.)
Real socket pairs on real loops.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from narwhal_asyncio.engines import BufferedReads, Engines, read_buffer


class _Collect(asyncio.Protocol):
    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.eof = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.got.append(data)

    def eof_received(self) -> bool:
        self.eof.set_result(None)
        return False


def test_connections_sharing_one_buffer_each_get_their_own_bytes() -> None:
    shared = read_buffer()

    class Buffered(_Collect, BufferedReads):
        buffer = shared

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        pairs = [socket.socketpair() for _ in range(2)]
        protocols = []
        for ours, _ in pairs:
            _, protocol = await loop.connect_accepted_socket(Buffered, ours)
            protocols.append(protocol)
        # Interleaved: each read lands in the same buffer the other's read used just before.
        for round_ in range(50):
            for i, (_, theirs) in enumerate(pairs):
                theirs.sendall(bytes([65 + i]) * (1000 + round_))
            await asyncio.sleep(0)
        for _, theirs in pairs:
            theirs.close()
        await asyncio.gather(*(p.eof for p in protocols))
        for ours, _ in pairs:
            ours.close()
        assert all(type(chunk) is bytes for p in protocols for chunk in p.got)
        return [b"".join(p.got) for p in protocols]

    a, b = asyncio.run(main())
    assert a == b"".join(b"A" * (1000 + r) for r in range(50))
    assert b == b"".join(b"B" * (1000 + r) for r in range(50))


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_leg_connections_read_into_the_buffer_on_the_standard_loop_only(loop_name: str) -> None:
    factory = asyncio.new_event_loop if loop_name == "asyncio" else pytest.importorskip("uvloop").new_event_loop

    async def main() -> bool:
        engines = Engines(asyncio.get_running_loop(), lambda event: None, pool_size=1)
        return issubclass(engines._connection, asyncio.BufferedProtocol)  # what Engines._open makes

    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(main()) == (loop_name == "asyncio")
