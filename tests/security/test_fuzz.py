"""Property-based fuzzing of everything a client's bytes reach, without sockets (Hypothesis).

Three targets, each fed generated *and mutated* input: valid requests and
bodies are built first, then bytes are flipped, inserted and deleted, header
lines duplicated, line ends broken, and the result split at random points.

* the server-side HTTP/1.1 codec (:class:`narwhal_core.http.ServerConnection`);
* the request contract (:func:`narwhal_core.contract.check_request`);
* a whole in-process :class:`narwhal_core.Router` driven by hand:
  ``ClientConnected`` + ``ClientData`` events, every ``StartLeg`` answered
  with a canned valid engine answer, every control request acknowledged.

Properties: nothing outside the :class:`~narwhal_core.errors.NarwhalError`
family escapes (and, for the router, nothing escapes at all: an adapter
does not expect ``receive`` to raise); a client's fault is answered with a
4xx (505 for an HTTP version other than 1.x, as RFC 9110 §15.6.6 asks);
parsing does not depend on how the bytes were split; every completion
request the router parsed has exactly one terminal journal record; buffered
bytes stay under the codec's bound and every example runs in bounded time.

Examples are derandomised (the suite must never be flaky); set
``NARWHAL_FUZZ_EXAMPLES`` to run more, with fresh randomness.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Hashable
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, example, given, settings

from ..helpers import ALIAS, MODEL

from narwhal_core import (
    CancelLeg,
    ClientConnected,
    ClientData,
    ClientGone,
    CloseClient,
    ControlDone,
    FinishLeg,
    LegData,
    Log,
    RidSource,
    Router,
    StartControl,
    StartLeg,
    Transmit,
    WriteJournal,
    api_key_digest,
    parse_api_keys,
    parse_backend_id,
)
from narwhal_core import wire
from narwhal_core.auth import Authenticator
from narwhal_core.config import (
    AdmissionConfig,
    Config,
    EngineConfig,
    HealthConfig,
    IngressConfig,
    JournalConfig,
    ModelConfig,
)
from narwhal_core.contract import ROUTER_OWNED_FIELDS, check_request, is_router_owned
from narwhal_core.errors import ContractError, NarwhalError, RemoteProtocolError
from narwhal_core.http import NEED_DATA, PAUSED, Codec, CodecLike, ContinueExpected, HttpRequest
from tests.core.http_reference import REFERENCE_CODEC

#: The client-facing codec and its oracle (h11 with the codec's strictness), by name.
CODECS: dict[str, CodecLike] = {"h11": REFERENCE_CODEC, "fast": Codec()}

COMPLETION_ROUTES = ("/v1/completions", "/v1/chat/completions")
CLIENT_KEY = "sk-client-fuzz-0123456789"

_EXTRA = int(os.environ.get("NARWHAL_FUZZ_EXAMPLES", "0"))


def _settings(examples: int) -> settings:
    return settings(
        max_examples=_EXTRA or examples,
        derandomize=not _EXTRA,
        database=None,
        print_blob=True,  # a failure prints what reproduces it (no database to replay from)
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# ------------------------------------------------------------- generation

_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False), _TEXT,
    st.sampled_from([MODEL, ALIAS, "gpt-4o", "function", "text", "", "1e400", "retrieval"]),
)
_JSON = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_TEXT, inner, max_size=3)),
    max_leaves=8,
)
_FIELDS = [
    "model", "stream", "n", "best_of", "max_tokens", "prompt", "messages", "audio", "modalities", "tools",
    "temperature", "stream_options", "min_tokens", "max_completion_tokens",
    "kv_transfer_params", "request_id", "bootstrap_host", "bootstrap_room",
]


@st.composite
def request_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A completion body: mostly well-typed fields, sometimes hostile values, router-owned fields included."""
    if draw(st.integers(0, 2)) == 0:
        # Valid on both routes, so that the legs are exercised too.
        valid: dict[str, Any] = {
            "model": draw(st.sampled_from([MODEL, ALIAS, None])), "prompt": "Hello",
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": draw(st.integers(1, 8)),
            "stream": draw(st.booleans()),
        }
        for name in draw(st.lists(st.sampled_from(["kv_transfer_params", "request_id", "bootstrap_host"]),
                                  max_size=2, unique=True)):
            valid[name] = draw(_JSON)
        return valid
    body: dict[str, Any] = {}
    if draw(st.booleans()):
        body["prompt"] = draw(st.one_of(st.just("Hello"), _TEXT, st.lists(st.integers(0, 50000), max_size=4)))
    if draw(st.booleans()):
        body["messages"] = draw(st.one_of(
            st.just([{"role": "user", "content": "Hi"}]),
            st.lists(st.dictionaries(_TEXT, _SCALAR, max_size=2), max_size=2),
            _JSON,
        ))
    for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=5, unique=True)):
        if name == "model":
            body[name] = draw(st.one_of(st.sampled_from([MODEL, ALIAS, "gpt-4o", None]), _SCALAR))
        elif name in ("n", "best_of", "max_tokens", "max_completion_tokens", "min_tokens"):
            body[name] = draw(st.one_of(st.integers(-3, 8), _SCALAR))
        elif name == "stream":
            body[name] = draw(st.one_of(st.booleans(), _SCALAR))
        elif name == "tools":
            body[name] = draw(st.one_of(
                st.just([{"type": "function", "function": {"name": "f"}}]), _JSON,
            ))
        elif name == "modalities":
            body[name] = draw(st.one_of(st.just(["text"]), _JSON))
        else:
            body[name] = draw(_JSON)
    return body


