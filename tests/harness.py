"""End-to-end harness: a real router on loopback, on the runtime a test names.

The router runs on its own event loop in a background thread — ``trio.run``
for the trio runtime, the standard library's asyncio loop for the asyncio
one (what a plain ``pip install`` serves with; ``narwhal serve``
subprocesses, in the tests that start them, run uvloop when it is installed,
as the test extra installs it: so both loops are exercised) — so every
end-to-end test is a plain synchronous test that talks
to it over real sockets with real clients (httpx, the ``openai`` package,
raw sockets). Each loop records which async library actually ran it
(:attr:`RouterThread.loop_library`), so a test can prove the runtime.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import attrs
import sniffio
import trio

import narwhal_runtime.log
from narwhal_runtime.app import build_router
from narwhal_core.discovery_config import DiscoveryConfig
from narwhal_core.tenants_config import TenantsConfig
from narwhal_core import Config
from narwhal_core.config import (
    AdmissionConfig,
    EngineConfig,
    HealthConfig,
    IngressConfig,
    JournalConfig,
    ModelConfig,
    RetryConfig,
    RoutingConfig,
    ShutdownConfig,
    TracingConfig,
)

from .helpers import ALIAS, MODEL

T = TypeVar("T")

RUNTIMES = ("trio", "asyncio")


def make_config(
    journal: str | os.PathLike[str],
    *,
    prefill: tuple[str, ...] = (),
    decode: tuple[str, ...] = (),
    **sections: Mapping[str, Any],
) -> Config:
    """A test config: loopback on port 0, fast probes, the given engines.

    ``sections`` maps a section name (``ingress``, ``engine``, ``admission``,
    ``retry``, ``health``, ``journal``, ``shutdown``, ``routing``, ``discovery``, ``model``, ``tracing``,
    ``tenants``) to keyword overrides for it (``tenants``: none, no such section).
    """
    def section(cls: type, section_name: str, **defaults: Any) -> Any:
        return cls(**{**defaults, **sections.get(section_name, {})})

    return Config(
        model=section(ModelConfig, "model", name=MODEL, aliases=(ALIAS,)),
        ingress=section(IngressConfig, "ingress", listen="127.0.0.1:0"),
        engine=section(EngineConfig, "engine", prefill=prefill, decode=decode),
        admission=section(AdmissionConfig, "admission"),
        retry=section(RetryConfig, "retry", backoff_base_s=0.01, backoff_max_s=0.05),
        health=section(HealthConfig, "health", probe_interval_s=0.2, probe_timeout_s=1.0),
        journal=section(JournalConfig, "journal", path=os.fspath(journal), fsync="never"),
        shutdown=section(ShutdownConfig, "shutdown", grace_s=10.0),
        routing=section(RoutingConfig, "routing"),
        discovery=section(DiscoveryConfig, "discovery"),
        tracing=section(TracingConfig, "tracing"),
        tenants=section(TenantsConfig, "tenants") if "tenants" in sections else None,
    )


class RouterThread:
    """A router serving on its own loop in a background thread."""

    def __init__(self, config: Config, runtime: str = "trio", *, env: Mapping[str, str] | None = None,
                 uvloop: bool = False) -> None:  # fmt: skip
        if runtime not in RUNTIMES:
            raise ValueError(runtime)
        self.config = config
        self.runtime = runtime
        self.env = env
        #: asyncio only: run the loop `narwhal serve` runs (uvloop where installed), not the standard one.
        self.uvloop = uvloop
        self.loop_library: str | None = None
        self.address: tuple[str, int] | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # lifecycle

    def start(self, timeout: float = 15.0) -> RouterThread:
        self._thread = threading.Thread(target=self._main, name=f"router-{self.runtime}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("router did not start")
        if self._error is not None:
            raise self._error
        # The router probes every engine at start and /ready waits for their
        # answers: let the first probes finish (a dead engine's fails fast, or
        # within health.probe_timeout_s), so a test starts from settled health.
        deadline = time.monotonic() + self.config.health.probe_timeout_s + 5.0
        while not self.statistics().engines_probed and time.monotonic() < deadline:
            time.sleep(0.005)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        """Graceful shutdown (as on SIGTERM); wait for the loop to finish."""
        if self._thread is None or not self._thread.is_alive():
            return
        self.call_soon(lambda: self._server.serving.shutdown())
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("router did not stop")

    def __enter__(self) -> RouterThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self.address is not None
        return f"http://{self.address[0]}:{self.address[1]}"

    @property
    def port(self) -> int:
        assert self.address is not None
        return self.address[1]

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # calls into the loop thread

    def call_soon(self, fn: Callable[[], Any]) -> None:
        if self.runtime == "trio":
            assert self._trio_token is not None
            self._trio_token.run_sync_soon(fn)
        else:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(fn)

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``fn`` on the router's loop thread and return its result."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # pragma: no cover - surfaced below
                box["error"] = exc
            done.set()

        self.call_soon(run)
        if not done.wait(timeout):
            raise TimeoutError("router loop did not answer")
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]

    @property
    def server(self) -> Any:
        """The runtime's ``Server`` (read its plain counters only; call into it with :meth:`call`)."""
        return self._server

    def statistics(self) -> Any:
        return self.call(lambda: self._server.serving.router.statistics())

    def wait_idle(self, timeout: float = 10.0) -> Any:
        """Wait until no request, leg or control (other than probes) is pending; return the statistics."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.statistics()
            if stats.requests == 0 and stats.legs == 0 and stats.inflight == 0 and stats.queued == 0:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"router not idle: {stats}")
            time.sleep(0.01)

    # the loop

    def _main(self) -> None:
        try:
            if self.runtime == "trio":
                trio.run(self._trio_main)
            else:
                self._asyncio_run()
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _trio_main(self) -> None:
        from narwhal_trio.server import Server

        self.loop_library = sniffio.current_async_library()
        self._trio_token = trio.lowlevel.current_trio_token()
        router = build_router(self.config, now=trio.current_time(), env=self.env)
        self._server = Server(self.config, router=router)
        async with trio.open_nursery() as nursery:
            self.address = await nursery.start(self._server.serve)
            self._ready.set()

    def _asyncio_run(self) -> None:
        if self.uvloop:
            from narwhal_asyncio.server import new_event_loop

            loop = new_event_loop()
        else:
            loop = asyncio.new_event_loop()  # the standard loop, uvloop installed or not
        try:
            loop.run_until_complete(self._asyncio_main())
        finally:
            loop.close()

    async def _asyncio_main(self) -> None:
        from narwhal_asyncio.server import Server

        self.loop_library = sniffio.current_async_library()
        self._loop = asyncio.get_running_loop()
        router = build_router(self.config, now=self._loop.time(), env=self.env)
        self._server = Server(self.config, router=router)
        started: asyncio.Future[tuple[str, int]] = self._loop.create_future()
        serving = asyncio.ensure_future(self._server.serve(started=started.set_result))
        self.address = await started
        self._ready.set()
        await serving


@attrs.define
class Fleet:
    """The simulated engines of a test."""

    prefill: list[Any]
    decode: list[Any]

    @property
    def prefill_urls(self) -> tuple[str, ...]:
        return tuple(e.url for e in self.prefill)

    @property
    def decode_urls(self) -> tuple[str, ...]:
        return tuple(e.url for e in self.decode)

    def all(self) -> Iterator[Any]:
        yield from self.prefill
        yield from self.decode


# ------------------------------------------------------------- process log


class _LockedBytes(io.RawIOBase):
    def __init__(self) -> None:
        self._data = bytearray()
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        with self._lock:
            self._data += bytes(b)
        return len(b)

    def getvalue(self) -> bytes:
        with self._lock:
            return bytes(self._data)


class LogCapture:
    """The router's process log (``narwhal_runtime.log``) captured in memory, thread-safely."""

    def __init__(self) -> None:
        self.stream = _LockedBytes()

    def __enter__(self) -> LogCapture:
        narwhal_runtime.log.set_stream(self.stream)  # type: ignore[arg-type]
        return self

    def __exit__(self, *exc: object) -> None:
        narwhal_runtime.log.set_stream(None)

    def text(self) -> str:
        return self.stream.getvalue().decode("utf-8", "replace")

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.text().splitlines() if line.strip()]
