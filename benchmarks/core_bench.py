"""Core-only benchmark: one full PD request life, no sockets, no event loop.

Two paths, each timed with ``time.perf_counter`` over ``--iterations``
requests, ``--repeat`` times (the best and the median repeat are reported):

(a) ``decisions`` -- what the core decides for one request, without the HTTP
    codec or the router's bookkeeping: parse and validate a ~1 KB chat body
    (``contract.check_request``), plan both legs (``leg_bodies.prefill_body`` /
    ``decode_body`` + ``wire.dumps``), check the prefill answer
    (``check_prefill_answer``), normalise the decode answer (``wire.loads``,
    ``normalise_answer``, ``wire.dumps``), and encode the progress and terminal
    journal records. Its target and results: benchmarks/README.md, "Core benchmark".

(b) ``router`` -- the whole router path through the HTTP/1.1 codec: the client's
    request bytes in through ``Router.receive(ClientData)`` on a keep-alive
    connection, the prefill leg's request bytes out and its response bytes in
    (``LegData``), the same for the decode leg, the client's response bytes and
    the journal lines out, ``get_deadline()`` after each event as an adapter
    re-arms its timer. ``router-stream`` is the same with ``stream: true`` and a
    16-event SSE decode answer relayed chunk by chunk.

Bodies are realistic: a ~1 KB chat prompt, vLLM-shaped prefill and decode
answers (``kv_transfer_params``, usage with ``prompt_tokens_details``).

Usage::

    # pin to one core for stable figures:
    #   taskset -c 0 python benchmarks/core_bench.py
    python benchmarks/core_bench.py [--iterations 20000] [--repeat 5] [--json] [--profile]

``--opcodes`` counts the bytecodes path (b) runs per request, attribute
operations apart (with ``NARWHAL_PURE_PYTHON=1`` only: it sees bytecode).

``--profile`` adds a cProfile breakdown of path (b): the top 15 functions by
own time (cProfile cannot see inside compiled modules: profile with
``NARWHAL_PURE_PYTHON=1``, which measures the core's sources instead of the
compiled build). A benchmark, not a test: nothing here asserts on speed.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dis
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Before the core: NARWHAL_PURE_PYTHON=1 measures its sources, not the compiled build.
from narwhal_build import core_build, use_pure_core_if_requested  # noqa: E402

use_pure_core_if_requested()

from narwhal_core import (  # noqa: E402
    ClientConnected,
    ClientData,
    LegData,
    RidSource,
    Router,
    StartLeg,
    Transmit,
    WriteJournal,
    wire,
)
from narwhal_core.auth import Authenticator  # noqa: E402
from narwhal_core.config import Config, EngineConfig, IngressConfig, JournalConfig, ModelConfig  # noqa: E402
from narwhal_core.contract import CHAT, check_request  # noqa: E402
from narwhal_core.ids import backend_id  # noqa: E402
from narwhal_core.journal import (  # noqa: E402
    KvRecord,
    LegRecord,
    ProgressRecord,
    TerminalRecord,
    encode,
)
from narwhal_core.leg_bodies import check_prefill_answer, decode_body, normalise_answer, prefill_body  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PREFILL = "http://10.0.0.1:8100"
DECODE = "http://10.0.1.1:8200"
PROMPT = (
    "Summarise the following field notes in three sentences and keep every number exact. "
    + "Narwhals (Monodon monoceros) live year-round in the Arctic; a male's tusk, a canine "
    "with some 10 million nerve endings, can reach 3.1 m. Pods of 15-20 animals dive to 1,500 m. " * 5
)


def chat_request_body(*, stream: bool = False) -> bytes:
    """A ~1 KB chat completion body as an OpenAI client sends it."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a concise assistant for marine biologists."},
            {"role": "user", "content": PROMPT},
        ],
        "max_tokens": 128,
        "temperature": 0.7,
        "top_p": 0.95,
        "user": "bench-user-0001",
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def prefill_answer_body() -> bytes:
    """vLLM's answer to a prefill leg: one token and the KV handoff."""
    return json.dumps({
        "id": "chatcmpl-5f0c1e9a2b3d4c5e", "object": "chat.completion", "created": 1730000000, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "reasoning_content": None, "content": "Nar",
                                             "tool_calls": []},
                     "logprobs": None, "finish_reason": "length", "stop_reason": None}],
        "usage": _usage(268, 1, 32), "prompt_logprobs": None,
        "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(range(1, 18))], "remote_engine_id": "b8e4a6f2-prefill-0",
            "remote_request_id": "bench-owner-0", "remote_host": "10.0.0.1", "remote_port": 5600,
            "tp_size": 1,
        },
    }).encode()