def _encode_body(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


_METHODS = st.sampled_from(["POST"] * 6 + ["GET", "HEAD", "PUT", "OPTIONS"])
_TARGETS = st.sampled_from(list(COMPLETION_ROUTES) * 3 + [
    "/v1/models", "/health", "/ready", "/metrics", "/nope", "/v1/completions?x=1", "*",
])


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    """One well-formed HTTP/1.x request (before mutation)."""
    method = draw(_METHODS)
    target = draw(_TARGETS)
    version = draw(st.sampled_from(["HTTP/1.1"] * 5 + ["HTTP/1.0"]))
    body = _encode_body(draw(request_bodies())) if method in ("POST", "PUT") else b""
    headers: list[tuple[bytes, bytes]] = [(b"Host", b"narwhal.test"), (b"Content-Type", b"application/json")]
    auth = draw(st.sampled_from(["good", "good", "none", "wrong", "two"]))
    if auth in ("good", "two"):
        headers.append((b"Authorization", b"Bearer " + CLIENT_KEY.encode()))
    if auth in ("wrong", "two"):
        headers.append((b"Authorization", b"Bearer sk-wrong"))
    if draw(st.booleans()):
        headers.append((b"X-Request-Id", draw(st.binary(max_size=20)).replace(b"\r", b"").replace(b"\n", b"")
                        .strip(b" \t") or b"r"))
    if version == "HTTP/1.1" and draw(st.integers(0, 5)) == 0:
        headers.append((b"Expect", b"100-continue"))
    connection = draw(st.sampled_from([None, None, b"close", b"keep-alive"]))
    if connection is not None:
        headers.append((b"Connection", connection))
    for _ in range(draw(st.integers(0, 2))):
        headers.append((draw(st.sampled_from([b"X-Narwhal-Client", b"Cookie", b"X-Extra", b"api-key"])),
                        draw(st.sampled_from([b"v", b"admin", b"a=b"]))))
    if body and version == "HTTP/1.1" and draw(st.integers(0, 3)) == 0:
        headers.append((b"Transfer-Encoding", b"chunked"))
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if body[a:b]]
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    else:
        if body or method in ("POST", "PUT"):
            headers.append((b"Content-Length", b"%d" % len(body)))
        payload = body
    head = b"%s %s %s\r\n" % (method.encode(), target.encode(), version.encode())
    head += b"".join(b"%s: %s\r\n" % h for h in headers) + b"\r\n"
    return head + payload


_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**20), st.integers(0, 7)),
    st.tuples(st.just("insert"), st.integers(0, 2**20), st.sampled_from(
        [b"\r", b"\n", b"\r\n", b" ", b"\t", b"\x00", b":", b",", b"\r\n ", b"0", b"{", b"\xff", b"\r\n\r\n",
         b"Content-Length: 5\r\n", b"Transfer-Encoding: chunked\r\n", b"\r\nX: y"])),
    st.tuples(st.just("insert-random"), st.integers(0, 2**20), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 2**20), st.integers(1, 16)),
    st.tuples(st.just("duplicate-line"), st.integers(0, 64), st.just(0)),
    st.tuples(st.just("crlf-to-lf"), st.integers(0, 64), st.just(0)),
    st.tuples(st.just("truncate"), st.integers(0, 2**20), st.just(0)),
)


