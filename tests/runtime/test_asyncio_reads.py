"""How the asyncio adapter reads: into one buffer per router on asyncio's own loop, plain protocols on uvloop.

(:class:`narwhal_asyncio.engines.BufferedReads`; why: benchmarks/README.md, stop 38.)
Real socket pairs on real loops.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from narwhal_asyncio.engines import BufferedReads, read_buffer
from narwhal_asyncio.server import Server

from ..harness import make_config


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
def test_the_standard_loop_reads_into_the_buffer_and_uvloop_does_not(loop_name: str, tmp_path: Path) -> None:
    factory = asyncio.new_event_loop if loop_name == "asyncio" else pytest.importorskip("uvloop").new_event_loop
    config = make_config(tmp_path / "journal.jsonl", prefill=("http://127.0.0.1:9",), decode=("http://127.0.0.1:9",),
                         health={"probe_interval_s": 3600.0})

    async def main() -> tuple[bool, bool]:
        server = Server(config)
        address: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(server.serve(started=address.set_result))
        _, writer = await asyncio.open_connection(*await address)
        for _ in range(1000):  # until the server has made the connection's protocol
            if server._clients:
                break
            await asyncio.sleep(0.001)
        (client,) = server._clients
        assert server.engines is not None
        found = isinstance(client, asyncio.BufferedProtocol), issubclass(server.engines._connection, asyncio.BufferedProtocol)
        writer.close()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        return found

    with asyncio.Runner(loop_factory=factory) as runner:
        clients_buffered, legs_buffered = runner.run(main())
    assert clients_buffered == legs_buffered == (loop_name == "asyncio")