def decode_answer_body() -> bytes:
    """vLLM's non-streaming answer to a decode leg (~100 tokens)."""
    text = ("Narwhals are Arctic toothed whales whose males grow a tusk of up to 3.1 m, a canine with "
            "about 10 million nerve endings. They travel in pods of 15-20 animals. They dive to 1,500 m "
            "to feed on fish and squid in winter.")
    return json.dumps({
        "id": "chatcmpl-9a8b7c6d5e4f3a2b", "object": "chat.completion", "created": 1730000001, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "reasoning_content": None, "content": text,
                                             "tool_calls": []},
                     "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
        "usage": _usage(268, 96, 256), "prompt_logprobs": None, "kv_transfer_params": None,
    }).encode()


def sse_answer_chunks(events: int = 16) -> list[bytes]:
    """A decode stream as an engine writes it: one chunk per SSE event, then usage and ``[DONE]``."""
    chunks = []
    for i in range(events):
        event = {"id": "chatcmpl-9a8b", "object": "chat.completion.chunk", "created": 1730000001, "model": MODEL,
                 "choices": [{"index": 0, "delta": {"content": f" token{i}"}, "logprobs": None,
                              "finish_reason": None}]}
        chunks.append(b"data: " + json.dumps(event).encode() + b"\n\n")
    chunks.append(b"data: " + json.dumps({
        "id": "chatcmpl-9a8b", "object": "chat.completion.chunk", "created": 1730000001, "model": MODEL,
        "choices": [], "usage": _usage(268, events, 256),
    }).encode() + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    return [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks]


def http_response(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ndate: Mon, 30 Nov 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


def http_request(body: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: narwhal.internal:8000\r\n"
            b"User-Agent: OpenAI/Python 1.54.0\r\nAccept: application/json\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer sk-not-checked\r\n"
            b"X-Request-Id: client-req-000123\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


# ------------------------------------------------------------------ path (a)


def decisions_path() -> Callable[[int], None]:
    """One request's decisions, without the codec or the router's bookkeeping."""
    body = chat_request_body()
    prefill_answer = prefill_answer_body()
    decode_answer = decode_answer_body()
    names = frozenset({MODEL})
    allowed = frozenset({"10.0.0.1"})

    def kv_host_allowed(host: str) -> bool:
        return host in allowed

    def run(n: int) -> None:
        for i in range(n):
            rid = f"bench{i:010x}"
            accepted = check_request(CHAT, body, names, MODEL)
            p_bid = backend_id(rid, "prefill", 1)
            prefill_bytes = wire.dumps(prefill_body(accepted.body))
            handoff = check_prefill_answer(prefill_answer, p_bid, kv_host_allowed)
            d_bid = backend_id(rid, "decode", 1)
            decode_bytes = wire.dumps(decode_body(accepted.body, handoff.params))
            answer = wire.loads_answer(decode_answer)  # as the router reads engine answers
            normalise_answer(CHAT, answer, MODEL, pd=True, cached_tokens=handoff.cached_tokens)
            client_bytes = wire.dumps(answer)
            progress = encode(ProgressRecord(
                ts=1.0, rid=rid, event="admitted", route=CHAT, client="anonymous", client_rid=None,
                mode="pd", stream=False,
            ))
            terminal = encode(TerminalRecord(
                ts=1.5, rid=rid, client_rid="client-req-000123", client="anonymous", route=CHAT,
                model=MODEL, stream=False, mode="pd", terminal="completed", status=200, error=None,
                legs=(
                    LegRecord(phase="prefill", attempt=1, backend_id=p_bid, engine=PREFILL, status=200,
                              outcome="ok", started=1.0, duration_ms=120.0,
                              kv=KvRecord(outcome="pulled", owner=handoff.owner, engine=PREFILL, method="decode")),
                    LegRecord(phase="decode", attempt=1, backend_id=d_bid, engine=DECODE, status=200,
                              outcome="ok", started=1.12, duration_ms=380.0),
                ),
                usage=answer.get("usage"), received=1.0, duration_ms=500.0, ttft_ms=500.0,
                stripped=accepted.stripped,
            ))
            if not (prefill_bytes and decode_bytes and client_bytes and progress and terminal):
                raise RuntimeError("empty output")

    return run


# ------------------------------------------------------------------ path (b)


def make_router() -> Router:
    config = Config(
        model=ModelConfig(name=MODEL),
        ingress=IngressConfig(listen="127.0.0.1:8000"),
        engine=EngineConfig(prefill=(PREFILL,), decode=(DECODE,), max_inflight_per_engine=1 << 20),
        journal=JournalConfig(path="-"),
    )
    return Router(config, rid_source=RidSource("bench"),
                  authenticator=Authenticator.from_config(config.ingress, None))


def router_path(*, stream: bool = False) -> Callable[[int], None]:
    """The whole router path, codec included, one keep-alive client connection."""
    router = make_router()
    request = http_request(chat_request_body(stream=stream))
    prefill = http_response(prefill_answer_body())
    decode_whole = http_response(decode_answer_body())
    sse_head = (b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
    sse_chunks = sse_answer_chunks()
    now = 0.0
    router.receive(ClientConnected(1, "127.0.0.1", 50000), now=now)
    sink: list[Any] = []
    counts = {"client_bytes": 0, "journal_lines": 0, "legs": 0}

    receive = router.receive
    next_output = router.next_output
    get_deadline = router.get_deadline

    def drain() -> StartLeg | None:
        leg = None
        while (cmd := next_output()) is not None:
            if isinstance(cmd, StartLeg):
                leg = cmd
            elif isinstance(cmd, Transmit):
                counts["client_bytes"] += len(cmd.data)
            elif isinstance(cmd, WriteJournal):
                counts["journal_lines"] += 1
            sink.append(cmd)
        get_deadline()
        sink.clear()
        return leg

    def run(n: int) -> None:
        nonlocal now
        for _ in range(n):
            now += 0.001
            receive(ClientData(1, request), now=now)
            leg = drain()
            assert leg is not None
            receive(LegData(leg.leg, prefill), now=now)
            leg = drain()
            assert leg is not None
            if stream:
                receive(LegData(leg.leg, sse_head), now=now)
                drain()
                for piece in sse_chunks:
                    receive(LegData(leg.leg, piece), now=now)
                    drain()
                receive(LegData(leg.leg, b"0\r\n\r\n"), now=now)
            else:
                receive(LegData(leg.leg, decode_whole), now=now)
            drain()
            counts["legs"] += 2

    run.counts = counts  # type: ignore[attr-defined]
    return run


# ------------------------------------------------------------------- harness


def measure(run: Callable[[int], None], iterations: int, repeat: int) -> dict[str, float]:
    run(max(100, iterations // 20))  # warm up: caches, allocator, branch predictors
    per_request = []
    for _ in range(repeat):
        start = time.perf_counter()
        run(iterations)
        per_request.append((time.perf_counter() - start) / iterations)
    best, median = min(per_request), statistics.median(per_request)
    return {
        "iterations": iterations, "repeat": repeat,
        "best_us": best * 1e6, "median_us": median * 1e6,
        "best_rps": 1.0 / best, "median_rps": 1.0 / median,
    }


def profile(run: Callable[[int], None], iterations: int, top: int = 40) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    run(iterations)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


#: The bytecodes that look an attribute up or set one (3.11's names).
ATTRIBUTE_OPS = ("LOAD_ATTR", "STORE_ATTR", "LOAD_METHOD")


def count_opcodes(run: Callable[[int], None], requests: int) -> dict[str, Any]:
    """Bytecodes the core's sources execute per request, by kind, with ``sys.settrace``.

    Only Python frames are seen: run it with ``NARWHAL_PURE_PYTHON=1``, where
    the whole core is bytecode. Attribute operations are also split by their
    object: ``self`` (the instruction right after ``LOAD_FAST self``) or any
    other. What the compiled build pays per operation is not shown here: an
    attribute operation in a compiled module is a generic C-API lookup, in
    3.11's interpreter a specialised instruction.
    """
    ops: collections.Counter[str] = collections.Counter()
    on_self: collections.Counter[str] = collections.Counter()
    tables: dict[Any, tuple[list[str], dict[int, bool]]] = {}

    def table(code: Any) -> tuple[list[str], dict[int, bool]]:
        found = tables.get(code)
        if found is None:
            names = ["?"] * (len(code.co_code) + 2)
            after_self: dict[int, bool] = {}
            previous = None
            for ins in dis.get_instructions(code):
                names[ins.offset] = ins.opname
                after_self[ins.offset] = (
                    previous is not None and previous.opname == "LOAD_FAST" and previous.argval == "self"
                )
                previous = ins
            found = tables[code] = (names, after_self)
        return found

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if "narwhal_core" not in frame.f_code.co_filename and "narwhal_core" not in frame.f_globals.get(
            "__name__", ""
        ):
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            names, after_self = table(frame.f_code)
            name = names[frame.f_lasti]
            ops[name] += 1
            if name in ATTRIBUTE_OPS and after_self.get(frame.f_lasti):
                on_self[name] += 1
        return tracer

    run(200)
    sys.settrace(tracer)
    try:
        run(requests)
    finally:
        sys.settrace(None)
    per = {name: n / requests for name, n in ops.items()}
    return {
        "requests": requests,
        "opcodes": sum(per.values()),
        "attribute_ops": {name: per.get(name, 0.0) for name in ATTRIBUTE_OPS},
        "attribute_ops_on_self": {name: on_self[name] / requests for name in ATTRIBUTE_OPS},
        "top": dict(sorted(per.items(), key=lambda item: -item[1])[:12]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20000, help="requests per repeat (default 20000)")
    parser.add_argument("--repeat", type=int, default=5, help="repeats; best and median are reported (default 5)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--profile", action="store_true", help="cProfile path (b): top 15 functions by own time")
    parser.add_argument("--opcodes", action="store_true",
                        help="count the bytecodes path (b) runs per request (needs NARWHAL_PURE_PYTHON=1)")
    parser.add_argument("--only", choices=["decisions", "router", "router-stream"], action="append",
                        help="run only these paths (repeatable)")
    args = parser.parse_args(argv)
    if args.opcodes:
        if core_build()[0] != "pure":
            raise SystemExit("core_bench: --opcodes sees only bytecode: run it with NARWHAL_PURE_PYTHON=1")
        counted = count_opcodes(router_path(), 200)
        if args.json:
            print(json.dumps(counted, indent=2))
            return 0
        attr = counted["attribute_ops"]
        mine = counted["attribute_ops_on_self"]
        print(f"path (b), non-streaming, per request ({counted['requests']} requests, core's bytecode only):")
        print(f"    {counted['opcodes']:,.0f} bytecodes; attribute operations {sum(attr.values()):,.0f} "
              f"({sum(mine.values()):,.0f} on self)")
        for name in ATTRIBUTE_OPS:
            print(f"      {name:<12} {attr[name]:7.0f}   on self {mine[name]:6.0f}")
        print("    most run: " + ", ".join(f"{k} {v:,.0f}" for k, v in counted["top"].items()))
        return 0
    paths: dict[str, Callable[[], Callable[[int], None]]] = {
        "decisions": decisions_path,
        "router": router_path,
        "router-stream": lambda: router_path(stream=True),
    }
    results: dict[str, Any] = {}
    for name, factory in paths.items():
        if args.only and name not in args.only:
            continue
        iterations = args.iterations if name != "router-stream" else max(1, args.iterations // 4)
        results[name] = measure(factory(), iterations, args.repeat)
    profiles = {}
    if args.profile:
        for name in ("router", "router-stream"):
            if not args.only or name in args.only:
                run = paths[name]()
                run(200)
                profiles[name] = profile(run, max(1000, args.iterations // 4))
    if args.json:
        print(json.dumps({"python": sys.version.split()[0], "core": core_build()[0], "results": results,
                          "profiles": profiles}, indent=2))
        return 0
    print(f"narwhal core benchmark (Python {sys.version.split()[0]}, core {core_build()[0]}); "
          "pin with: taskset -c 0")
    labels = {
        "decisions": "(a) decisions only (contract, leg_bodies, answers, journal)",
        "router": "(b) whole router path, non-streaming (codec, legs, journal)",
        "router-stream": "(b) whole router path, streamed (16 SSE events)",
    }
    for name, r in results.items():
        print(f"{labels[name]}\n    best {r['best_rps']:>10,.0f} req/s  {r['best_us']:8.1f} µs/req   "
              f"median {r['median_rps']:>10,.0f} req/s  {r['median_us']:8.1f} µs/req   "
              f"({r['repeat']} x {r['iterations']})")
    for name, text in profiles.items():
        print(f"\ncProfile of {name}: top 15 by tottime\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