def mutate(data: bytes, mutations: list[tuple[str, int, Any]]) -> bytes:
    """Apply byte-level mutations; positions wrap around the current length."""
    buf = bytearray(data)
    for kind, pos, arg in mutations:
        n = len(buf)
        if kind == "flip" and n:
            buf[pos % n] ^= 1 << arg
        elif kind in ("insert", "insert-random"):
            at = pos % (n + 1)
            buf[at:at] = arg
        elif kind == "delete" and n:
            at = pos % n
            del buf[at:at + arg]
        elif kind == "duplicate-line":
            lines = bytes(buf).split(b"\r\n")
            if len(lines) > 2:
                i = 1 + pos % (len(lines) - 2)
                lines.insert(i, lines[i])
                buf = bytearray(b"\r\n".join(lines))
        elif kind == "crlf-to-lf":
            count = buf.count(b"\r\n")
            if count:
                k = pos % count
                at = -1
                for _ in range(k + 1):
                    at = buf.find(b"\r\n", at + 1)
                del buf[at]
        elif kind == "truncate" and n:
            del buf[pos % n:]
    return bytes(buf)


@st.composite
def hostile_streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """1-3 pipelined requests, mutated (or not), and the points where the bytes are split."""
    data = b"".join(draw(st.lists(http_requests(), min_size=1, max_size=3)))
    if draw(st.integers(0, 4)) >= 2:
        data = mutate(data, draw(st.lists(_MUTATION, min_size=1, max_size=4)))
    cuts = sorted(set(draw(st.lists(st.integers(0, max(0, len(data))), max_size=6))))
    return data, cuts


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *[c for c in cuts if 0 < c < len(data)], len(data)]
    return [data[a:b] for a, b in zip(points, points[1:]) if data[a:b]]


def _client_fault_status(status: int) -> bool:
    return 400 <= status < 500 or status == 505


# ------------------------------------------------------------------ codec

#: Small limits, so that mutations reach them.
LIMITS = {"max_request_line_bytes": 256, "max_header_bytes": 1024, "max_headers": 16, "max_body_bytes": 4096}


def _parse(chunks: list[bytes], codec: CodecLike = REFERENCE_CODEC) -> tuple[list[tuple[Any, ...]], int | None, int]:
    """Feed ``chunks`` to a server connection, answering each request; (events, error status, max buffered)."""
    conn = codec.server_connection(**LIMITS)
    bound = sum(LIMITS.values()) - LIMITS["max_headers"] + 4
    events: list[tuple[Any, ...]] = []
    most = 0

    def pump() -> int | None:
        while True:
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                return exc.status if exc.reason != "dropped" else 0
            if event is NEED_DATA:
                return None
            if event is PAUSED:
                if conn.must_close:
                    return -1
                return None
            if isinstance(event, ContinueExpected):
                events.append(("continue", event.method, event.target, event.headers, event.content_length))
                conn.send_continue()
            elif isinstance(event, HttpRequest):
                events.append(("request", event.method, event.target, event.headers, event.body,
                               event.keep_alive, event.http_version))
                conn.send_response(200, [], b"")
            else:
                events.append(("closed",))
                return -1

    for chunk in [*chunks, b""]:
        conn.receive_data(chunk)
        most = max(most, len(conn._buf))  # type: ignore[attr-defined]  # noqa: SLF001 - the bound under test
        assert most <= bound, (most, bound)
        outcome = pump()
        if outcome is not None:
            return events, (outcome if outcome > 0 else None), most
    return events, None, most


@pytest.mark.parametrize("codec", list(CODECS), ids=list(CODECS))
@_settings(600)
@given(stream=hostile_streams())
def test_codec_refuses_with_4xx_and_splitting_never_changes_the_parse(
    codec: str, stream: tuple[bytes, list[int]]
) -> None:
    data, cuts = stream
    whole = _parse([data], CODECS[codec])
    split = _parse(_split(data, cuts), CODECS[codec])
    one_by_one = _parse([data[i:i + 1] for i in range(len(data))], CODECS[codec]) if len(data) <= 1500 else split
    # Smuggling needs two parsers to disagree; here one parser must not disagree with itself...
    assert split[:2] == whole[:2], (split[:2], whole[:2])
    assert one_by_one[:2] == whole[:2]
    # ...nor with the reference codec.
    if codec != "h11":
        assert whole[:2] == _parse([data])[:2]
    status = whole[1]
    assert status is None or _client_fault_status(status), status


