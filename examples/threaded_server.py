"""Narwhal's core driven by a plain-threads server: neither trio nor asyncio.

This example embeds ``narwhal_core`` in the standard library's
``socketserver``: one thread per client connection, one per engine leg, one
for the timer. The router is not thread-safe, so every call into it — and
the execution of the commands it returns — happens under one lock; blocking
socket writes are done after the lock is released, in command order per
connection. It serves the completion routes (and every other route of the
core) against any PD fleet, e.g. the engine simulator::

    narwhal sim --role prefill --listen 127.0.0.1:8100 &
    narwhal sim --role decode --listen 127.0.0.1:8200 &
    python examples/threaded_server.py --listen 127.0.0.1:8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

It is a teaching example, not a production server: no graceful shutdown
signals, no connection pooling, no fsync policy. See ``docs/embedding.md``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import secrets
import socket
import socketserver
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Hashable
from typing import Any

from narwhal_core import (
    Authenticator,
    CancelLeg,
    ClientConnected,
    ClientData,
    ClientGone,
    CloseClient,
    Config,
    ControlDone,
    Event,
    FinishLeg,
    LegData,
    LegFailed,
    Log,
    RidSource,
    Router,
    ShutdownComplete,
    StartControl,
    StartLeg,
    Transmit,
    WriteJournal,
    local_failure,
)
from narwhal_core.config import EngineConfig, IngressConfig, JournalConfig, ModelConfig


class Embedded:
    """The glue: one router, one lock, and the sockets its commands name."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.router = Router(
            config,
            rid_source=RidSource(secrets.token_hex(5)),
            authenticator=Authenticator.from_config(config.ingress, None),
            wall_offset=time.time() - time.monotonic(),
            now=time.monotonic(),
        )
        self.clients: dict[Hashable, socket.socket] = {}
        self.legs: dict[str, socket.socket] = {}
        self.journal = open(config.journal.path, "ab", buffering=0)  # noqa: SIM115
        self.wake = threading.Event()
        self.stopped = threading.Event()
        with self.lock:
            writes = self._drain()  # the router asks for a first probe of every engine at once
        self._write(writes)
        threading.Thread(target=self._timer, daemon=True).start()

    def feed(self, event: Event) -> None:
        """Give the router one event and carry out what it asks."""
        with self.lock:
            self.router.receive(event, now=time.monotonic())
            writes = self._drain()
        self._write(writes)

    def _drain(self) -> list[tuple[socket.socket, bytes | None]]:
        # Runs under the lock. Socket writes are returned, in order, to be done
        # after the lock is released; everything else happens here.
        writes: list[tuple[socket.socket, bytes | None]] = []
        while (cmd := self.router.next_output()) is not None:
            if isinstance(cmd, Transmit):
                sock = self.clients.get(cmd.conn)
                if sock is not None:
                    writes.append((sock, cmd.data))
            elif isinstance(cmd, CloseClient):
                sock = self.clients.pop(cmd.conn, None)
                if sock is not None:
                    writes.append((sock, None))
            elif isinstance(cmd, WriteJournal):
                self.journal.write(cmd.line)
            elif isinstance(cmd, StartLeg):
                threading.Thread(target=self._leg, args=(cmd,), daemon=True).start()
            elif isinstance(cmd, (CancelLeg, FinishLeg)):
                leg = self.legs.pop(cmd.leg, None)
                if leg is not None:
                    try:
                        leg.shutdown(socket.SHUT_RDWR)  # wakes the leg thread's recv
                    except OSError:
                        pass
            elif isinstance(cmd, StartControl):
                threading.Thread(target=self._control, args=(cmd,), daemon=True).start()
            elif isinstance(cmd, Log):
                print(f"narwhal example: {cmd.event} {cmd.fields}", flush=True)
            elif isinstance(cmd, ShutdownComplete):
                self.stopped.set()
        self.wake.set()  # the deadline may have moved
        return writes

    @staticmethod
    def _write(writes: list[tuple[socket.socket, bytes | None]]) -> None:
        for sock, data in writes:
            try:
                if data is None:
                    sock.shutdown(socket.SHUT_RDWR)
                else:
                    sock.sendall(data)
            except OSError:
                pass  # the client's reader thread reports the broken socket

    def _timer(self) -> None:
        while True:
            with self.lock:
                deadline = self.router.get_deadline()
            delay = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            self.wake.wait(min(delay, 1.0))
            self.wake.clear()
            with self.lock:
                deadline = self.router.get_deadline()
                writes = []
                if deadline is not None and deadline <= time.monotonic():
                    self.router.handle_deadline(now=time.monotonic())
                    writes = self._drain()
            self._write(writes)

    def _leg(self, cmd: StartLeg) -> None:
        try:
            sock = socket.create_connection((cmd.engine.host, cmd.engine.port), timeout=cmd.connect_timeout)
        except OSError as exc:
            # Out of file descriptors or ports is Narwhal's shortage, not the engine's fault.
            self.feed(LegFailed(cmd.leg, "local_error" if local_failure(exc) else "connect_failed"))
            return
        sock.settimeout(None)
        with self.lock:
            self.legs[cmd.leg] = sock
        try:
            sock.sendall(cmd.data)
            while True:
                data = sock.recv(65536)
                self.feed(LegData(cmd.leg, data))
                if not data:
                    return
        except OSError:
            # Closed by CancelLeg/FinishLeg (the router no longer cares) or broken.
            self.feed(LegFailed(cmd.leg, "dropped"))
        finally:
            sock.close()

    def _control(self, cmd: StartControl) -> None:
        status: int | None = None
        error: str | None = None
        local = False
        try:
            if cmd.drop_after_send:
                with socket.create_connection((cmd.engine.host, cmd.engine.port), timeout=cmd.timeout) as sock:
                    sock.sendall(cmd.data)
            else:
                request = urllib.request.Request(
                    cmd.engine.url + cmd.target,
                    data=cmd.body or None,
                    method=cmd.method,
                    headers={k.decode(): v.decode() for k, v in cmd.headers if k != b"host"},
                )
                with urllib.request.urlopen(request, timeout=cmd.timeout) as answer:
                    status = answer.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError as exc:
            error = type(exc).__name__
            local = local_failure(exc)
        self.feed(ControlDone(cmd.key, status, error, local))


