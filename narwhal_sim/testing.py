"""Simulated engines for tests, the demo and benchmarks.

* :class:`SimThread` runs a :class:`~narwhal_sim.server.SimEngine` on its own
  asyncio loop in a background thread (127.0.0.1, port 0 by default).
* :class:`SimProcess` runs ``python -m narwhal_sim`` as a subprocess, for
  tests that kill and restart an engine (a restart takes the same port).

Both are context managers with the same accessors: ``url``, ``host``,
``port``, ``engine_id``, ``stats()``, ``requests()``, ``faults()``,
``set_faults(...)``, ``reset()``, ``wait_for(predicate)``, ``stop()``.
Neither logs requests unless ``log=`` says so (``.requests()`` has them).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from narwhal_sim.cli import loop_factory
from narwhal_sim.model import Faults
from narwhal_sim.server import SimConfig, SimEngine

__all__ = ["SimThread", "SimProcess", "SimError"]

T = TypeVar("T")

#: The helpers' default ``kv_pull_grace_ms`` at speed > 0. A router's decode_abort
#: sends a decode leg and closes at once; in a busy test run its close may come
#: many milliseconds later (a thread of this process waiting for the GIL, a
#: process waiting for a CPU), and the leg must still count as released.
#: Pass ``kv_pull_grace_ms=0`` when no test needs that.
TEST_PULL_GRACE_MS = 20.0

#: Settings the test helpers use unless told otherwise (``narwhal sim`` defaults to vLLM's):
#: usage carries ``prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``), and the
#: simulator's own ``POST /abort_request`` is served, for tests of Narwhal's ``abort_endpoint`` release.
#: The helpers also advertise their listen host as ``remote_host`` (the command line: ``localhost``,
#: vLLM's default), so every engine-to-engine request names the address the test configured.
TEST_DEFAULTS: dict[str, Any] = {"enable_prompt_tokens_details": True, "abort_request_route": True}

#: Environment variable SimProcess uses to hand ``api_key`` to the child.
API_KEY_ENV = "NARWHAL_SIM_API_KEY"


class SimError(RuntimeError):
    """The simulator did not start, or a control call failed."""


def _as_faults(faults: Faults | Mapping[str, Any] | None, settings: Mapping[str, Any]) -> Faults:
    if isinstance(faults, Faults):
        if settings:
            return attrs.evolve(faults, **settings)
        return faults
    return Faults.from_json({**(faults or {}), **settings})


def _wait_for(
    stats: Callable[[], dict[str, Any]], predicate: Callable[[dict[str, Any]], bool], timeout: float, interval: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        snapshot = stats()
        if predicate(snapshot):
            return snapshot
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met within {timeout} s; last stats: {snapshot}")
        time.sleep(interval)


class SimThread:
    """A simulated engine on a background thread's asyncio loop.

    ``SimThread(role="prefill", speed=50, api_key=None, lease_s=None, seed=0, **options)``
    where ``options`` are further :class:`~narwhal_sim.server.SimConfig`
    fields (``max_num_seqs=4``, ``faults={"error_rate": 1.0}``, ``log="-"``...).
    At speed > 0 ``kv_pull_grace_ms`` defaults to :data:`TEST_PULL_GRACE_MS`
    (20 ms; the command line's default is 2 ms), and :data:`TEST_DEFAULTS` apply; ``lease_s=None`` is the version family's hold. Starts in ``__enter__`` (or :meth:`start`), stops in ``__exit__``.
    """

    def __init__(
        self,
        role: str = "mixed",
        *,
        speed: float = 1.0,
        api_key: str | None = None,
        lease_s: float | None = None,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        loop: str = "auto",
        **options: Any,
    ) -> None:
        faults = options.pop("faults", None)
        if faults is not None:
            options["faults"] = _as_faults(faults, {})
        for name, value in TEST_DEFAULTS.items():
            options.setdefault(name, value)
        options.setdefault("advertise_host", "127.0.0.1" if host in ("0.0.0.0", "::", "") else host)
        if speed > 0:
            options.setdefault("kv_pull_grace_ms", TEST_PULL_GRACE_MS)
        self.config = SimConfig(
            role=role, speed=speed, api_key=api_key, kv_lease_s=lease_s, seed=seed, host=host, port=port, **options
        )
        self.config.check()
        self._loop_kind = loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: SimEngine | None = None
        self._stop_event: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -- lifecycle

    def start(self, timeout: float = 10.0) -> SimThread:
        """Start the engine and return when it listens."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._main, name=f"narwhal-sim-{self.config.role}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise SimError("simulator did not start in time")
        if self._error is not None:
            raise SimError(f"simulator failed to start: {self._error}") from self._error
        return self

    def _main(self) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop_event = asyncio.Event()
            self._engine = SimEngine(self.config)
            await self._engine.start()
            self._ready.set()
            try:
                await self._stop_event.wait()
            finally:
                await self._engine.close()

        try:
            with asyncio.Runner(loop_factory=loop_factory(self._loop_kind)) as runner:
                runner.run(serve())
        except BaseException as exc:  # reported to start()
            self._error = exc
        finally:
            self._ready.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and join the thread (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._loop is not None and self._stop_event is not None and thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._stop_event.set)
            except RuntimeError:
                pass  # loop already closed
        thread.join(timeout)

    def __enter__(self) -> SimThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- accessors

    @property
    def engine(self) -> SimEngine:
        """The engine object; touch it only through :meth:`call` (it lives on another thread)."""
        if self._engine is None:
            raise SimError("simulator not started")
        return self._engine

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return self.engine.url

    @property
    def host(self) -> str:
        return self.engine.host

    @property
    def port(self) -> int:
        return self.engine.port

    @property
    def engine_id(self) -> str:
        """``remote_engine_id`` of this engine."""
        return self.engine.engine_id

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 10.0) -> T:
        """Run ``fn(*args)`` on the engine's loop and return its result."""
        if self._loop is None:
            raise SimError("simulator not started")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future.result(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters and gauges, as ``GET /sim/stats``."""
        return self.call(self.engine.stats)

    def requests(self, path: str | None = None) -> list[dict[str, Any]]:
        """Recorded requests, oldest first; only those to ``path`` when given."""
        records = self.call(self.engine.requests)
        return [r for r in records if path is None or r["path"].split("?")[0] == path]

    def faults(self) -> dict[str, Any]:
        """Current fault settings."""
        return self.call(lambda: self.engine.faults.to_json())

    def set_faults(self, faults: Faults | Mapping[str, Any] | None = None, **settings: Any) -> None:
        """Replace the fault settings (absent keys take their defaults)."""
        self.call(self.engine.set_faults, _as_faults(faults, settings))

    def reset(self) -> None:
        """Zero the counters and forget recorded requests."""
        self.call(self.engine.reset)

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 5.0, interval: float = 0.005
    ) -> dict[str, Any]:
        """Poll :meth:`stats` until ``predicate(stats)``; the stats, or ``TimeoutError``."""
        return _wait_for(self.stats, predicate, timeout, interval)


class SimProcess:
    """``python -m narwhal_sim`` as a subprocess, with the accessors of :class:`SimThread` over HTTP.

    ``SimProcess(role="decode", speed=50, api_key=None, lease_s=None, seed=0, **options)``
    where ``options`` map to flags (``max_num_seqs=4`` → ``--max-num-seqs 4``,
    ``faults={...}`` → fault flags, ``prefix_caching=False`` → ``--no-prefix-caching``,
    ``chunked_prefill=False`` → ``--no-chunked-prefill``);
    ``kv_pull_grace_ms`` defaults to :data:`TEST_PULL_GRACE_MS` at speed > 0, as in :class:`SimThread`.
    :meth:`kill` then :meth:`restart` brings the engine back on the same port.
    """

    def __init__(
        self,
        role: str = "mixed",
        *,
        speed: float = 1.0,
        api_key: str | None = None,
        lease_s: float | None = None,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        log: str = "none",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> None:
        self.role = role
        self.host = host
        self.port = port
        self._api_key = api_key
        self._env = dict(env) if env is not None else None
        args = ["--role", role, "--speed", repr(speed), "--seed", str(seed)]
        if lease_s is not None:
            args += ["--kv-lease-s", repr(lease_s)]
        args += ["--log", log]
        if api_key is not None:
            args += ["--api-key-env", API_KEY_ENV]
        faults = options.pop("faults", None)
        if faults is not None:
            options.update(_as_faults(faults, {}).to_json())
        for name, value in TEST_DEFAULTS.items():
            options.setdefault(name, value)
        options.setdefault("advertise_host", "127.0.0.1" if host in ("0.0.0.0", "::", "") else host)
        if speed > 0:
            options.setdefault("kv_pull_grace_ms", TEST_PULL_GRACE_MS)
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            if name in ("prefix_caching", "chunked_prefill"):
                if not value:
                    args.append("--no-" + name.replace("_", "-"))
            elif value is True:
                args.append(flag)
            elif value is None or value is False:
                continue
            else:
                args += [flag, str(value)]
        self._args = args + list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self.startup: dict[str, Any] = {}
        #: Lines the process wrote to stdout after the startup line (``log="-"``).
        self.output: collections.deque[str] = collections.deque(maxlen=10_000)

    @property
    def url(self) -> str:
        """``http://host:port`` of the running process."""
        return str(self.startup["url"])

    @property
    def engine_id(self) -> str:
        return str(self.startup["engine_id"])

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def start(self, timeout: float = 15.0) -> SimProcess:
        """Spawn the process and wait for its startup line."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        env = dict(os.environ if self._env is None else self._env)
        if self._api_key is not None:
            env[API_KEY_ENV] = self._api_key
        cmd = [sys.executable, "-m", "narwhal_sim", "--listen", f"{self.host}:{self.port}", *self._args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
        self._proc = proc
        lines: concurrent.futures.Future[str] = concurrent.futures.Future()

        def pump() -> None:
            assert proc.stdout is not None
            first = True
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if first:
                    lines.set_result(line)
                    first = False
                else:
                    self.output.append(line)
            if first:
                lines.set_result("")

        threading.Thread(target=pump, name="narwhal-sim-stdout", daemon=True).start()
        try:
            line = lines.result(timeout)
        except concurrent.futures.TimeoutError:
            self.kill()
            raise SimError("simulator process printed no startup line in time") from None
        if not line:
            code = proc.wait(5)
            raise SimError(f"simulator process exited with {code} before listening")
        self.startup = json.loads(line)
        self.port = int(self.startup["port"])
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait; the exit status (0 after a graceful stop)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would: held KV is lost with the process."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def restart(self, timeout: float = 15.0) -> SimProcess:
        """Stop (if running) and start again on the same port."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> SimProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- control over HTTP (the /sim/* routes need no credential)

    def _control(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("content-type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise SimError(f"{method} {path} answered {exc.code}: {exc.read()[:300]!r}") from None

    def stats(self) -> dict[str, Any]:
        """``GET /sim/stats``."""
        return dict(self._control("GET", "/sim/stats"))

    def requests(self, path: str | None = None) -> list[dict[str, Any]]:
        """``GET /sim/requests``, only those to ``path`` when given."""
        records = self._control("GET", "/sim/requests")
        return [r for r in records if path is None or r["path"].split("?")[0] == path]

    def faults(self) -> dict[str, Any]:
        """``GET /sim/faults``."""
        return dict(self._control("GET", "/sim/faults"))

    def set_faults(self, faults: Faults | Mapping[str, Any] | None = None, **settings: Any) -> None:
        """``POST /sim/faults`` (replaces every setting)."""
        self._control("POST", "/sim/faults", _as_faults(faults, settings).to_json())

    def reset(self) -> None:
        """``POST /sim/reset``."""
        self._control("POST", "/sim/reset", {})

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 5.0, interval: float = 0.01
    ) -> dict[str, Any]:
        """Poll :meth:`stats` until ``predicate(stats)``; the stats, or ``TimeoutError``."""
        return _wait_for(self.stats, predicate, timeout, interval)