@pytest.mark.parametrize("codec", list(CODECS), ids=list(CODECS))
@_settings(300)
@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(0, 600), max_size=5))
def test_codec_survives_arbitrary_bytes(codec: str, data: bytes, cuts: list[int]) -> None:
    whole = _parse([data], CODECS[codec])
    assert _parse(_split(data, cuts), CODECS[codec])[:2] == whole[:2]
    assert whole[:2] == _parse([data])[:2]
    assert whole[1] is None or _client_fault_status(whole[1])


# --------------------------------------------------------------- contract


def _check(route: str, body: bytes) -> Any:
    try:
        return check_request(route, body, {MODEL, ALIAS}, MODEL)  # type: ignore[arg-type]
    except ContractError as exc:
        assert exc.status in (400, 404), exc
        envelope = json.loads(exc.body())
        assert set(envelope["error"]) == {"message", "type", "param", "code"}
        assert len(exc.message) <= 1200
        return exc


@_settings(1000)
@given(request_bodies(), st.sampled_from(COMPLETION_ROUTES), st.lists(_MUTATION, max_size=3))
def test_contract_only_raises_contract_errors_and_accepts_exactly(
    body: dict[str, Any], route: str, mutations: list[tuple[str, int, Any]]
) -> None:
    raw = mutate(_encode_body(body), mutations)
    outcome = _check(route, raw)
    if isinstance(outcome, ContractError):
        return
    accepted = outcome.body
    assert accepted["model"] == MODEL
    assert not any(is_router_owned(k) for k in accepted)
    assert not ROUTER_OWNED_FIELDS & set(accepted)
    # Re-encoding and decoding gives the same value: the engines see what was validated.
    assert wire.loads(wire.dumps(accepted)) == accepted
    if not mutations:
        original = wire.loads(raw)
        expected = {k: v for k, v in original.items() if not is_router_owned(k)}
        expected["model"] = MODEL
        assert accepted == expected
        assert list(outcome.stripped) == [k for k in original if is_router_owned(k)]


@_settings(500)
@given(st.binary(max_size=300), st.sampled_from(COMPLETION_ROUTES))
def test_contract_survives_arbitrary_bytes(raw: bytes, route: str) -> None:
    _check(route, raw)


# ----------------------------------------------------------------- router


PREFILL_HOST = "10.0.0.1"


def _router(auth: str) -> tuple[Router, Authenticator]:
    config = Config(
        model=ModelConfig(name=MODEL, aliases=(ALIAS,)),
        ingress=IngressConfig(listen="127.0.0.1:0", **LIMITS),
        engine=EngineConfig(prefill=(f"http://{PREFILL_HOST}:8100",), decode=("http://10.0.1.1:8200",)),
        admission=AdmissionConfig(max_inflight=4, queue_size=4),
        health=HealthConfig(probe_interval_s=3600.0),
        journal=JournalConfig(path="-"),
    )
    keys = parse_api_keys(f'[[keys]]\nclient = "fuzz"\nsha256 = "{api_key_digest(CLIENT_KEY)}"\n')
    authenticator = Authenticator.from_config(config.ingress, None) if auth == "none" else Authenticator(
        mode="api_keys", keys=keys
    )
    router = Router(config, rid_source=RidSource("fz"), authenticator=authenticator, now=0.0,
                    render_metrics=lambda _stats, _live: b"# no metrics in the fuzz driver\n")
    return router, authenticator


def _engine_answer(leg: StartLeg) -> bytes:
    head, _, body = leg.data.partition(b"\r\n\r\n")
    route = head.split(b" ", 2)[1].decode()
    request = json.loads(body)
    _, phase, _ = parse_backend_id(leg.leg)
    if phase == "prefill":
        answer: dict[str, Any] = {
            "id": "cmpl-p", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p",
                "remote_request_id": leg.leg + "-0a1b2c3d", "remote_block_ids": [0],
                "remote_host": PREFILL_HOST, "remote_port": 8100,
            },
        }
    elif request.get("stream") is True:
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                 "choices": [{"index": 0, "delta": {"content": "hi"}, "text": "hi"}]}
        events = b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
        return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events))
    else:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if route == "/v1/chat/completions":
            choice["message"] = {"role": "assistant", "content": "hi"}
        else:
            choice["text"] = "hi"
        answer = {"id": "cmpl-d", "object": "x", "created": 0, "model": MODEL, "choices": [choice],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    data = json.dumps(answer).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data)


