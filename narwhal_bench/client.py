"""The socket side of ``narwhal bench``: replay a workload against an OpenAI-compatible endpoint.

Raw asyncio protocols (uvloop when installed) and httptools parsing
(:class:`narwhal_bench.reader.ResponseReader`), a pool of keep-alive
connections, one timestamp per read: the client costs a few microseconds per
streamed event, so it is not what a benchmark measures. Engine metrics are
scraped with httpx.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import orjson

from narwhal_bench.reader import ResponseReader, request_bytes
from narwhal_bench.stats import RequestResult, parse_prometheus
from narwhal_bench.trace import PromptSynth, TraceRequest

__all__ = ["Target", "request_body", "finish_result", "replay", "run_replay", "scrape_metrics", "Progress"]


@attrs.frozen(kw_only=True)
class Target:
    """Where and how requests are sent."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    api_key: str | None = None
    stream: bool = True
    timeout_s: float = 600.0
    #: Extra request headers, (name, value) in order: e.g. the client header a trusted proxy would set.
    headers: tuple[tuple[str, str], ...] = ()
    #: ``raw`` (this module's sockets) or ``openai`` (the SDK: :mod:`narwhal_bench.sdk`).
    client: str = "raw"

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("/chat/completions")

    def address(self) -> tuple[str, str, int, bool, str]:
        """(scheme, host, port, tls, Host header)."""
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base URL must be http://HOST[:PORT] or https://..., got {self.base_url!r}")
        tls = url.scheme == "https"
        port = url.port or (443 if tls else 80)
        return url.scheme, url.hostname, port, tls, url.netloc

    def path(self) -> str:
        prefix = urllib.parse.urlsplit(self.base_url).path.rstrip("/")
        return prefix + "/" + self.endpoint.lstrip("/")


