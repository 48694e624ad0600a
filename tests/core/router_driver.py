"""A pure, synchronous driver around a :class:`~narwhal_core.router.Router` (no sockets, no clock).

The scenario tests and the Hypothesis state machine share it. It plays every
part an adapter and the outside world would play, in process and by hand:

* **clients** -- :class:`FakeClient` handles (plain ints) that send raw
  HTTP/1.1 request bytes as ``ClientData``; every byte the router transmits
  to a client is parsed back into responses with h11 (:class:`ClientResponse`),
  so a test reads statuses, headers, JSON bodies and SSE events;
* **the fleet** -- every ``StartLeg`` becomes an :class:`EngineLeg` whose
  request bytes are parsed with h11; a test answers it with scripted raw HTTP
  responses (a prefill 200 with valid ``kv_transfer_params`` naming the
  engine's host, a decode 200 in JSON or as an SSE stream, 4xx, 5xx, an
  answer without KV params, garbage, a dropped connection, ``LegFailed``);
* **the control executor** -- every ``StartControl`` (health probe, KV
  release) waits in :attr:`Driver.controls` until a test completes it;
  probes may be answered automatically (``auto_probe``);
* **the tokenizer thread** -- every ``TokenizePrompt`` (policy ``kv``, a
  large prompt) waits in :attr:`Driver.tokenizing` until a test completes it
  (:meth:`Driver.complete_tokenize`); by default (``auto_tokenize``) it is
  completed at once with the driver's tokenizer, as a worker thread would;
* **the clock** -- :attr:`Driver.now`, advanced by hand; :meth:`Driver.advance`
  calls ``handle_deadline`` at every deadline on the way, like an adapter's
  one re-armed timer;
* **collectors** -- every command, the journal lines (decoded), logs, legs
  cancelled and finished, ``ShutdownComplete``.

:meth:`Driver.check_invariants` states what must hold after every step (and,
with ``final=True``, once everything has been drained); the scenario tests
call it at their end and the state machine after every rule.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from typing import Any, Literal

import attrs
import h11

from narwhal_core import (
    CancelLeg,
    ClientConnected,
    ClientData,
    ClientGone,
    ClientStalled,
    CloseClient,
    Command,
    Config,
    ControlDone,
    EnginesChanged,
    Event,
    FinishLeg,
    FleetChanged,
    LegData,
    LegFailed,
    Log,
    PromptTokenized,
    RidSource,
    Router,
    ShutdownComplete,
    ShutdownRequested,
    StartControl,
    StartLeg,
    TokenizePrompt,
    Transmit,
    WriteJournal,
    parse_backend_id,
)
from narwhal_core.auth import Authenticator
from narwhal_core.config import (
    AdmissionConfig,
    EngineAddress,
    EngineConfig,
    HealthConfig,
    IngressConfig,
    JournalConfig,
    ModelConfig,
    RetryConfig,
    RoutingConfig,
    ShutdownConfig,
)
from narwhal_core.http import CodecLike

from .http_reference import REFERENCE_CODEC

from ..helpers import ALIAS, CHAT, COMPLETIONS, MODEL

__all__ = [
    "MODEL", "ALIAS", "COMPLETIONS", "CHAT", "PREFILL_URLS", "DECODE_URLS", "PROMPT",
    "make_config", "completion_body", "chat_body", "http_request", "json_request",
    "http_response", "chunked_head", "chunk", "LAST_CHUNK", "sse_event",
    "prefill_answer", "decode_answer", "stream_events",
    "FakeClient", "ClientResponse", "SentRequest", "EngineLeg", "Control", "JournalEntry", "Driver",
]

PREFILL_URLS = ("http://10.0.0.1:8100", "http://10.0.0.2:8100")
DECODE_URLS = ("http://10.0.1.1:8200", "http://10.0.1.2:8200")
#: A prompt of about 1 KB, as a real chat turn would be.
PROMPT = (
    "You are a careful assistant. Summarise the following notes about narwhals in three "
    "sentences, keeping every number exact. "
    + "The narwhal (Monodon monoceros) is a toothed whale of the Arctic; males carry a tusk "
    "up to 3.1 m long, a canine with some 10 million nerve endings. " * 6
)

# ------------------------------------------------------------------- config


def make_config(
    *,
    prefill: tuple[str, ...] = PREFILL_URLS,
    decode: tuple[str, ...] = DECODE_URLS,
    model: Mapping[str, Any] | None = None,
    ingress: Mapping[str, Any] | None = None,
    engine: Mapping[str, Any] | None = None,
    admission: Mapping[str, Any] | None = None,
    retry: Mapping[str, Any] | None = None,
    health: Mapping[str, Any] | None = None,
    shutdown: Mapping[str, Any] | None = None,
    routing: Mapping[str, Any] | None = None,
) -> Config:
    """A config built in code: the given engines, loopback ingress, each section's overrides."""
    return Config(
        model=ModelConfig(**{"name": MODEL, "aliases": (ALIAS,), **(model or {})}),
        ingress=IngressConfig(**{"listen": "127.0.0.1:0", **(ingress or {})}),
        engine=EngineConfig(**{"prefill": prefill, "decode": decode, **(engine or {})}),
        admission=AdmissionConfig(**(admission or {})),
        retry=RetryConfig(**(retry or {})),
        health=HealthConfig(**(health or {})),
        journal=JournalConfig(path="-"),
        shutdown=ShutdownConfig(**(shutdown or {})),
        routing=RoutingConfig(**(routing or {})),
    )


# ----------------------------------------------------------- client requests


def completion_body(prompt: str = PROMPT, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """A ``/v1/completions`` body as an OpenAI client would send it."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0.7}
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def chat_body(content: str = PROMPT, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """A ``/v1/chat/completions`` body."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": content},
        ],
        "max_tokens": 64,
    }
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def http_request(
    method: str, target: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()
) -> bytes:
    """The raw bytes of one HTTP/1.1 request with a ``Content-Length`` body."""
    lines = [f"{method} {target} HTTP/1.1", "Host: narwhal.test"]
    lines.extend(f"{name}: {value}" for name, value in headers)
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_request(route: str, payload: Any, headers: Iterable[tuple[str, str]] = ()) -> bytes:
    """A POST of ``payload`` as JSON (``payload`` may already be bytes, for invalid bodies)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return http_request("POST", route, body, [("Content-Type", "application/json"), *headers])


# ------------------------------------------------------------ engine answers


def http_response(
    status: int,
    body: bytes = b"",
    *,
    headers: Iterable[tuple[bytes, bytes]] = ((b"content-type", b"application/json"),),
) -> bytes:
    """A complete engine response with a ``Content-Length`` body."""
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 422: b"Unprocessable Entity",
              429: b"Too Many Requests", 500: b"Internal Server Error", 502: b"Bad Gateway",
              503: b"Service Unavailable"}.get(status, b"Status")
    head = [b"HTTP/1.1 %d %s\r\n" % (status, reason), b"server: fake-vllm\r\n"]
    head.extend(b"%s: %s\r\n" % (name, value) for name, value in headers)
    head.append(b"content-length: %d\r\n\r\n" % len(body))
    return b"".join(head) + body


def chunked_head(status: int = 200, content_type: bytes = b"text/event-stream; charset=utf-8") -> bytes:
    """The head of a chunked engine response (an SSE stream)."""
    return (
        b"HTTP/1.1 %d OK\r\nserver: fake-vllm\r\ncontent-type: %s\r\n"
        b"transfer-encoding: chunked\r\n\r\n" % (status, content_type)
    )


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


def sse_event(payload: Any) -> bytes:
    """``data: <json>`` plus the blank line (``b"[DONE]"`` passes through)."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return b"data: " + data + b"\n\n"


