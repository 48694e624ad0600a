"""The listening sockets both runtimes bind (narwhal_runtime/listening.py)."""

from __future__ import annotations

import errno
import socket

import pytest

from narwhal_runtime.listening import BACKLOG, accept_shortage, listening_sockets


def test_every_address_of_the_host_listens_on_one_port() -> None:
    sockets = listening_sockets("localhost", 0)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1 and ports != {0}
        for sock in sockets:
            assert sock.getblocking() is False
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            if sock.family == socket.AF_INET6:
                assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        with socket.create_connection(("127.0.0.1", ports.pop()), timeout=5):
            pass
    finally:
        for sock in sockets:
            sock.close()
    assert BACKLOG == 0xFFFF


def test_a_port_in_use_raises_and_leaves_nothing_open() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(OSError):
            listening_sockets("127.0.0.1", taken.getsockname()[1])


@pytest.mark.parametrize(("code", "shortage"), [
    (errno.EMFILE, True), (errno.ENFILE, True), (errno.ENOBUFS, True), (errno.ENOMEM, True),
    (errno.ECONNABORTED, False), (errno.EPERM, False),
])
def test_only_a_shortage_of_descriptors_or_memory_pauses_accepting(code: int, shortage: bool) -> None:
    assert accept_shortage(OSError(code, "x")) is shortage