class _Driver:
    """The adapter and the fleet, by hand: feed, drain, answer every leg and control at once."""

    def __init__(self, auth: str) -> None:
        self.router, self.authenticator = _router(auth)
        self.sent: dict[Hashable, bytearray] = {}
        self.closed: set[Hashable] = set()
        self.journal: list[dict[str, Any]] = []
        self.most_buffered = 0
        self.now = 0.0
        self.drain()

    def feed(self, event: Any) -> None:
        self.now += 0.001
        try:
            self.router.receive(event, now=self.now)
        except NarwhalError as exc:  # pragma: no cover - reported with its kind
            raise AssertionError(f"a NarwhalError escaped Router.receive: {exc!r}") from exc
        self.drain()

    def drain(self) -> None:
        pending: list[Any] = []
        while True:
            command = self.router.next_output()
            if command is None:
                if not pending:
                    break
                event = pending.pop(0)
                self.router.receive(event, now=self.now)
                continue
            kind = type(command)
            if kind is Transmit:
                self.sent.setdefault(command.conn, bytearray()).extend(command.data)
            elif kind is CloseClient:
                self.closed.add(command.conn)
            elif kind is WriteJournal:
                self.journal.append(json.loads(command.line))
            elif kind is StartLeg:
                pending.append(LegData(command.leg, _engine_answer(command)))
            elif kind is StartControl:
                pending.append(ControlDone(command.key, None if command.drop_after_send else 200))
            elif kind in (CancelLeg, FinishLeg, Log):
                pass
            else:  # pragma: no cover
                raise AssertionError(f"unexpected command {command!r}")
        for conn in self.router._conns.values():  # noqa: SLF001 - the bound under test
            self.most_buffered = max(self.most_buffered, len(conn.codec._buf))  # noqa: SLF001


def _responses(data: bytes, methods: list[str]) -> list[tuple[int, dict[str, str]]]:
    """The final responses in what a client received (1xx skipped); HEAD responses carry no body."""
    out: list[tuple[int, dict[str, str]]] = []
    rest = data
    while rest:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        assert sep, f"truncated response head: {head[:200]!r}"
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, code, _ = status_line.split(" ", 2)
        assert version == "HTTP/1.1", status_line
        headers: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(":")
            assert name and name not in headers, (name, lines)
            headers[name.lower()] = value.strip()
        status = int(code)
        if status < 200:
            continue
        head_request = len(out) < len(methods) and methods[len(out)] == "HEAD"
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                if head_request:
                    break
                rest = rest[size + 2:]
                if size == 0:
                    break
        elif "content-length" in headers:
            if not head_request:
                rest = rest[int(headers["content-length"]):]
        elif not head_request and status not in (204, 304):
            rest = b""  # close-delimited (a stream to an HTTP/1.0 client): the body runs to the end
        out.append((status, headers))
    return out


def _streamed(event: HttpRequest, path: str, authenticator: Authenticator) -> bool:
    """Whether the router answers this request with an SSE stream (the fuzz engines always succeed)."""
    if event.method != "POST" or path not in COMPLETION_ROUTES:
        return False
    try:
        authenticator.authenticate(event.headers, "127.0.0.1")
        return check_request(path, event.body, frozenset({MODEL, ALIAS}), MODEL).stream  # type: ignore[arg-type]
    except NarwhalError:
        return False


def _expected_requests(
    data: bytes, authenticator: Authenticator, codec: CodecLike
) -> tuple[list[tuple[str, str]], int | None, str | None]:
    """What the router should have parsed: (method, path) per request, the final error status if any,
    and the path that error's request line named, if it named one."""
    conn = codec.server_connection(**LIMITS)
    conn.receive_data(data)
    conn.receive_data(b"")
    requests: list[tuple[str, str]] = []
    while True:
        try:
            event = conn.next_event()
        except RemoteProtocolError as exc:
            if exc.reason == "dropped":
                return requests, None, None
            return requests, exc.status, None if exc.target is None else exc.target.partition("?")[0]
        if isinstance(event, ContinueExpected):
            path = event.target.partition("?")[0]
            if event.method == "POST" and path in COMPLETION_ROUTES:
                try:
                    authenticator.authenticate(event.headers, "127.0.0.1")
                except NarwhalError:
                    requests.append((event.method, path))  # denied before its body: then closed
                    return requests, None, None
            conn.send_continue()
        elif isinstance(event, HttpRequest):
            path = event.target.partition("?")[0]
            requests.append((event.method, path))
            if event.http_version == "1.0" and _streamed(event, path, authenticator):
                # A stream to an HTTP/1.0 client cannot be chunked: its body
                # runs to the connection's close, whatever the client asked.
                return requests, None, None
            conn.send_response(200, [], b"")
            if conn.must_close:
                return requests, None, None
        else:
            return requests, None, None