def prefill_answer(
    leg: EngineLeg,
    *,
    owner_suffix: str = "-0",
    cached_tokens: int = 48,
    prompt_tokens: int = 230,
    **kv_overrides: Any,
) -> dict[str, Any]:
    """A vLLM prefill answer with ``kv_transfer_params`` naming the engine's own host.

    vLLM suffixes the request ID it was sent: ``remote_request_id`` is the
    backend ID plus ``owner_suffix`` (the KV owner key of docs/contract.md, "Prefill and decode legs").
    """
    kv = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]],
        "remote_engine_id": f"engine-{leg.engine.port}-{leg.engine.host}",
        "remote_request_id": leg.bid + owner_suffix,
        "remote_host": leg.engine.host,
        "remote_port": 5600 + leg.engine.port % 100,
        "tp_size": 1,
    }
    kv.update(kv_overrides)
    answer = decode_answer(leg.route, text="T", prompt_tokens=prompt_tokens, completion_tokens=1,
                           cached_tokens=cached_tokens, model=leg.body.get("model", MODEL))
    answer["kv_transfer_params"] = kv
    return answer


def decode_answer(
    route: str,
    *,
    text: str = "Narwhals are Arctic whales. Males grow a long tusk. It is a sensory canine.",
    prompt_tokens: int = 230,
    completion_tokens: int = 17,
    cached_tokens: int | None = 224,
    model: str = MODEL,
    rid: str = "0",
) -> dict[str, Any]:
    """A vLLM-shaped non-streaming answer (the decode engine counts the pulled KV as cached)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
    }
    if route == CHAT:
        return {
            "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": 1730000000, "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "reasoning_content": None, "content": text, "tool_calls": []},
                "logprobs": None, "finish_reason": "stop", "stop_reason": None,
            }],
            "usage": usage, "prompt_logprobs": None, "kv_transfer_params": None,
        }
    return {
        "id": f"cmpl-{rid}", "object": "text_completion", "created": 1730000000, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                     "stop_reason": None, "prompt_logprobs": None}],
        "usage": usage, "kv_transfer_params": None,
    }


def stream_events(route: str, *, pieces: int = 3, model: str = MODEL, usage: bool = True) -> list[bytes]:
    """The SSE events of a vLLM stream: text pieces, a usage event, ``[DONE]``."""
    events = []
    for i in range(pieces):
        if route == CHAT:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": f"w{i} "}, "logprobs": None,
                                      "finish_reason": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": f"w{i} ", "logprobs": None, "finish_reason": None, "stop_reason": None}
            obj = "text_completion"
        events.append(sse_event({"id": "s-1", "object": obj, "created": 1730000000, "model": model,
                                 "choices": [choice]}))
    if usage:
        events.append(sse_event({
            "id": "s-1", "object": "chat.completion.chunk" if route == CHAT else "text_completion",
            "created": 1730000000, "model": model, "choices": [],
            "usage": {"prompt_tokens": 230, "total_tokens": 230 + pieces, "completion_tokens": pieces,
                      "prompt_tokens_details": {"cached_tokens": 224}},
        }))
    events.append(sse_event(b"[DONE]"))
    return events


# ------------------------------------------------------------ fake clients


@attrs.define(eq=False)
class ClientResponse:
    """One response as the client parsed it."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytearray = attrs.field(factory=bytearray)
    complete: bool = False
    informational: list[int] = attrs.field(factory=list)
    #: Driver steps whose transmitted bytes belonged to this response.
    steps: set[int] = attrs.field(factory=set)
    #: The request this answers (method, target), in the client's order.
    request: tuple[str, str] | None = None
    #: The request this answers, as sent (``None`` for bytes nobody asked for).
    sent: SentRequest | None = None
    #: Driver clock when the last byte arrived.
    completed_at: float | None = None

    def header(self, name: bytes) -> bytes | None:
        """The last value of a header (lowercase name)."""
        value = None
        for n, v in self.headers:
            if n == name:
                value = v
        return value

    @property
    def rid(self) -> str | None:
        """The router request ID from ``x-request-id``."""
        value = self.header(b"x-request-id")
        return None if value is None else value.decode("ascii")

    @property
    def is_sse(self) -> bool:
        """Whether the body is a Server-Sent Events stream."""
        return (self.header(b"content-type") or b"").startswith(b"text/event-stream")

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(bytes(self.body))

    def sse_data(self) -> list[bytes]:
        """The ``data:`` payload of each event, in order."""
        out = []
        for event in bytes(self.body).split(b"\n\n"):
            lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        return out

    def sse_problem(self) -> str | None:
        """Why this SSE body is not a well-formed, properly ended stream, or ``None``."""
        body = bytes(self.body)
        if not body:
            return "empty stream"
        if not body.endswith(b"\n\n"):
            return f"stream does not end with a blank line: {body[-80:]!r}"
        data = self.sse_data()
        if not data:
            return "stream has no data events"
        for payload in data[:-1]:
            if payload == b"[DONE]":
                return "events after [DONE]"
        last = data[-1]
        if last == b"[DONE]":
            return None
        try:
            obj = json.loads(last)
        except ValueError:
            return f"last event is neither [DONE] nor JSON: {last[:80]!r}"
        if not (isinstance(obj, dict) and isinstance(obj.get("error"), dict)):
            return f"stream ends without [DONE] or an error event: {last[:120]!r}"
        error = obj["error"]
        if not {"message", "type", "param", "code"} <= error.keys():
            return f"error event is not the OpenAI envelope: {error!r}"
        return None


@attrs.define(eq=False)
class SentRequest:
    """A request (or raw bytes standing for one) a fake client sent."""

    method: str
    target: str
    #: The router has every byte of it.
    complete: bool
    #: A well-formed HTTP request (so it must get its own response).
    well_formed: bool = True


