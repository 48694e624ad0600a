"""A minimal instant engine for router benchmarks: speaks vLLM's and SGLang's PD protocols.

``benchmarks/router_bench.py`` runs two of these (a prefill and a decode
engine) pinned to the load core and points every router under test at the
same pair, so Narwhal, vllm-router and sglang-router face identical engines
doing identical work per request. It answers at once (no modelled GPU time)
with vLLM-shaped bodies, and does as little as it can per request
(asyncio + httptools + orjson, uvloop when installed) so that the load core
is not the bottleneck.

It is NOT the project's engine simulator (``narwhal_sim``), which models
KV ownership, pulls, leases, batching and faults; ``router_bench.py --engine
sim`` uses that one instead. What this one adds, and why it exists:

* SGLang's PD mode (``sglang-router --pd-disaggregation``) sends the client
  body to the prefill and the decode engine at once, with ``bootstrap_host``,
  ``bootstrap_port`` and ``bootstrap_room`` added, and never sends
  ``kv_transfer_params``. A real SGLang prefill server then answers one
  token; the simulator, seeing a plain request, would serve it whole (and
  stream 256 tokens back to the router for a streamed request). Here a
  ``prefill`` engine answers any request carrying ``bootstrap_room`` with one
  token, streamed or not as asked.
* vLLM's NIXL protocol (Narwhal, ``vllm-router --vllm-pd-disaggregation``):
  a request whose ``kv_transfer_params.do_remote_decode`` is true gets one
  token and ``kv_transfer_params`` naming this engine
  (``remote_request_id`` = the received ``X-Request-Id`` plus ``-`` and a
  counter, as vLLM suffixes ids); a decode leg (``do_remote_prefill``) is
  answered whole, with ``kv_transfer_params: null`` as vLLM writes it. No KV
  is pulled or held: the engine-to-engine pull the simulator does is engine
  work that SGLang's protocol does out of band, and leaving it out keeps the
  engine work per router request the same for every router.
* ``--token-interval-ms`` paces streamed tokens (one timer per stream; the
  first token goes at once) for the slow-streams benchmark: 10,000 open
  streams cost it almost nothing.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET
/health`` (200, empty), ``GET /v1/models``, ``GET /metrics`` (a few vLLM
gauges), ``GET /instant/stats`` (how many legs of each kind arrived),
anything else 404 in vLLM's error envelope (so SGLang's ``/server_info`` /
``/get_model_info`` probes see what a vLLM server says and no tokenizer is
looked up). Output: ``max_completion_tokens``, else ``max_tokens``, else 16
tokens, words of a fixed vocabulary, always ``finish_reason: "length"``;
``usage`` counts one token per 4 body bytes.

Usage::

    python benchmarks/instant_engine.py --role prefill|decode|mixed --listen 127.0.0.1:0 [--token-interval-ms 0]

On start it prints one JSON line: ``{"event": "listening", "host", "port", "role", "url", "engine_id"}``.
SIGTERM/SIGINT stop it (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import resource
import signal
import sys
import time
from typing import Any

import httptools
import orjson

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
WORDS = (
    " the", " sea", " is", " deep", " and", " cold", " narwhals", " swim", " under", " ice", " with",
    " long", " tusks", " that", " sense", " water", " in", " winter", " they", " dive", " far", " below",
    " light", " to", " hunt", " fish", " near", " floor", " of", " arctic", " bays", " blue",
)  # fmt: skip
NOT_FOUND = orjson.dumps(
    {"error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}}
)
MODELS = orjson.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 131072}]}
)
METRICS = (
    b"# TYPE vllm:num_requests_running gauge\n"
    b'vllm:num_requests_running{model_name="%s"} 0\n'
    b"# TYPE vllm:num_requests_waiting gauge\n"
    b'vllm:num_requests_waiting{model_name="%s"} 0\n' % (MODEL.encode(), MODEL.encode())
)


def _text(n: int, seed: int) -> list[str]:
    return [WORDS[(seed + i * 7) % len(WORDS)] for i in range(n)]


class Engine:
    def __init__(self, role: str, host: str, port: int, engine_id: str, token_interval: float) -> None:
        self.role = role
        self.host = host
        self.port = port
        self.engine_id = engine_id
        self.token_interval = token_interval
        self.counter = itertools.count(1)
        self.created = int(time.time())
        #: GET /instant/stats: what kind of legs arrived (the runner checks a router really did PD)
        self.stats = {"requests": 0, "vllm_prefill": 0, "vllm_decode": 0, "sglang_prefill": 0, "sglang_decode": 0,
                      "plain": 0, "streams": 0}  # fmt: skip

    # -- answers --------------------------------------------------------------

    def answer(self, conn: Conn, method: bytes, path: bytes, body: bytes, rid: bytes | None) -> None:
        path = path.split(b"?", 1)[0]
        if method == b"GET":
            if path == b"/health":
                conn.respond(200, b"", b"application/json")
            elif path == b"/v1/models":
                conn.respond(200, MODELS, b"application/json")
            elif path == b"/metrics":
                conn.respond(200, METRICS, b"text/plain; version=0.0.4")
            elif path == b"/instant/stats":
                conn.respond(200, orjson.dumps(self.stats), b"application/json")
            else:
                conn.respond(404, NOT_FOUND, b"application/json")
            return
        if method != b"POST" or path not in (b"/v1/completions", b"/v1/chat/completions"):
            conn.respond(404, NOT_FOUND, b"application/json")
            return
        chat = path == b"/v1/chat/completions"
        try:
            req = orjson.loads(body)
            if not isinstance(req, dict):
                raise ValueError
        except ValueError:
            conn.respond(400, b'{"error":{"message":"bad json","type":"BadRequestError","param":null,"code":400}}',
                         b"application/json")  # fmt: skip
            return
        seq = next(self.counter)
        stats = self.stats
        stats["requests"] += 1
        rid_s = rid.decode("latin-1") if rid else f"req-{seq}"
        kv = req.get("kv_transfer_params")
        prompt_chars = len(body)  # cheap stand-in for prompt length
        prompt_tokens = max(1, prompt_chars // 4)
        n = req.get("max_completion_tokens") or req.get("max_tokens") or 16
        out_kv: Any = None
        stream = req.get("stream") is True
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            # vLLM prefill leg: one token, KV named by this engine
            n = 1
            stats["vllm_prefill"] += 1
            blocks = (prompt_tokens + 15) // 16
            out_kv = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(range(blocks)), "remote_engine_id": self.engine_id,
                "remote_request_id": f"{rid_s}-{seq:08x}", "remote_host": self.host,
                "remote_port": self.port, "tp_size": 1,
            }  # fmt: skip
        elif "bootstrap_room" in req:
            if self.role == "prefill":
                n = 1  # SGLang prefill server: prefill only, one token
                stats["sglang_prefill"] += 1
            else:
                stats["sglang_decode"] += 1
        elif isinstance(kv, dict) and kv.get("do_remote_prefill"):
            stats["vllm_decode"] += 1
        else:
            stats["plain"] += 1
        if stream:
            stats["streams"] += 1
            conn.stream(self, chat, rid_s, int(n), prompt_tokens, bool(req.get("stream_options")))
            return
        words = _text(int(n), seq)
        text = "".join(words)
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + int(n),
                 "completion_tokens": int(n), "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
        if chat:
            doc = {
                "id": f"chatcmpl-{rid_s}", "object": "chat.completion", "created": self.created, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text.lstrip(),
                                                     "reasoning_content": None, "tool_calls": []},
                             "logprobs": None, "finish_reason": "length", "stop_reason": None}],
                "usage": usage, "prompt_logprobs": None, "kv_transfer_params": out_kv,
            }  # fmt: skip
        else:
            doc = {
                "id": f"cmpl-{rid_s}", "object": "text_completion", "created": self.created, "model": MODEL,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                             "stop_reason": None, "prompt_logprobs": None}],
                "usage": usage, "kv_transfer_params": out_kv,
            }  # fmt: skip
        conn.respond(200, orjson.dumps(doc), b"application/json", rid)


class Conn(asyncio.Protocol):
    __slots__ = ("engine", "transport", "parser", "url", "body", "rid", "header_name", "keep_alive",
                 "closed", "paused", "streaming", "pending")  # fmt: skip

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.rid: bytes | None = None
        self.header_name = b""
        self.keep_alive = True
        self.closed = False
        self.streaming = False
        self.pending: list[tuple[bytes, bytes, bytes, bytes | None]] = []

    # asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.respond(400, b"", b"text/plain")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []
        self.rid = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"x-request-id":
            self.rid = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        item = (self.parser.get_method(), self.url, b"".join(self.body), self.rid)
        if self.streaming:
            self.pending.append(item)  # pipelined behind a paced stream
        else:
            self.engine.answer(self, *item)

    # answers
    def respond(self, status: int, body: bytes, ctype: bytes, rid: bytes | None = None) -> None:
        if self.closed or self.transport is None:
            return
        head = b"HTTP/1.1 %d %s\r\nserver: instant-engine\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (
            status, b"OK" if status == 200 else b"Error", ctype, len(body))  # fmt: skip
        if rid:
            head += b"x-request-id: " + rid + b"\r\n"
        if not self.keep_alive:
            head += b"connection: close\r\n"
        self.transport.write(head + b"\r\n" + body)
        if not self.keep_alive:
            self.close()

    def stream(self, engine: Engine, chat: bool, rid: str, n: int, prompt_tokens: int, usage: bool) -> None:
        if self.transport is None:
            return
        self.transport.write(
            b"HTTP/1.1 200 OK\r\nserver: instant-engine\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"x-request-id: " + rid.encode() + b"\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        if chat:
            head = orjson.dumps({"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk",
                                 "created": engine.created, "model": MODEL})[:-1]  # fmt: skip
        else:
            head = orjson.dumps({"id": f"cmpl-{rid}", "object": "text_completion",
                                 "created": engine.created, "model": MODEL})[:-1]  # fmt: skip
        words = _text(n, len(rid))

        def event(i: int) -> bytes:
            last = i == n - 1
            fin = b'"length"' if last else b"null"
            tok = orjson.dumps(words[i].lstrip() if chat and i == 0 else words[i])
            if chat:
                delta = b'{"role":"assistant","content":' + tok + b"}" if i == 0 else b'{"content":' + tok + b"}"
                choice = b'{"index":0,"delta":' + delta + b',"logprobs":null,"finish_reason":' + fin + b"}"
            else:
                choice = (b'{"index":0,"text":' + tok + b',"logprobs":null,"finish_reason":' + fin
                          + b',"stop_reason":null}')  # fmt: skip
            return b"data: " + head + b',"choices":[' + choice + b"]}\n\n"

        def chunk(data: bytes) -> bytes:
            return b"%x\r\n%s\r\n" % (len(data), data)

        def tail() -> bytes:
            out = b""
            if usage:
                u = orjson.dumps({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n,
                                  "completion_tokens": n})  # fmt: skip
                out += chunk(b"data: " + head + b',"choices":[],"usage":' + u + b"}\n\n")
            return out + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

        write = self.transport.write
        if engine.token_interval <= 0:
            for i in range(n):
                write(chunk(event(i)))  # one write per event, as an engine sends them
            write(tail())
            if not self.keep_alive:
                self.close()
            return
        # paced: one timer per stream
        self.streaming = True
        loop = asyncio.get_running_loop()
        state = {"i": 0}

        def step() -> None:
            if self.closed:
                return
            i = state["i"]
            if i < n:
                write(chunk(event(i)))
                state["i"] = i + 1
                loop.call_later(engine.token_interval, step)
                return
            write(tail())
            self.streaming = False
            if not self.keep_alive:
                self.close()
                return
            while self.pending and not self.streaming:
                engine.answer(self, *self.pending.pop(0))

        step()  # the first token at once (time to first token ~0), then one per interval

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("prefill", "decode", "mixed"), default="mixed")
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--engine-id", default=None)
    parser.add_argument("--token-interval-ms", type=float, default=0.0, help="pace streamed tokens (0: instant)")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    args = parser.parse_args(argv)
    host, _, port_text = args.listen.rpartition(":")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.loop != "asyncio":
        try:
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        except ImportError:
            if args.loop == "uvloop":
                raise

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        engine_id = args.engine_id or f"instant-{args.role}-{os.urandom(4).hex()}"
        engine = Engine(args.role, host, 0, engine_id, args.token_interval_ms / 1000.0)
        server = await loop.create_server(lambda: Conn(engine), host, int(port_text), backlog=4096,
                                          reuse_address=True)  # fmt: skip
        engine.port = server.sockets[0].getsockname()[1]
        line = {"event": "listening", "host": host, "port": engine.port, "role": args.role,
                "url": f"http://{host}:{engine.port}", "engine_id": engine_id}  # fmt: skip
        sys.stdout.write(orjson.dumps(line).decode() + "\n")
        sys.stdout.flush()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