class _Handler(socketserver.BaseRequestHandler):
    server: _Server
    _handles = itertools.count()

    def handle(self) -> None:
        glue = self.server.glue
        handle = next(self._handles)
        sock: socket.socket = self.request
        with glue.lock:
            glue.clients[handle] = sock
        peer = sock.getpeername()
        glue.feed(ClientConnected(handle, peer[0], peer[1]))
        try:
            while True:
                data = sock.recv(65536)
                glue.feed(ClientData(handle, data))
                if not data:
                    return
        except OSError:
            glue.feed(ClientGone(handle))
        finally:
            with glue.lock:
                glue.clients.pop(handle, None)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], glue: Embedded) -> None:
        self.glue = glue
        super().__init__(address, _Handler)


def serve(config: Config) -> _Server:
    """Bind ``config.ingress.listen`` and return the (not yet serving) server."""
    glue = Embedded(config)
    return _Server((config.ingress.listen_host, config.ingress.listen_port), glue)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:8000")
    parser.add_argument("--prefill", action="append", default=[])
    parser.add_argument("--decode", action="append", required=True)
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    parser.add_argument("--journal", default=os.devnull)
    args = parser.parse_args(argv)
    config = Config(
        model=ModelConfig(name=args.model),
        ingress=IngressConfig(listen=args.listen),
        engine=EngineConfig(prefill=args.prefill, decode=args.decode),
        journal=JournalConfig(path=args.journal),
    )
    server = serve(config)
    print(f"listening on {server.server_address[0]}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__: list[Any] = ["Embedded", "serve", "main"]