def request_body(request: TraceRequest, prompt: str | list[int], target: Target) -> bytes:
    """The JSON body of one request: exactly ``output_length`` tokens, EOS ignored, greedy."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": request.output_length,
                            "min_tokens": request.output_length, "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    if target.chat:
        if not isinstance(prompt, str):
            raise ValueError("token-id prompts need /v1/completions")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if target.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def finish_result(result: RequestResult, reader: ResponseReader, sent: float, ended: float) -> RequestResult:
    """Fill ``result`` from a finished (or broken) reader; times are absolute, on one clock."""
    result.status = reader.status
    times = reader.token_times
    if times:
        result.ttft_s = times[0] - sent
        result.itl_s = [b - a for a, b in zip(times, times[1:])]
    result.output_tokens = len(times)
    result.cached_tokens = reader.cached_tokens
    # End to end: to the read that completed the answer (its last byte), else to when we gave up.
    result.e2e_s = (reader.done_at if reader.complete and reader.done_at is not None else ended) - sent
    if not reader.complete and result.error is None:
        result.error = "connection closed before the answer ended" if reader.status else "no answer"
    if result.error is None and reader.error is not None:
        result.error = reader.error
    if result.error is None and reader.status != 200:
        result.error = f"HTTP {reader.status}"
    result.ok = result.error is None and bool(times)
    if result.error is None and not times:
        result.error = "no output tokens"
    return result


class Progress:
    """A plain-text progress bar on a stream (stderr): redrawn in place on a terminal, else a line every 10 s."""

    def __init__(self, total: int, *, stream: Any = None, width: int = 30, label: str = "") -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.label = label
        self.done = 0
        self.errors = 0
        self._last = 0.0
        self._start: float | None = None

    def update(self, *, ok: bool, now: float) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        if self._start is None:
            self._start = now
        interval = 0.25 if self.tty else 10.0
        if now - self._last >= interval or self.done == self.total:
            self._last = now
            self.draw(now)

    def line(self, now: float) -> str:
        filled = int(self.width * self.done / self.total) if self.total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - (self._start or now)
        return f"{self.label}[{bar}] {self.done}/{self.total} done, {self.errors} errors, {elapsed:.1f} s"

    def draw(self, now: float) -> None:
        text = self.line(now)
        if self.tty:
            self.stream.write("\r" + text + ("\n" if self.done == self.total else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def start(self, now: float) -> None:
        self._start = now


class _Conn(asyncio.Protocol):
    __slots__ = ("transport", "reader", "waiter", "lost", "clock")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader: ResponseReader | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.lost = False
        self.clock = clock

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        if reader is None:
            return
        try:
            reader.feed(data, self.clock())
        except ValueError as exc:
            reader.error = str(exc)
            self._wake()
            return
        if reader.complete:
            self._wake()

    def eof_received(self) -> bool:
        if self.reader is not None:
            self.reader.eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _Pool:
    def __init__(self, target: Target, clock: Callable[[], float]) -> None:
        self.target = target
        _, self.host, self.port, tls, self.authority = target.address()
        self.ssl = ssl.create_default_context() if tls else None
        self.idle: list[_Conn] = []
        self.clock = clock

    async def get(self) -> _Conn:
        while self.idle:
            conn = self.idle.pop()
            if not conn.lost:
                return conn
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Conn(self.clock), self.host, self.port, ssl=self.ssl)
        return conn

    def put(self, conn: _Conn, reusable: bool) -> None:
        if reusable and not conn.lost:
            self.idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


async def _one(pool: _Pool, request: TraceRequest, body: bytes, result: RequestResult, origin: float) -> None:
    target = pool.target
    data = request_bytes(pool.authority, target.path(), body, api_key=target.api_key, extra=target.headers)
    reader = ResponseReader()
    sent = pool.clock()
    result.sent_s = sent - origin
    conn: _Conn | None = None
    try:
        conn = await pool.get()
        loop = asyncio.get_running_loop()
        conn.reader = reader
        conn.waiter = loop.create_future()
        assert conn.transport is not None
        conn.transport.write(data)
        await asyncio.wait_for(conn.waiter, target.timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    ended = pool.clock()
    finish_result(result, reader, sent, ended)
    if conn is not None:
        conn.reader = None
        conn.waiter = None
        pool.put(conn, reader.complete and reader.keep_alive and result.error is None)


async def replay(requests: Sequence[TraceRequest], target: Target, *, synth: PromptSynth,
                 concurrency: int = 0, progress: Progress | None = None) -> list[RequestResult]:  # fmt: skip
    """Send every request at its arrival time (later if ``concurrency`` requests are already out)."""
    clock = time.perf_counter
    sdk = None
    if target.client == "openai":
        from narwhal_bench.sdk import SdkSender

        sdk = SdkSender(target, clock)
    pool = _Pool(target, clock)
    results = [RequestResult(index=r.index, scheduled_s=r.arrival_s, input_length=r.input_length,
                             output_length=r.output_length) for r in requests]  # fmt: skip
    gate = asyncio.Semaphore(concurrency) if concurrency > 0 else None
    tasks: set[asyncio.Task[None]] = set()

    async def run(request: TraceRequest, result: RequestResult, body: Any) -> None:
        try:
            if sdk is not None:
                await sdk.send(body, result, origin)
            else:
                await _one(pool, request, body, result, origin)
        finally:
            if gate is not None:
                gate.release()
            if progress is not None:
                progress.update(ok=result.ok, now=clock())

    origin = clock()
    if progress is not None:
        progress.start(origin)
    try:
        for request, result in zip(requests, results):
            prompt = synth.prompt(request)
            body = sdk.arguments(prompt, request.output_length) if sdk else request_body(request, prompt, target)
            delay = origin + request.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is not None:
                await gate.acquire()
            task = asyncio.get_running_loop().create_task(run(request, result, body))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks))
    finally:
        pool.close()
        if sdk is not None:
            await sdk.close()
    return results


def run_replay(requests: Sequence[TraceRequest], target: Target, *, synth: PromptSynth,
               concurrency: int = 0, progress: Progress | None = None) -> list[RequestResult]:  # fmt: skip
    """:func:`replay` on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is optional
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(replay(requests, target, synth=synth, concurrency=concurrency, progress=progress))


def scrape_metrics(urls: Sequence[str], *, timeout_s: float = 5.0) -> dict[str, dict[str, float]]:
    """``GET /metrics`` of each engine URL (a URL not ending in ``/metrics`` gets it appended)."""
    import httpx

    out: dict[str, dict[str, float]] = {}
    with httpx.Client(timeout=timeout_s) as client:
        for url in urls:
            full = url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
            answer = client.get(full)
            answer.raise_for_status()
            out[url] = parse_prometheus(answer.text)
    return out
