"""Helpers of the end-to-end conformance suite (docs/contract.md, docs/security.md, docs/operate.md, over real sockets).

Everything here is synchronous and bounded: a plain-HTTP client, minimal
request bodies, exact JSON and readers of Server-Sent Events. What every
suite shares (routes, the error envelope, request IDs, the journal) is in
``tests/helpers.py``; raw HTTP/1.1 for what httpx will not send is
``tests/rawhttp.py``, and a ``narwhal serve`` subprocess ``tests/serving.py``
(both re-exported here for the suite).
"""

from __future__ import annotations

import decimal
import json
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from ..helpers import CHAT, COMPLETIONS, sse_payloads
from ..rawhttp import Closed, RawClient, Response, chunked, request_bytes  # noqa: F401  (re-exported for the suite)
from ..serving import ServeProcess, serve_config, toml_config  # noqa: F401


#: The body of a minimal valid request on each route.
BASE_BODY: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"prompt": "The narwhal is"},
    CHAT: {"messages": [{"role": "user", "content": "Tell me about narwhals."}]},
}

#: A plain-HTTP client for the tests: no TLS context to build (httpx spends ~50 ms on one per
#: client), no pooled connections (each request opens its own, as a fresh client would).
http = httpx.Client(timeout=10, verify=False, limits=httpx.Limits(max_keepalive_connections=0))


def exact_json(text: str | bytes) -> Any:
    """Parse JSON keeping every number's exact decimal value and every key's order."""
    return json.loads(text, parse_float=decimal.Decimal, parse_int=int)


# --------------------------------------------------------------- responses


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE answer, checking its framing (docs/contract.md, "Responses and errors").

    Every event is exactly one ``data: ...`` line followed by a blank line;
    the last one is ``data: [DONE]`` and nothing follows it.
    """
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].split(";")[0].strip() == "text/event-stream", response.headers
    text = response.text
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    payloads = sse_payloads(text)
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


