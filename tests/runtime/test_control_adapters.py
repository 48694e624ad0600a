"""Both adapters run a control request the same way (narwhal_runtime/control.py, over narwhal_trio/io.py, narwhal_asyncio/io.py).

Against real loopback sockets: an answer, a refusal (also on a name with
several addresses, and a first address that drops the SYN), a silent
engine, an engine that hangs up, and a ``decode_abort`` release that
writes its raw request and hangs up; and the options of the connection's
socket.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio

from narwhal_core import ControlDone, Event, StartControl
from narwhal_core.config import parse_engine_url
from narwhal_core.events import EngineResolved
from narwhal_runtime.leg_connections import Engines

from ..helpers import on_runtime, tcp_options_in_process

RUNTIMES = ("trio", "asyncio")


def run_control(runtime: str, cmd: StartControl, getaddrinfo: Any = None) -> list[Event]:
    """The events one control request feeds, run on ``runtime`` until its ``ControlDone``.

    ``getaddrinfo``, if given, stands in for the runtime's resolver.
    """
    events: list[Event] = []

    async def body(io: Any, done: Any) -> None:
        def feed(event: Event) -> None:  # synchronous, as the server's
            events.append(event)
            if isinstance(event, ControlDone):
                done.set()

        engines = Engines(io, feed, 1)
        if getaddrinfo is not None:
            io.getaddrinfo = getaddrinfo
        engines.start_control(cmd)
        await done.wait()

    on_runtime(runtime, body)
    return events


class Engine:
    """A one-connection-at-a-time loopback engine running ``serve(conn)`` for each connection."""

    def __init__(self, serve: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received: list[bytes] = []
        self._serve = serve
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                self._serve(conn)

    def close(self) -> None:
        self.listener.close()


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def answer_ok(conn: socket.socket) -> None:
    """An engine's side: read the request, answer 200 with an empty body."""
    read_request(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")


@pytest.fixture
def engine_factory() -> Iterator[Callable[[Callable[[socket.socket], None]], Engine]]:
    engines: list[Engine] = []

    def make(serve: Callable[[socket.socket], None]) -> Engine:
        engines.append(Engine(serve))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def command(host: str, port: int, **changes: Any) -> StartControl:
    address = parse_engine_url(f"http://{host}:{port}", key="engine.prefill")
    fields: dict[str, Any] = dict(
        key="probe-1", engine=address, method="GET", target="/health",
        headers=((b"host", address.authority), (b"authorization", b"Bearer ek-secret")), body=b"", timeout=2.0,
    )
    fields.update(changes)
    return StartControl(**fields)


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_answer_comes_back_with_its_status_and_body(runtime: str, engine_factory: Any) -> None:
    requests: list[bytes] = []

    def serve(conn: socket.socket) -> None:
        requests.append(read_request(conn))
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 17\r\n\r\n{\"released\":true}")

    engine = engine_factory(serve)
    events = run_control(runtime, command("127.0.0.1", engine.port))
    assert events == [ControlDone("probe-1", 200, None, False, b'{"released":true}')]
    assert requests[0].startswith(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n" % engine.port)
    assert b"\r\nauthorization: Bearer ek-secret\r\n" in requests[0]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_refused_connection_is_named_so(runtime: str, host: str) -> None:
    events = run_control(runtime, command(host, free_port()))
    assert events == [ControlDone("probe-1", None, "connection refused", False)]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_probe_that_resolves_feeds_the_addresses_first(runtime: str) -> None:
    events = run_control(runtime, command("localhost", free_port(), resolve=True))
    assert len(events) == 2 and isinstance(events[0], EngineResolved)
    assert "127.0.0.1" in events[0].addresses
    assert events[1] == ControlDone("probe-1", None, "connection refused", False)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_silent_engine_times_out_once_connected(runtime: str, engine_factory: Any) -> None:
    release = threading.Event()

    def serve(conn: socket.socket) -> None:
        read_request(conn)
        release.wait(5)

    engine = engine_factory(serve)
    try:
        events = run_control(runtime, command("127.0.0.1", engine.port, timeout=0.3))
    finally:
        release.set()
    assert events == [ControlDone("probe-1", None, "timeout")]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_engine_that_hangs_up_mid_answer_says_so(runtime: str, engine_factory: Any) -> None:
    def serve(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")

    engine = engine_factory(serve)
    events = run_control(runtime, command("127.0.0.1", engine.port))
    assert events == [
        ControlDone("probe-1", None, "engine closed the connection before the response was complete")
    ]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_decode_abort_writes_the_raw_request_and_hangs_up(runtime: str, engine_factory: Any) -> None:
    raw = b"POST /v1/completions HTTP/1.1\r\nhost: e\r\ncontent-length: 2\r\n\r\n{}"
    received: list[bytes] = []
    got = threading.Event()

    def serve(conn: socket.socket) -> None:
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        received.append(data)  # read to EOF: the router hung up
        got.set()

    engine = engine_factory(serve)
    events = run_control(runtime, command("127.0.0.1", engine.port, drop_after_send=True, data=raw))
    assert events == [ControlDone("probe-1", None)]
    assert got.wait(5) and received == [raw]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_connection_that_never_opens_is_a_connect_timeout(runtime: str) -> None:
    # A listener whose queue is full drops the next SYN: the connect hangs.
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        events = run_control(runtime, command("127.0.0.1", listener.getsockname()[1], timeout=0.3))
    assert events == [ControlDone("probe-1", None, "connect timeout")]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_probe_connects_to_an_address_it_reported(runtime: str, engine_factory: Any) -> None:
    # The name is resolved once; the router hears those addresses and the connection goes to one
    # of them, on both runtimes (trio's used to resolve the name again, by its own resolver).
    engine = engine_factory(answer_ok)
    answers = [("127.0.0.1", engine.port), ("127.0.0.2", engine.port)]  # a second lookup: nobody listens there
    asked: list[str] = []

    async def getaddrinfo(host: str, port: int, *, type: int) -> list[Any]:
        asked.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", answers[len(asked) - 1])]

    cmd = command("engine.invalid", engine.port, resolve=True)  # (.invalid: no system resolver knows it)
    events = run_control(runtime, cmd, getaddrinfo)
    assert events == [
        EngineResolved(cmd.engine, ("127.0.0.1",)),
        ControlDone("probe-1", 200, None, False, b""),
    ]
    assert asked == ["engine.invalid"]



@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_probe_goes_on_to_the_next_address_when_one_drops_the_syn(runtime: str, engine_factory: Any) -> None:
    # Each address but the last gets its share of the timeout (control.connect_first); before,
    # the first one held the connect until the whole timeout expired: "connect timeout".
    engine = engine_factory(answer_ok)
    with socket.socket() as dropping, socket.socket() as filler:
        dropping.bind(("127.0.0.1", 0))
        dropping.listen(0)
        filler.connect(dropping.getsockname())  # its queue is full: the next SYN is dropped

        async def getaddrinfo(host: str, port: int, *, type: int) -> list[Any]:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", address)
                    for address in (dropping.getsockname(), ("127.0.0.1", engine.port))]

        events = run_control(runtime, command("engine.invalid", engine.port, timeout=1.0), getaddrinfo)
    assert events == [ControlDone("probe-1", 200, None, False, b"")]

def test_asyncio_names_a_refusal_on_every_address_as_one() -> None:
    # Python 3.11's create_connection would say "Multiple exceptions: ..." without an errno.
    from narwhal_asyncio.io import IO as AsyncioWaits
    from narwhal_runtime.control import connect_first
    from narwhal_runtime.engine_probe import describe_failure

    infos = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", free_port())) for _ in range(2)]

    async def main() -> str:
        try:
            waits = AsyncioWaits(asyncio.get_running_loop())
            await connect_first(infos, waits.writable, asyncio.timeout, 5.0)
        except OSError as exc:
            return describe_failure(exc)
        raise AssertionError("connected")

    assert asyncio.run(main()) == "connection refused"


def test_a_resolver_answer_without_an_address_is_a_failed_connect() -> None:
    from narwhal_asyncio.io import IO as AsyncioWaits
    from narwhal_runtime.control import connect_first

    async def main() -> None:
        await connect_first([], AsyncioWaits(asyncio.get_running_loop()).writable, asyncio.timeout, 1.0)

    with pytest.raises(OSError, match="resolved to no address"):  # (not ExceptionGroup's ValueError)
        asyncio.run(main())

def run_until_shutdown(runtime: str, cmd: StartControl, reached: threading.Event) -> list[Event]:
    """The events a control request feeds when the runtime shuts down once the engine has its request."""
    events: list[Event] = []

    async def body(io: Any, _: Any) -> None:
        Engines(io, events.append, 1).start_control(cmd)  # feeds synchronously, as the server's
        in_thread = trio.to_thread.run_sync if runtime == "trio" else asyncio.to_thread
        await in_thread(reached.wait, 5)
        # then the tasks are cancelled, as at the server's end (narwhal_runtime/serving.py)

    on_runtime(runtime, body)
    return events


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_request_stopped_by_shutdown_is_fed_as_cancelled(runtime: str, engine_factory: Any) -> None:
    reached, release = threading.Event(), threading.Event()

    def serve(conn: socket.socket) -> None:
        read_request(conn)
        reached.set()
        release.wait(5)

    engine = engine_factory(serve)
    try:
        events = run_until_shutdown(runtime, command("127.0.0.1", engine.port, timeout=5.0), reached)
    finally:
        release.set()
    assert reached.is_set()
    assert events == [ControlDone("probe-1", None, "cancelled")]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_control_connection_carries_the_engine_socket_options(runtime: str, engine_factory: Any) -> None:
    # (TCP_NODELAY, TCP_NOTSENT_LOWAT) of the router's side, read while it waits for the answer:
    # the same as a leg's connection (narwhal_runtime/socket_options.py), on both runtimes.
    seen: list[tuple[int, int]] = []

    def serve(conn: socket.socket) -> None:
        read_request(conn)
        router_side = conn.getpeername()[:2]
        seen.extend((nodelay, lowat) for local, _, nodelay, lowat in tcp_options_in_process() if local == router_side)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    engine = engine_factory(serve)
    assert run_control(runtime, command("127.0.0.1", engine.port)) == [ControlDone("probe-1", 200, None, False, b"")]
    assert seen == [(1, 0)]