class FakeClient:
    """One client connection: the bytes it sent, and what came back, parsed with h11."""

    def __init__(self, driver: Driver, handle: int, peer: str) -> None:
        self.driver = driver
        self.handle = handle
        self.peer = peer
        self.requests: list[SentRequest] = []
        self.responses: list[ClientResponse] = []
        self.raw = bytearray()
        #: The router sent ``CloseClient``.
        self.closed_by_router = False
        #: The client broke the socket (``ClientGone``) or sent EOF.
        self.gone = False
        self.eof_sent = False
        #: Problems the client saw: bytes after close, unparseable responses...
        self.problems: list[str] = []
        self._parser = h11.Connection(h11.CLIENT)
        self._to_parse: deque[SentRequest] = deque()
        self._current: ClientResponse | None = None
        self._pending = SentRequest("GET", "<none>", complete=False, well_formed=False)
        self._dead = False
        #: When the first byte of a request the client left half-sent went out,
        #: and whether its head was complete (for the read-timeout invariant).
        self.partial_since: float | None = None
        self.partial_head_complete = False

    # -- sending

    def send(self, data: bytes, *, requests: Iterable[SentRequest] = ()) -> None:
        """Send raw bytes (``requests`` describe the requests they complete or start)."""
        for request in requests:
            self.requests.append(request)
            self._to_parse.append(request)
        self.driver.feed(ClientData(self.handle, data))

    def request(self, method: str, target: str, body: bytes = b"",
                headers: Iterable[tuple[str, str]] = (), *, pieces: int = 1) -> None:
        """Send one well-formed request, in ``pieces`` ClientData events."""
        data = http_request(method, target, body, headers)
        info = SentRequest(method, target, complete=True)
        self._send_pieces(data, info, pieces)

    def post(self, route: str, payload: Any, headers: Iterable[tuple[str, str]] = (), *, pieces: int = 1) -> None:
        """POST a JSON body (dict, or raw bytes for invalid bodies)."""
        data = json_request(route, payload, headers)
        self._send_pieces(data, SentRequest("POST", route, complete=True), pieces)

    def send_incomplete(self, data: bytes, method: str, target: str) -> None:
        """Send the first bytes of a request and never the rest (a slow or stuck client)."""
        self.partial_since = self.driver.now
        self.partial_head_complete = b"\r\n\r\n" in data
        self.send(data, requests=[SentRequest(method, target, complete=False)])

    def _send_pieces(self, data: bytes, info: SentRequest, pieces: int) -> None:
        if pieces <= 1:
            self.send(data, requests=[info])
            return
        size = max(1, -(-len(data) // pieces))
        parts = [data[i:i + size] for i in range(0, len(data), size)]
        info.complete = False
        self.send(parts[0], requests=[info])
        for part in parts[1:-1]:
            self.send(part)
        if len(parts) > 1:
            info.complete = True
            self.send(parts[-1])

    def leave(self) -> None:
        """The socket breaks (``ClientGone``)."""
        self.gone = True
        self.driver.feed(ClientGone(self.handle))

    def eof(self) -> None:
        """The client closes its side (``ClientData(b"")``)."""
        self.eof_sent = True
        self.gone = True
        self.driver.feed(ClientData(self.handle, b""))

    # -- receiving

    @property
    def alive(self) -> bool:
        """Neither side has closed the connection."""
        return not (self.gone or self.closed_by_router)

    def on_transmit(self, data: bytes, step: int) -> None:
        if self.closed_by_router:
            self.problems.append(f"Transmit after CloseClient: {data[:60]!r}")
        if self.gone:
            self.problems.append(f"Transmit after the client left: {data[:60]!r}")
        self.raw += data
        if self._dead:
            return
        self._prepare()
        self._parser.receive_data(data)
        self._pull(step)

    def on_close(self, step: int) -> None:  # noqa: ARG002 - same signature as on_transmit
        if self.closed_by_router:
            self.problems.append("CloseClient twice")
        # HTTP/1.1 responses here are never close-delimited: a response still
        # incomplete at this point stays incomplete (and is reported).
        self.closed_by_router = True

    def _prepare(self) -> None:
        p = self._parser
        if p.our_state is h11.DONE and p.their_state is h11.DONE:
            p.start_next_cycle()
        if p.our_state is h11.IDLE:
            request = self._to_parse.popleft() if self._to_parse else None
            if request is None:
                # Bytes nobody asked for (a 408 to a silent connection): parse them anyway.
                request = SentRequest("GET", "<unsolicited>", complete=False, well_formed=False)
            self._pending = request
            p.send(h11.Request(method=request.method if request.method.isalpha() else "GET",
                               target="/", headers=[("Host", "narwhal.test")]))
            p.send(h11.EndOfMessage())

    def _pull(self, step: int) -> None:
        p = self._parser
        while True:
            try:
                event = p.next_event()
            except h11.RemoteProtocolError as exc:
                self.problems.append(f"unparseable response bytes: {exc}")
                self._dead = True
                return
            if event is h11.NEED_DATA or event is h11.PAUSED or type(event) is h11.ConnectionClosed:
                if (event is h11.PAUSED and p.our_state is h11.DONE and p.their_state is h11.DONE
                        and p.trailing_data[0]):
                    self._prepare()
                    continue
                return
            if type(event) is h11.InformationalResponse:
                continue
            if type(event) is h11.Response:
                pending = self._pending
                self._current = ClientResponse(
                    status=event.status_code, headers=list(event.headers),
                    request=(pending.method, pending.target), sent=pending,
                )
                self._current.steps.add(step)
                self.responses.append(self._current)
            elif type(event) is h11.Data:
                assert self._current is not None
                self._current.body += event.data
                self._current.steps.add(step)
            elif type(event) is h11.EndOfMessage:
                assert self._current is not None
                self._current.complete = True
                self._current.completed_at = self.driver.now
                self._current.steps.add(step)
                self._current = None
                if p.their_state is h11.DONE and p.our_state is h11.DONE and p.trailing_data[0]:
                    self._prepare()

    def complete_responses(self) -> list[ClientResponse]:
        """The responses received in full."""
        return [r for r in self.responses if r.complete]

    @property
    def last(self) -> ClientResponse:
        """The last response (complete or not)."""
        assert self.responses, f"client {self.handle} got no response; bytes: {bytes(self.raw)[:200]!r}"
        return self.responses[-1]


# --------------------------------------------------------------- the fleet


LegState = Literal["open", "finished", "cancelled", "failed"]


@attrs.define(eq=False)
class EngineLeg:
    """One leg the router started, as the fake engine received it."""

    bid: str
    rid: str
    phase: str
    attempt: int
    engine: EngineAddress
    method: str
    route: str
    headers: dict[bytes, bytes]
    body: dict[str, Any]
    conn: Hashable
    fresh_connection: bool
    started_step: int
    started_index: int
    state: LegState = "open"
    #: What the fake engine has sent so far.
    sent: bytearray = attrs.field(factory=bytearray)
    #: The KV params this engine handed out in a complete 2xx prefill answer.
    kv_params: dict[str, Any] | None = None
    #: Clock when it handed them out (the KV's lease runs from about then).
    kv_at: float | None = None
    #: A streamed answer's head went out; events sent so far.
    stream_started: bool = False
    stream_sent: int = 0
    #: Clock when the leg started, and when the fake engine last sent bytes.
    started_at: float = 0.0
    last_bytes_at: float | None = None
    #: Its client is stalled (``ClientStalled``): the router must not time it out.
    held: bool = False
    #: When it was last released from a hold: its limit may run again from there.
    held_until: float | None = None

    @property
    def stream(self) -> bool:
        """The leg asked for SSE."""
        return self.body.get("stream") is True

    @property
    def open(self) -> bool:
        return self.state == "open"


@attrs.define(eq=False)
class Control:
    """One control request (probe or KV release)."""

    cmd: StartControl
    step: int
    index: int
    #: Clock when the router started it.
    started_at: float = 0.0
    done: bool = False
    status: int | None = None
    error: str | None = None
    #: For ``drop_after_send``: the parsed raw request (method, target, headers, body).
    parsed: tuple[str, str, dict[bytes, bytes], Any] | None = None

    @property
    def kind(self) -> str:
        return self.cmd.key.split("-", 1)[0]

    @property
    def ok(self) -> bool:
        return self.done and self.error is None and (self.status is None or 200 <= self.status < 300)


@attrs.define(eq=False)
class JournalEntry:
    """One journal line, decoded."""

    step: int
    index: int
    record: dict[str, Any]
    terminal: bool


def parse_request(data: bytes) -> tuple[str, str, dict[bytes, bytes], Any]:
    """Method, target, headers and JSON body of raw request bytes (h11 does the parsing)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    method = target = ""
    headers: dict[bytes, bytes] = {}
    body = bytearray()
    while True:
        event = conn.next_event()
        if type(event) is h11.Request:
            method, target = event.method.decode(), event.target.decode()
            headers = {bytes(n): bytes(v) for n, v in event.headers}
        elif type(event) is h11.Data:
            body += event.data
        elif type(event) is h11.EndOfMessage:
            break
        else:
            raise AssertionError(f"incomplete request bytes: {data[:200]!r}")
    return method, target, headers, json.loads(bytes(body)) if body else None


class InvariantError(AssertionError):
    """An invariant of the router broke."""


class Driver:
    """A router, fake clients, a fake fleet, a fake control executor and a manual clock."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        now: float = 0.0,
        auto_probe: int | None = 200,
        codec: CodecLike = REFERENCE_CODEC,
        engine_api_key: str | None = None,
        tokenizer: Any = None,
        auto_tokenize: bool = True,
        render_metrics: Any = "plain",
        **sections: Any,
    ) -> None:
        self.config = config if config is not None else make_config(**sections)
        #: The figures every ``/metrics`` scrape was rendered from: (inflight, queued, connections, terminal records).
        self.scrapes: list[tuple[int, int, int, int]] = []
        self.now = now
        self._rids = RidSource("t")
        #: Every rid the router drew, in order (GET routes and refusals included).
        self.issued: list[str] = []
        self.router = Router(
            self.config,
            rid_source=self._issue,
            authenticator=Authenticator.from_config(self.config.ingress, None),
            engine_api_key=engine_api_key,
            now=now,
            codec=codec,
            tokenizer=tokenizer,
            render_metrics=self._render_metrics if render_metrics == "plain" else render_metrics,
        )
        self.auto_probe = auto_probe
        self.tokenizer = tokenizer
        self.auto_tokenize = auto_tokenize
        #: ``TokenizePrompt`` commands not answered yet, by key (and every one ever asked, in order).
        self.tokenizing: dict[str, TokenizePrompt] = {}
        self.tokenize_asked: list[TokenizePrompt] = []
        #: Every decode engine the router was given: configured, or fed by discovery since (``EnginesChanged``).
        self.decode_engines = set(self.config.engine.decode_engines)
        self.step = 0
        self.commands: list[tuple[int, Command]] = []
        self.clients: dict[Hashable, FakeClient] = {}
        self.legs: dict[str, EngineLeg] = {}
        #: Every leg ever started, a fresh-connection restart included, in order.
        self.leg_history: list[EngineLeg] = []
        self.controls: dict[str, Control] = {}
        self.journal: list[JournalEntry] = []
        self.by_rid: dict[str, list[JournalEntry]] = {}
        self.logs: list[Log] = []
        #: The router's word that the fleet's membership changed, in order.
        self.fleet_changes: list[FleetChanged] = []
        self.cancelled: list[str] = []
        self.finished: list[FinishLeg] = []
        self.shutdown_complete: list[int] = []
        self.problems: list[str] = []
        #: Clients the adapter reported stalled (``ClientStalled``).
        self.stalled: set[Hashable] = set()
        self._next_handle = 1
        self._checked = 0  # commands already checked incrementally
        self._terminal_at: dict[str, JournalEntry] = {}
        self.drain()

    def _issue(self) -> str:
        rid = self._rids()
        self.issued.append(rid)
        return rid

    # -------------------------------------------------------------- pumping

    def feed(self, event: Event) -> None:
        """``receive`` one event at :attr:`now`, then drain the outputs."""
        if isinstance(event, ClientStalled):
            self._hold(event.conn, event.stalled)
        elif isinstance(event, ClientGone) or (isinstance(event, ClientData) and not event.data):
            self._hold(event.conn, False)
        elif isinstance(event, EnginesChanged) and event.phase == "decode":
            self.decode_engines.update(event.engines)
        self.step += 1
        try:
            self.router.receive(event, now=self.now)
        finally:
            self.drain()

    def _hold(self, conn: Hashable, stalled: bool) -> None:
        # The model of ClientStalled: the open legs of a stalled client (and
        # those started while it is) have no time limit; released, each gets
        # its whole limit again from then.
        client = self.clients.get(conn)
        if stalled:
            if client is None or client.gone:
                return
            self.stalled.add(conn)
        else:
            self.stalled.discard(conn)
        for leg in self.open_legs():
            if leg.conn == conn and leg.held != stalled:
                leg.held = stalled
                if not stalled:
                    leg.held_until = self.now

    def fire(self) -> None:
        """``handle_deadline`` at :attr:`now` if a deadline is due."""
        deadline = self.router.get_deadline()
        if deadline is not None and deadline <= self.now:
            self.step += 1
            try:
                self.router.handle_deadline(now=self.now)
            finally:
                self.drain()

    def advance(self, seconds: float) -> None:
        """Move the clock forward, firing every deadline on the way at its own time."""
        self.advance_to(self.now + seconds)

    def advance_to(self, when: float) -> None:
        """Move the clock to ``when``, firing every deadline on the way at its own time."""
        for _ in range(100_000):
            deadline = self.router.get_deadline()
            if deadline is None or deadline > when:
                break
            self.now = max(self.now, deadline)
            self.step += 1
            try:
                self.router.handle_deadline(now=self.now)
            finally:
                self.drain()
        else:  # pragma: no cover - a timer that re-arms itself in the past
            raise InvariantError("timers keep firing without the clock moving")
        self.now = max(self.now, when)

    def drain(self) -> None:
        """Execute every pending command (the adapter's job)."""
        router = self.router
        while True:
            cmd = router.next_output()
            if cmd is None:
                break
            index = len(self.commands)
            self.commands.append((self.step, cmd))
            self._execute(cmd, index)
        if self.auto_probe is not None:
            for control in [c for c in self.controls.values() if not c.done and c.kind == "probe"]:
                if not control.done:  # a nested drain may have answered it
                    self.complete_control(control.cmd.key, status=self.auto_probe)
        if self.auto_tokenize:
            for key in list(self.tokenizing):
                if key in self.tokenizing:  # a nested drain may have answered it
                    self.complete_tokenize(key)

    def complete_tokenize(self, key: str, ids: Iterable[int] | None = None, *, problem: str | None = None) -> None:
        """Answer a ``TokenizePrompt``: ``ids`` (default: the driver's tokenizer's), or ``problem``."""
        cmd = self.tokenizing.pop(key)
        if ids is None and problem is None:
            try:
                ids = self.tokenizer.prompt_token_ids(cmd.body, cmd.chat)
            except Exception as exc:  # noqa: BLE001 - as the runtime's worker reports it
                problem = f"{type(exc).__name__}: {exc}"
        self.feed(PromptTokenized(key, None if problem is not None else tuple(ids or ()), problem))

    def _execute(self, cmd: Command, index: int) -> None:
        if isinstance(cmd, Transmit):
            client = self.clients.get(cmd.conn)
            if client is None:
                self.problems.append(f"Transmit to unknown connection {cmd.conn!r}")
            else:
                client.on_transmit(cmd.data, self.step)
        elif isinstance(cmd, CloseClient):
            client = self.clients.get(cmd.conn)
            if client is not None:
                client.on_close(self.step)
        elif isinstance(cmd, WriteJournal):
            line = cmd.line
            if not line.endswith(b"\n") or line.count(b"\n") != 1:
                self.problems.append(f"journal line is not one line: {line[:100]!r}")
            record = json.loads(line)
            entry = JournalEntry(self.step, index, record, cmd.terminal)
            if (record.get("terminal") is not None) != entry.terminal:
                self.problems.append(f"WriteJournal.terminal disagrees with the record: {record!r}")
            self.journal.append(entry)
            self.by_rid.setdefault(record["rid"], []).append(entry)
            if entry.terminal and record["rid"] not in self._terminal_at:
                self._terminal_at[record["rid"]] = entry
        elif isinstance(cmd, StartLeg):
            self._start_leg(cmd, index)
        elif isinstance(cmd, CancelLeg):
            self.cancelled.append(cmd.leg)
            leg = self.legs.get(cmd.leg)
            if leg is None:
                self.problems.append(f"CancelLeg for unknown leg {cmd.leg}")
            elif leg.state == "open":
                leg.state = "cancelled"
        elif isinstance(cmd, FinishLeg):
            self.finished.append(cmd)
            leg = self.legs.get(cmd.leg)
            if leg is None or leg.state != "open":
                self.problems.append(f"FinishLeg for a leg that is not open: {cmd!r}")
            else:
                leg.state = "finished"
        elif isinstance(cmd, StartControl):
            control = Control(cmd, self.step, index, started_at=self.now)
            if cmd.drop_after_send:
                control.parsed = parse_request(cmd.data)
            if cmd.key in self.controls and not self.controls[cmd.key].done:
                self.problems.append(f"StartControl reuses a pending key {cmd.key}")
            self.controls[cmd.key] = control
        elif isinstance(cmd, TokenizePrompt):
            if cmd.key in self.tokenizing:
                self.problems.append(f"TokenizePrompt reuses a pending key {cmd.key}")
            self.tokenizing[cmd.key] = cmd
            self.tokenize_asked.append(cmd)
        elif isinstance(cmd, Log):
            self.logs.append(cmd)
        elif isinstance(cmd, ShutdownComplete):
            self.shutdown_complete.append(self.step)
        elif isinstance(cmd, FleetChanged):
            self.fleet_changes.append(cmd)
        else:  # pragma: no cover
            self.problems.append(f"unknown command {cmd!r}")

    def _start_leg(self, cmd: StartLeg, index: int) -> None:
        method, target, headers, body = parse_request(cmd.data)
        rid, phase, attempt = parse_backend_id(cmd.leg)
        old = self.legs.get(cmd.leg)
        if old is not None and old.state == "open":
            self.problems.append(f"StartLeg {cmd.leg} while that leg is still open")
        if old is not None and not cmd.fresh_connection:
            self.problems.append(f"StartLeg reuses backend ID {cmd.leg} without fresh_connection")
        leg = EngineLeg(
            bid=cmd.leg, rid=rid, phase=phase, attempt=attempt, engine=cmd.engine, method=method,
            route=target, headers=headers, body=body, conn=cmd.conn, fresh_connection=cmd.fresh_connection,
            started_step=self.step, started_index=index, started_at=self.now,
            held=cmd.conn is not None and cmd.conn in self.stalled,
        )
        self.legs[cmd.leg] = leg
        self.leg_history.append(leg)

    # -------------------------------------------------------------- clients

    def _render_metrics(self, stats: Any, live: Any) -> bytes:
        """A stand-in for the runtime's Prometheus renderer: a few live figures, as text."""
        figures = (live.inflight, live.queued, live.connections, stats.journal_records["terminal"])
        self.scrapes.append(figures)
        return b"inflight %d\nqueued %d\nconnections %d\nterminal_records %d\n" % figures

    def connect(self, peer: str = "127.0.0.1") -> FakeClient:
        """A new client connection."""
        handle = self._next_handle
        self._next_handle += 1
        client = FakeClient(self, handle, peer)
        self.clients[handle] = client
        self.feed(ClientConnected(handle, peer, 40000 + handle))
        return client

    def post(self, route: str, payload: Any, headers: Iterable[tuple[str, str]] = (), *,
             client: FakeClient | None = None) -> FakeClient:
        """POST on a new (or the given) connection."""
        client = client or self.connect()
        client.post(route, payload, headers)
        return client

    # --------------------------------------------------------------- legs

    def open_legs(self, phase: str | None = None, rid: str | None = None) -> list[EngineLeg]:
        """Legs the router is waiting on, oldest first."""
        return [
            leg for leg in self.legs.values()
            if leg.open and (phase is None or leg.phase == phase) and (rid is None or leg.rid == rid)
        ]

    def leg(self, phase: str | None = None, rid: str | None = None) -> EngineLeg:
        """The one open leg (of ``phase``, of ``rid``)."""
        legs = self.open_legs(phase, rid)
        assert len(legs) == 1, f"expected one open {phase or ''} leg, got {[leg.bid for leg in legs]}"
        return legs[0]

    def send_leg(self, bid: str, data: bytes) -> None:
        """Engine bytes for a leg (``b""`` is EOF)."""
        leg = self.legs[bid]
        leg.sent += data
        if data:
            leg.last_bytes_at = self.now
        self.feed(LegData(bid, data))

    def respond(self, bid: str, raw: bytes, *, pieces: int = 1) -> None:
        """Engine response bytes, in ``pieces`` LegData events."""
        if pieces <= 1:
            self.send_leg(bid, raw)
            return
        size = max(1, -(-len(raw) // pieces))
        for i in range(0, len(raw), size):
            if not self.legs[bid].open:
                return
            self.send_leg(bid, raw[i:i + size])

    def answer_prefill(self, bid: str, *, pieces: int = 1, **kw: Any) -> dict[str, Any]:
        """A 200 prefill answer with valid KV params; returns those params."""
        leg = self.legs[bid]
        answer = prefill_answer(leg, **kw)
        was_open = leg.open
        self.respond(bid, http_response(200, json.dumps(answer).encode()), pieces=pieces)
        if was_open and self.usable_kv(answer["kv_transfer_params"]):
            leg.kv_params = answer["kv_transfer_params"]
            leg.kv_at = self.now
        return answer["kv_transfer_params"]  # type: ignore[no-any-return]

    def usable_kv(self, params: dict[str, Any]) -> bool:
        """Whether a prefill answer's KV params are usable by docs/contract.md, "Prefill and decode legs"
        (from this fleet, complete)."""
        hosts = {a.host for a in self.config.engine.prefill_engines} | set(self.config.engine.kv_hosts)
        port = params.get("remote_port")
        return (
            params.get("do_remote_prefill") is True
            and isinstance(params.get("remote_engine_id"), str) and bool(params["remote_engine_id"])
            and isinstance(params.get("remote_block_ids"), list)
            and params.get("remote_host") in hosts
            and type(port) is int and 0 < port < 65536
        )

    def answer_decode(self, bid: str, *, pieces: int = 1, **kw: Any) -> None:
        """A 200 decode answer: JSON, or the whole SSE stream when the leg asked for one."""
        leg = self.legs[bid]
        if leg.stream:
            self.stream_rest(bid)
        else:
            answer = decode_answer(leg.route, model=leg.body.get("model", MODEL), **kw)
            self.respond(bid, http_response(200, json.dumps(answer).encode()), pieces=pieces)

    def answer_status(self, bid: str, status: int, body: bytes | None = None) -> None:
        """An error status in the vLLM error shape."""
        if body is None:
            body = json.dumps({"object": "error", "message": f"engine says {status}",
                               "type": "BadRequestError" if status < 500 else "InternalServerError",
                               "param": None, "code": status}).encode()
        self.respond(bid, http_response(status, body))

    def answer_without_kv(self, bid: str) -> None:
        """A 200 prefill answer whose ``kv_transfer_params`` is null."""
        leg = self.legs[bid]
        answer = decode_answer(leg.route, completion_tokens=1)
        self.respond(bid, http_response(200, json.dumps(answer).encode()))

    def answer_garbage(self, bid: str) -> None:
        """Bytes that are not HTTP."""
        self.respond(bid, b"SSH-2.0-OpenSSH_9.6\r\n\r\n")

    def answer_bad_json(self, bid: str) -> None:
        """A 200 whose body is not JSON."""
        self.respond(bid, http_response(200, b"<html>oops</html>", headers=((b"content-type", b"text/html"),)))

    def drop(self, bid: str) -> None:
        """The engine closes the connection (EOF)."""
        self.send_leg(bid, b"")

    def fail_leg(self, bid: str, reason: str = "connect_failed", *, reused: bool = False) -> None:
        """The adapter reports the leg's connection failed."""
        leg = self.legs[bid]
        if leg.open:
            leg.state = "failed"
        self.feed(LegFailed(bid, reason, reused))  # type: ignore[arg-type]

    def stream_head(self, bid: str) -> None:
        """The head of a 200 SSE answer."""
        leg = self.legs[bid]
        leg.stream_started = True
        self.send_leg(bid, chunked_head())

    def stream_next(self, bid: str) -> bool:
        """One more SSE event (the head first if needed); False once ``[DONE]`` went."""
        leg = self.legs[bid]
        if not leg.stream_started:
            self.stream_head(bid)
            if not leg.open:
                return False
        events = stream_events(leg.route, model=leg.body.get("model", MODEL))
        if leg.stream_sent >= len(events):
            return False
        event = events[leg.stream_sent]
        leg.stream_sent += 1
        self.send_leg(bid, chunk(event))
        return leg.stream_sent < len(events)

    def stream_rest(self, bid: str) -> None:
        """Every remaining event and the end of the chunked body."""
        leg = self.legs[bid]
        while leg.open and self.stream_next(bid):
            pass
        if leg.open:
            self.send_leg(bid, LAST_CHUNK)

    def serve(self, bid: str) -> None:
        """Answer a leg with success, whatever its phase."""
        leg = self.legs[bid]
        if leg.phase == "prefill":
            self.answer_prefill(bid)
        else:
            self.answer_decode(bid)

    def serve_until_done(self, rounds: int = 50) -> None:
        """Answer every open leg with success until none is open."""
        for _ in range(rounds):
            legs = self.open_legs()
            if not legs:
                return
            for leg in legs:
                if leg.open:
                    self.serve(leg.bid)
        raise AssertionError("legs keep coming")

    # ------------------------------------------------------------ controls

    def pending_controls(self, kind: str | None = None) -> list[Control]:
        """Control requests not answered yet."""
        return [c for c in self.controls.values() if not c.done and (kind is None or c.kind == kind)]

    def complete_control(self, key: str, *, status: int | None = 200, error: str | None = None,
                         local: bool = False, body: bytes = b"") -> None:
        """The control executor reports a result (``drop_after_send`` ones have no status)."""
        control = self.controls[key]
        assert not control.done, f"control {key} answered twice"
        control.done = True
        if control.cmd.drop_after_send and error is None:
            status = None
        control.status, control.error = status, error
        self.feed(ControlDone(key, status, error, local, body))

    def complete_releases(self, *, ok: bool = True, body: bytes = b"") -> None:
        """Answer every pending KV release (``body``: what an abort endpoint answers).

        When ``ok`` and no ``body`` is given, a ``decode_pull`` release (a
        one-token decode request) gets a one-token decode answer, and an
        abort endpoint answers as the engine simulator does, confirming it
        freed the blocks.
        """
        for control in self.pending_controls("release"):
            answer = body
            if ok and not body and self.is_decode_pull(control):
                answer = self.release_answer(control)
            elif ok and not body and not control.cmd.drop_after_send:
                owner = json.loads(control.cmd.body).get("request_id")
                answer = json.dumps({"request_id": owner, "released": True, "num_blocks": 15}).encode()
            self.complete_control(control.cmd.key, status=200 if ok else 500, body=answer)

    @staticmethod
    def is_decode_pull(control: Control) -> bool:
        """Whether a release control is a ``decode_pull`` (a whole decode request to a completion route)."""
        return not control.cmd.drop_after_send and control.cmd.target in (COMPLETIONS, CHAT)

    @staticmethod
    def release_answer(control: Control) -> bytes:
        """A decode engine's one-token answer to a ``decode_pull`` release."""
        return json.dumps(decode_answer(control.cmd.target, text="T", completion_tokens=1)).encode()

    def shutdown(self) -> None:
        """SIGTERM."""
        self.feed(ShutdownRequested())

    # ------------------------------------------------------------- journal

    def records(self, rid: str) -> list[dict[str, Any]]:
        """Every journal record of ``rid``, in order."""
        return [e.record for e in self.by_rid.get(rid, [])]

    def terminal(self, rid: str) -> dict[str, Any]:
        """The one terminal record of ``rid``."""
        terminals = [e.record for e in self.by_rid.get(rid, []) if e.terminal]
        assert len(terminals) == 1, f"{rid}: {len(terminals)} terminal records: {self.records(rid)}"
        return terminals[0]

    def terminals(self) -> list[dict[str, Any]]:
        """Every terminal record, in order."""
        return [e.record for e in self.journal if e.terminal]

    def log_events(self) -> list[str]:
        """The ``event`` of every log line."""
        return [log.event for log in self.logs]

    def started_legs(self, rid: str | None = None) -> list[EngineLeg]:
        """Every leg started (for ``rid``), restarts on a fresh connection included."""
        return [leg for leg in self.leg_history if rid is None or leg.rid == rid]

    # ----------------------------------------------------------- invariants

    def check_invariants(self, *, final: bool = False) -> None:
        """Raise :class:`InvariantError` listing every broken invariant."""
        problems = list(self.problems)
        for client in self.clients.values():
            problems.extend(f"client {client.handle}: {p}" for p in client.problems)
        problems.extend(self._journal_problems(final))
        problems.extend(self._emission_problems())
        problems.extend(self._capacity_problems(final))
        problems.extend(self._timing_problems())
        problems.extend(f"log: {log.event} {log.fields}" for log in self.logs if log.event == "internal_error")
        if final:
            problems.extend(self._kv_problems())
            problems.extend(self._lease_problems())
            problems.extend(self._response_problems())
        if problems:
            raise InvariantError("router invariants broken:\n  " + "\n  ".join(problems[:40]))

    def _journal_problems(self, final: bool) -> list[str]:
        problems = []
        started: dict[str, int] = {}
        for leg in self.leg_history:
            started.setdefault(leg.rid, leg.started_index)
        for rid, entries in self.by_rid.items():
            terminal = [e for e in entries if e.terminal]
            if len(terminal) > 1:
                problems.append(f"{rid}: {len(terminal)} terminal records")
            if terminal and entries[-1] is not terminal[0]:
                problems.append(f"{rid}: a record follows the terminal one: {entries[-1].record}")
            progress = [e for e in entries if not e.terminal]
            if terminal and terminal[0].record["legs"] and not progress:
                problems.append(f"{rid}: legs ran but no progress record came before the terminal one")
            if rid in started and (not progress or progress[0].index > started[rid]):
                problems.append(f"{rid}: a leg started before the progress record")
            if final and not terminal:
                problems.append(f"{rid}: no terminal record at the end: {[e.record for e in entries]}")
            for e in terminal:
                record = e.record
                if record["terminal"] not in ("completed", "invalid", "denied", "rejected", "failed", "cancelled"):
                    problems.append(f"{rid}: unknown terminal {record['terminal']!r}")
                if (record["terminal"] == "completed") != (record["error"] is None):
                    problems.append(f"{rid}: completed iff no error broken: {record}")
        if final:
            for rid in started:
                if rid not in self.by_rid:
                    problems.append(f"{rid}: legs started but no journal record at all")
        return problems

    def _emission_problems(self) -> list[str]:
        problems = []
        terminal_at = self._terminal_at
        for index in range(self._checked, len(self.commands)):
            step, cmd = self.commands[index]
            if type(cmd) is StartLeg:
                rid = parse_backend_id(cmd.leg)[0]
                t = terminal_at.get(rid)
                if t is not None and t.index < index:
                    problems.append(f"{rid}: StartLeg {cmd.leg} after its terminal record")
            elif type(cmd) is StartControl and cmd.key.startswith("release-"):
                rid = parse_backend_id(cmd.key[len("release-"):])[0]
                t = terminal_at.get(rid)
                if t is not None and t.index < index:
                    problems.append(f"{rid}: KV release {cmd.key} after its terminal record")
        self._checked = len(self.commands)
        for client in self.clients.values():
            for response in client.responses:
                answered = response.rid
                t = terminal_at.get(answered) if answered is not None else None
                if t is not None and max(response.steps) > t.step:
                    problems.append(
                        f"{answered}: bytes sent to the client in step {max(response.steps)}, "
                        f"after its terminal record (step {t.step})"
                    )
        return problems

    def _capacity_problems(self, final: bool) -> list[str]:
        problems = []
        stats = self.router.statistics()
        open_legs = self.open_legs()
        if stats.legs != len(open_legs):
            problems.append(f"statistics().legs = {stats.legs}, but {len(open_legs)} legs are open: "
                            f"{[leg.bid for leg in open_legs]}")
        per_engine: dict[tuple[str, str], int] = {}
        for leg in open_legs:
            key = (leg.engine.url, leg.phase)
            per_engine[key] = per_engine.get(key, 0) + 1
        for key, count in stats.engine_outstanding.items():
            if count != per_engine.get(key, 0):
                problems.append(f"engine {key} outstanding = {count}, open legs there = {per_engine.get(key, 0)}")
        a = self.config.admission
        if not 0 <= stats.inflight <= a.max_inflight:
            problems.append(f"inflight = {stats.inflight} outside 0..{a.max_inflight}")
        if not 0 <= stats.queued <= a.queue_size:
            problems.append(f"queued = {stats.queued} outside 0..{a.queue_size}")
        live = sum(1 for rid in self._live_rids())
        if stats.inflight + stats.queued > stats.requests or stats.requests > live:
            problems.append(
                f"requests = {stats.requests}, inflight = {stats.inflight}, queued = {stats.queued}, "
                f"rids seen without a terminal record = {live}"
            )
        held = sum(conn.buffered for conn in self.router._conns.values())  # noqa: SLF001
        if stats.buffered_bytes != held or stats.buffered_bytes < 0:
            problems.append(f"buffered_bytes = {stats.buffered_bytes}, open connections hold {held}")
        if final:
            if not self.router._conns and stats.buffered_bytes:  # noqa: SLF001
                problems.append(f"no connection left but buffered_bytes = {stats.buffered_bytes}")
            for name in ("requests", "inflight", "queued", "legs"):
                if getattr(stats, name):
                    problems.append(f"at the end statistics().{name} = {getattr(stats, name)}")
            busy = {k: v for k, v in stats.engine_outstanding.items() if v}
            if busy:
                problems.append(f"at the end engines still have outstanding legs: {busy}")
            if self.router.admission.per_client:
                problems.append(f"at the end per-client counts remain: {self.router.admission.per_client}")
        return problems

    def _timing_problems(self) -> list[str]:
        """Every timer that is due has fired by now (docs/contract.md, "Admission, capacity and retries"; the
        driver fires all due deadlines)."""
        problems = []
        now = self.now
        late = 1e-6
        e, a, i = self.config.engine, self.config.admission, self.config.ingress
        for leg in self.open_legs():
            if leg.held:
                continue  # its client is stalled: no limit runs
            if leg.phase == "prefill":
                timeout, limit, what = e.prefill_timeout_s, leg.started_at + e.prefill_timeout_s, "prefill_timeout_s"
            elif leg.stream and leg.stream_sent and leg.last_bytes_at is not None:
                timeout, what = e.stream_idle_timeout_s, "stream_idle_timeout_s since its last chunk"
                limit = leg.last_bytes_at + timeout
            else:
                timeout, limit, what = e.decode_timeout_s, leg.started_at + e.decode_timeout_s, "decode_timeout_s"
            if leg.held_until is not None:
                # At most the whole limit again from the end of its hold.
                limit, what = max(limit, leg.held_until + timeout), what + " (after a hold)"
            if now > limit + late:
                problems.append(f"{leg.bid} still open at {now:g}, past its {what} ({limit:g})")
        for rid, entries in self.by_rid.items():
            if any(x.terminal for x in entries):
                continue
            admitted = entries[0].record["ts"]  # the request arrived no later than this
            if now <= admitted + a.request_timeout_s + late:
                continue
            legs = self.started_legs(rid)
            client = self.clients.get(legs[0].conn) if legs else None
            if client is None or client.gone:
                continue  # cancelled; its record may wait for a KV release
            if not any(r.rid == rid and r.complete for r in client.responses):
                problems.append(f"{rid} unanswered at {now:g}, past request_timeout_s ({admitted + a.request_timeout_s:g})")
        for client in self.clients.values():
            if client.partial_since is None or not client.alive:
                continue
            answered = sum(1 for r in client.responses if r.complete)
            if answered < sum(1 for r in client.requests if r.complete):
                # An earlier request on this connection is still being answered:
                # HTTP/1.1 reads the next one only after that (no read timeout yet).
                continue
            budget = i.header_timeout_s if not client.partial_head_complete else i.header_timeout_s + i.body_timeout_s
            # Pipelined bytes wait in the buffer while an earlier request runs: the
            # read timeout starts once the router is free to read them.
            since = max([client.partial_since] + [r.completed_at for r in client.responses if r.completed_at])
            if now > since + budget + late:
                part = "head" if not client.partial_head_complete else "body"
                problems.append(f"client {client.handle} has sent half a request {part} (readable since "
                                f"{since:g}) and is still waited for at {now:g}")
        return problems

    def _live_rids(self) -> set[str]:
        """Rids that may hold a request: ever issued minus those with a terminal record."""
        return set(self.issued) - set(self._terminal_at)

    def _kv_problems(self) -> list[str]:
        problems = []
        releases = {key[len("release-"):]: c for key, c in self.controls.items() if c.kind == "release"}
        decode_params: dict[str, list[EngineLeg]] = {}
        for leg in self.leg_history:
            if leg.phase == "decode":
                decode_params.setdefault(leg.rid, []).append(leg)
        mode = self.config.engine.kv_release
        for leg in self.leg_history:
            if leg.kv_params is None:
                continue
            terminal = [e.record for e in self.by_rid.get(leg.rid, []) if e.terminal]
            if not terminal:
                continue  # reported by the journal check
            records = [r for r in terminal[0]["legs"] if r["backend_id"] == leg.bid]
            if not records:
                problems.append(f"{leg.bid}: prefill leg missing from its terminal record")
                continue
            kv = records[-1]["kv"]
            if kv is None or kv.get("outcome") not in ("pulled", "released", "release_sent", "held_until_lease"):
                problems.append(f"{leg.bid}: returned KV params but ends with KV record {kv!r}")
                continue
            if kv["owner"] != leg.kv_params.get("remote_request_id"):
                problems.append(f"{leg.bid}: KV owner {kv['owner']!r}, engine said "
                                f"{leg.kv_params.get('remote_request_id')!r}")
            if kv["engine"] != leg.engine.url:
                problems.append(f"{leg.bid}: KV engine {kv['engine']!r} is not {leg.engine.url}")
            release = releases.get(leg.bid)
            if kv["outcome"] == "pulled":
                takers = [d for d in decode_params.get(leg.rid, [])
                          if d.body.get("kv_transfer_params") == leg.kv_params]
                if not takers:
                    problems.append(f"{leg.bid}: KV 'pulled' but no decode leg carried its params")
                if release is not None:
                    problems.append(f"{leg.bid}: KV both pulled and released ({release.cmd.key})")
            elif kv["outcome"] == "released":
                if release is None or not release.ok or release.cmd.drop_after_send:
                    problems.append(f"{leg.bid}: KV 'released' without a release control that confirmed it")
            elif kv["outcome"] == "release_sent":
                if release is None or not release.done:
                    problems.append(f"{leg.bid}: KV 'release_sent' without a release control that went out")
            if release is not None:
                problems.extend(self._release_problems(leg, release, mode))
        return problems

    def _lease_problems(self) -> list[str]:
        """No decode request -- leg, fresh-connection restart or release -- carries KV late in its lease.

        A decode request may carry a prefill's KV only within the first two
        thirds of ``engine.kv_lease_s`` after the prefill answered
        (docs/operate.md, "KV leases"): never from KV whose lease may be gone.
        """
        window = self.config.engine.kv_lease_s * 2.0 / 3.0
        source = {
            leg.kv_params.get("remote_request_id"): leg
            for leg in self.leg_history if leg.kv_params is not None and leg.kv_at is not None
        }
        carried: list[tuple[str, float, Any]] = [
            (leg.bid, leg.started_at, leg.body.get("kv_transfer_params"))
            for leg in self.leg_history if leg.phase == "decode" and isinstance(leg.body, dict)
        ]
        for control in self.controls.values():
            if control.kind != "release":
                continue
            if control.parsed is not None:
                body = control.parsed[3]
            elif self.is_decode_pull(control):
                body = json.loads(control.cmd.body)
            else:
                continue  # an abort endpoint: the prefill engine itself, no KV read
            carried.append((control.cmd.key, control.started_at, body.get("kv_transfer_params")))
        problems = []
        for what, at, params in carried:
            if not isinstance(params, dict):
                continue
            prefill = source.get(params.get("remote_request_id"))
            if prefill is not None and prefill.kv_at is not None and at > prefill.kv_at + window + 1e-9:
                problems.append(f"{what} carried {prefill.bid}'s KV at {at:g}, past {prefill.kv_at + window:g} "
                                f"(two thirds of its {self.config.engine.kv_lease_s:g} s lease)")
        # KV nothing renews (no lease-era key, or no tp_size: vLLM before KV
        # leases) must be read by its hold's end: a decode leg the engine has
        # sent nothing on may still be queued there, and is cancelled first.
        hold = self.config.engine.kv_lease_s * 0.95
        for leg in self.leg_history:
            params = leg.body.get("kv_transfer_params") if leg.phase == "decode" and isinstance(leg.body, dict) else None
            if not isinstance(params, dict) or not leg.open or leg.sent:
                continue
            renewed = ("transfer_mode" in params or "remote_blocks_expiry_time" in params) and \
                params.get("tp_size") is not None
            prefill = source.get(params.get("remote_request_id"))
            if not renewed and prefill is not None and prefill.kv_at is not None and \
                    self.now > prefill.kv_at + hold + 1e-9:
                problems.append(f"{leg.bid} is still open and unread at {self.now:g}, past the hold of "
                                f"{prefill.bid}'s unrenewed KV ({prefill.kv_at + hold:g})")
        return problems

    def _release_problems(self, leg: EngineLeg, release: Control, mode: str) -> list[str]:
        cmd = release.cmd
        if mode == "decode_pull":
            body = json.loads(cmd.body)
            if cmd.drop_after_send or (cmd.method, cmd.target) != ("POST", leg.route) or \
                    body.get("kv_transfer_params") != leg.kv_params or body.get("max_tokens") != 1 or \
                    body.get("stream") is not False:
                return [f"{leg.bid}: decode_pull {cmd.key} is not a one-token whole decode request carrying the KV"]
            if cmd.engine not in self.decode_engines:
                return [f"{leg.bid}: decode_pull sent to {cmd.engine.url}, not a decode engine"]
        elif mode == "abort_endpoint":
            body = json.loads(cmd.body)
            if (cmd.method, cmd.target, cmd.engine) != ("POST", self.config.engine.abort_path, leg.engine) or \
                    body.get("request_id") != leg.kv_params.get("remote_request_id"):  # type: ignore[union-attr]
                return [f"{leg.bid}: abort request {cmd!r} does not name the owner on its prefill engine"]
        elif mode == "decode_abort":
            assert release.parsed is not None
            _, target, headers, body = release.parsed
            if not cmd.drop_after_send or body.get("kv_transfer_params") != leg.kv_params or target != leg.route:
                return [f"{leg.bid}: decode_abort {cmd.key} does not carry the KV params"]
            if cmd.engine not in self.decode_engines:
                return [f"{leg.bid}: decode_abort sent to {cmd.engine.url}, not a decode engine"]
        else:
            return [f"{leg.bid}: a release control in lease mode: {cmd!r}"]
        return []

    def _response_problems(self) -> list[str]:
        problems = []
        for client in self.clients.values():
            for response in client.responses:
                where = f"client {client.handle} {response.request}"
                if response.rid is None:
                    problems.append(f"{where}: response without x-request-id")
                if not response.complete:
                    if not client.gone:
                        problems.append(f"{where}: incomplete response {response.status} "
                                        f"{bytes(response.body)[:80]!r}")
                    continue
                if response.is_sse:
                    problem = response.sse_problem()
                    if problem:
                        problems.append(f"{where}: {problem}")
                elif response.status >= 400 and response.request and response.request[0] != "HEAD" \
                        and response.request[1] != "/ready":
                    try:
                        error = response.json()["error"]
                        assert {"message", "type", "param", "code"} <= error.keys()
                    except Exception:  # noqa: BLE001
                        problems.append(f"{where}: {response.status} body is not the OpenAI envelope: "
                                        f"{bytes(response.body)[:120]!r}")
                rid = response.rid
                if rid in self._terminal_at and response.request and response.request[1] in (COMPLETIONS, CHAT):
                    record = self._terminal_at[rid].record
                    expected = 200 if response.is_sse else response.status
                    if record["status"] != expected:
                        problems.append(f"{where}: answered {response.status} but journal says {record['status']}")
            if client.gone:
                continue
            # A 408 to a connection that never sent a byte is allowed (RFC 9110 §15.5.9).
            unsolicited = [r for r in client.responses if r.sent is not None and r.sent.target == "<unsolicited>"]
            if any(r.status != 408 for r in unsolicited):
                problems.append(f"client {client.handle}: a response nobody asked for: {unsolicited[0].status}")
            # Every complete request gets exactly one complete response -- also when
            # the router closes the connection afterwards: it never closes on a
            # complete request it has read without answering it.
            answered = {id(r.sent) for r in client.complete_responses()}
            missing = [r for r in client.requests if r.complete and r.well_formed and id(r) not in answered]
            if missing:
                closed = " (the router closed the connection)" if client.closed_by_router else ""
                problems.append(
                    f"client {client.handle} stayed connected but got no response to "
                    f"{[(r.method, r.target) for r in missing]} of {len(client.requests)} requests{closed}"
                )
        return problems
