"""Helpers of the end-to-end conformance suite (SPEC §2-§8 over real sockets).

Everything here is synchronous and bounded: raw HTTP/1.1 over a loopback
socket for what httpx will not send (``Expect: 100-continue``, hand-made
chunked bodies, oversized heads), readers for what the engines received and
for Server-Sent Events, a capture of the router's process log, and a
``narwhal serve`` subprocess whose stderr is read line by line.
"""

from __future__ import annotations

import decimal
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx


# Re-exported: the suite's tests import these from here.
from ..harness import MODEL, Fleet, journal_terminal, poll, read_journal  # noqa: F401
from ..rawhttp import Closed, RawClient, Response, chunked, request_bytes  # noqa: F401  (re-exported for the suite)
from ..serving import ServeProcess, serve_config, toml_config  # noqa: F401


#: The completion routes (SPEC §2).
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
COMPLETION_PATHS = (COMPLETIONS, CHAT)

#: The body of a minimal valid request on each route.
BASE_BODY: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"prompt": "The narwhal is"},
    CHAT: {"messages": [{"role": "user", "content": "Tell me about narwhals."}]},
}

#: What a router request ID looks like (SPEC §3 IDs; at most 100 of [A-Za-z0-9-]).
RID_RE = re.compile(r"[A-Za-z0-9-]{1,100}\Z")
#: A backend ID: at most 128 characters of [A-Za-z0-9-].
BACKEND_ID_RE = re.compile(r"[A-Za-z0-9-]{1,128}\Z")

#: A plain-HTTP client for the tests: no TLS context to build (httpx spends ~50 ms on one per
#: client), no pooled connections (each request opens its own, as a fresh client would).
http = httpx.Client(timeout=10, verify=False, limits=httpx.Limits(max_keepalive_connections=0))

#: Header names Narwhal may write on a leg: everything else would be forwarded client state.
LEG_HEADERS = frozenset({"host", "content-type", "content-length", "x-request-id", "authorization"})


# ----------------------------------------------------------------- engines


def completion_records(fleet: Fleet | Iterable[Any]) -> list[dict[str, Any]]:
    """Every completion request the engines of ``fleet`` received (probes and control requests left out)."""
    engines = fleet.all() if isinstance(fleet, Fleet) else fleet
    out: list[dict[str, Any]] = []
    for engine in engines:
        out.extend(r for r in engine.requests() if r["path"].split("?")[0] in COMPLETION_PATHS)
    return out


def header_pairs(record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The headers an engine received, names lowercased, in order."""
    return [(name.lower(), value) for name, value in record["headers"]]


def header_values(record: Mapping[str, Any], name: str) -> list[str]:
    """Every value of one header an engine received."""
    return [value for n, value in header_pairs(record) if n == name.lower()]


def exact_json(text: str | bytes) -> Any:
    """Parse JSON keeping every number's exact decimal value and every key's order."""
    return json.loads(text, parse_float=decimal.Decimal, parse_int=int)


# --------------------------------------------------------------- responses


def assert_envelope(
    response: httpx.Response,
    status: int,
    *,
    type: str,
    code: str | None | object = ...,
    param: str | None | object = ...,
) -> dict[str, Any]:
    """Check an OpenAI error envelope (SPEC §2.1) and return its ``error`` object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == type, error
    if code is not ...:
        assert error["code"] == code, error
    if param is not ...:
        assert error["param"] == param, error
    return error  # type: ignore[no-any-return]


def rid_of(response: httpx.Response) -> str:
    """The router request ID a response carries; it must look like one (SPEC §2)."""
    rid = response.headers.get("x-request-id")
    assert rid is not None, f"no x-request-id on {response.status_code} {response.request.url}"
    assert RID_RE.match(rid), rid
    return rid


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE answer, checking its framing (SPEC §2.3).

    Every event is exactly one ``data: ...`` line followed by a blank line;
    the last one is ``data: [DONE]`` and nothing follows it.
    """
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].split(";")[0].strip() == "text/event-stream", response.headers
    text = response.text
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    events = text.split("\n\n")
    assert events[-1] == "", events[-1]
    payloads = []
    for event in events[:-1]:
        lines = event.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), event
        payloads.append(lines[0][len("data: "):])
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1], payloads
    return payloads


def sse_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE answer (every event but ``[DONE]``, each an object)."""
    chunks = [json.loads(p) for p in sse_events(response)[:-1]]
    assert all(isinstance(c, dict) for c in chunks), chunks
    return chunks


def streamed_text(chunks: Sequence[Mapping[str, Any]], *, chat: bool) -> str:
    """The text of a streamed answer, joined from its chunks."""
    out = []
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            if chat:
                out.append(choice.get("delta", {}).get("content") or "")
            else:
                out.append(choice.get("text") or "")
    return "".join(out)


# ------------------------------------------------------------- process log


# ---------------------------------------------------------------- configs


