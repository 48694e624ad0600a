"""The listening sockets both runtimes bind, and what their listeners decide (narwhal_runtime/listening.py)."""

from __future__ import annotations

import errno
import math
import socket

import pytest

from narwhal_runtime import listening
from narwhal_runtime.listening import (
    ACCEPT_RETRY_S, BACKLOG, CONNECTION_ERRNOS, SHORTAGE_ERRNOS, AcceptGate, accept_error, listening_sockets,
)


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


@pytest.mark.parametrize("code", [
    errno.ECONNABORTED, errno.ECONNRESET, errno.EPERM, errno.EPROTO, errno.ETIMEDOUT, errno.ENETDOWN,
    errno.ENETUNREACH, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENONET, errno.ENOPROTOOPT, errno.EOPNOTSUPP,
])
def test_a_connections_own_failure_is_skipped_without_a_word(code: int, monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    monkeypatch.setattr(listening, "log_event", lambda event, **fields: lines.append(event))
    assert accept_error(OSError(code, "x")) == 0.0
    assert lines == []


@pytest.mark.parametrize(("code", "shortage"), [
    (errno.EMFILE, True), (errno.ENFILE, True), (errno.ENOBUFS, True), (errno.ENOMEM, True),
    (errno.EINVAL, False), (errno.EBADF, False), (None, False),
])
def test_anything_else_logs_one_line_and_pauses(code: int | None, shortage: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(listening, "log_event", lambda event, **fields: lines.append((event, fields)))
    exc = OSError("x") if code is None else OSError(code, "x")
    assert accept_error(exc) == ACCEPT_RETRY_S > 0
    assert lines == [("accept_failed", {"error": str(exc), "shortage": shortage})]


def test_trios_silent_errnos_are_all_a_connections_own() -> None:
    # The same list trio's SocketListener retries without a word: nothing it hides is logged here.
    import trio._highlevel_socket

    ignorable = getattr(trio._highlevel_socket, "_ignorable_accept_errnos", None)
    if ignorable is None:
        pytest.skip("this trio keeps its list elsewhere")
    assert set(ignorable) == CONNECTION_ERRNOS
    assert not CONNECTION_ERRNOS & SHORTAGE_ERRNOS


# ------------------------------------------------------------ the listener's decisions (AcceptGate)


def test_the_gate_closes_on_the_last_slot_and_opens_when_one_comes_back() -> None:
    gate = AcceptGate(2)
    assert not gate.full
    assert gate.accepted() is False and not gate.full
    assert gate.accepted() is True and gate.full  # the last slot: stop accepting
    assert gate.released() is True and not gate.full  # accepting goes on
    assert gate.released() is False  # it never stopped for this one
    assert (gate.held, gate.full) == (0, False)


def test_a_gate_of_no_slot_accepts_nothing() -> None:
    assert AcceptGate(0).full


def test_a_connections_own_failure_does_not_stop_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listening, "log_event", lambda event, **fields: None)
    gate = AcceptGate(1)
    assert gate.failed(OSError(errno.ECONNABORTED, "x"), 100.0) == 0.0
    assert gate.resumes == -math.inf and gate.held == 0  # a failed accept holds no slot


def test_any_other_failure_stops_every_socket_of_the_gate_for_the_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    monkeypatch.setattr(listening, "log_event", lambda event, **fields: lines.append(event))
    gate = AcceptGate(1)
    assert gate.failed(OSError(errno.EMFILE, "x"), 100.0) == ACCEPT_RETRY_S
    assert gate.resumes == 100.0 + ACCEPT_RETRY_S and lines == ["accept_failed"]
    assert not gate.full and gate.held == 0