# Found by a long run (NARWHAL_FUZZ_EXAMPLES=4000): an HTTP/1.0 keep-alive
# client pipelining after a streamed request; the stream closes the connection.
_HTTP10_STREAM_THEN_PIPELINED = b"".join(
    b"POST /v1/completions HTTP/1.0\r\nHost: narwhal.test\r\nContent-Type: application/json\r\n"
    b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    for body in (
        b'{"model": "%s", "prompt": "Hello", "max_tokens": 1, "stream": %s}' % (MODEL.encode(), flag)
        for flag in (b"true", b"false")
    )
)


@_settings(500)
@given(hostile_streams(), st.sampled_from(["none", "api_keys"]))
@example((_HTTP10_STREAM_THEN_PIPELINED, []), "none")
def test_router_answers_every_client_fault_with_a_4xx_and_journals_every_request(
    stream: tuple[bytes, list[int]], auth: str
) -> None:
    data, cuts = stream
    started = time.perf_counter()
    driver = _Driver(auth)
    conn = "client"
    driver.feed(ClientConnected(conn, "127.0.0.1", 40000))
    for piece in _split(data, cuts):
        if conn in driver.closed:
            break
        driver.feed(ClientData(conn, piece))
    if conn not in driver.closed:
        driver.feed(ClientData(conn, b""))
        if conn not in driver.closed:
            driver.feed(ClientGone(conn))
    driver.router.handle_deadline(now=driver.now + 10_000.0)
    driver.drain()

    stats = driver.router.statistics()
    assert (stats.connections, stats.requests, stats.legs, stats.inflight, stats.queued) == (0, 0, 0, 0, 0), stats

    requests, error, error_path = _expected_requests(data, driver.authenticator, driver.router._codec)  # noqa: SLF001
    methods = [m for m, _ in requests]
    responses = _responses(bytes(driver.sent.get(conn, b"")), methods)
    for status, headers in responses:
        assert status < 500 or status == 505, (status, data[:300])
        assert "x-request-id" in headers
    assert len(responses) in (len(requests), len(requests) + 1), (responses, requests, error)
    if error is not None:
        assert len(responses) == len(requests) + 1 and responses[-1][0] == error, (responses, error)

    terminals: dict[str, dict[str, Any]] = {}
    for record in driver.journal:
        assert record["rid"] not in terminals, f"a record after the terminal one: {record}"
        if record["terminal"] is not None:
            terminals[record["rid"]] = record
    assert {r["rid"] for r in driver.journal} == set(terminals), "a request without its terminal record"
    # Every request to a completion route, whatever its method (docs/contract.md, "The journal"), and only those.
    expected = [headers["x-request-id"] for (_, path), (_, headers) in zip(requests, responses)
                if path in COMPLETION_ROUTES]
    if error is not None and error_path in COMPLETION_ROUTES:
        # Refused as HTTP, but its request line named a completion route:
        # the answer names a rid, so it has its record (docs/operate.md).
        expected.append(responses[-1][1]["x-request-id"])
    assert sorted(expected) == sorted(terminals), (expected, list(terminals))
    for record in terminals.values():
        assert record["terminal"] in ("completed", "invalid", "denied"), record
        assert CLIENT_KEY not in json.dumps(record)
        event(f"journal: {record['terminal']}")
    for status, _ in responses:
        event(f"response: {status // 100}xx")
    event(f"parse: {'refused ' + str(error) if error else 'clean'}")

    bound = sum(LIMITS.values()) - LIMITS["max_headers"] + 4
    assert driver.most_buffered <= bound
    assert time.perf_counter() - started < 5.0


@pytest.mark.parametrize("auth", ["none", "api_keys"])
def test_router_driver_serves_a_plain_request(auth: str) -> None:
    """The fuzz driver itself works: a valid request is answered 200 and journaled ``completed``."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    data = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
            % (CLIENT_KEY.encode(), len(body), body))
    driver = _Driver(auth)
    driver.feed(ClientConnected("c", "127.0.0.1", 1))
    driver.feed(ClientData("c", data))
    [(status, headers)] = _responses(bytes(driver.sent["c"]), ["POST"])
    assert status == 200
    assert [r["terminal"] for r in driver.journal if r["terminal"]] == ["completed"]
