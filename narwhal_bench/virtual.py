"""A fleet in virtual time: the router core in front of modelled engines, one discrete-event loop.

``narwhal bench --virtual --fleet 4P2D`` replays a workload with no sockets
and no sleeping. One heap of timed events drives three kinds of parts:

* **clients** — each request is a client connection: ``ClientConnected`` and
  ``ClientData`` (the same HTTP/1.1 request bytes the socket client sends)
  at its arrival time; the router's ``Transmit`` bytes are read by the same
  :class:`~narwhal_bench.reader.ResponseReader` as on a socket, stamped with
  the virtual time;
* **the router** — a :class:`narwhal_core.Router`, fed events at their
  virtual time; its one deadline is an event on the heap
  (``docs/embedding.md`` describes the contract);
* **engines** — each engine URL of the fleet is an
  :class:`narwhal_sim.engine.EngineCore` (the simulator's own stepping
  model) behind a small HTTP front: a leg's request bytes are parsed and
  validated with the simulator's :mod:`narwhal_sim.protocol`, answers are
  vLLM-shaped (``kv_transfer_params`` on a prefill answer, SSE events for a
  streamed decode) and leave at the virtual time the core gives. A decode
  leg's KV pull takes the modelled transfer time and unpins the blocks on
  the prefill engine, as ``narwhal sim`` does over HTTP.

Time only moves from event to event, so a run costs the work of its
events, not its duration (see docs/bench.md for measured speeds).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import httptools
import orjson

from narwhal_bench.client import Progress, Target, finish_result, request_body
from narwhal_core import (
    Authenticator,
    CancelLeg,
    ClientConnected,
    ClientData,
    CloseClient,
    ControlDone,
    FinishLeg,
    LegData,
    LegFailed,
    Log,
    RidSource,
    Router,
    StartControl,
    StartLeg,
    Transmit,
    WriteJournal,
)
from narwhal_sim.engine import DECODE_REMOTE, PLAIN, PREFILL_REMOTE, EngineCore, EngineRequest, Finished, Started, StepConfig, Tokens
from narwhal_sim.http1 import JSON, response_head
from narwhal_sim.model import generate_tokens, owner_key
from narwhal_sim.protocol import ApiError, StreamFormat, chat_body, completion_body, parse_completion, usage
from narwhal_sim.tokens import CHARS_PER_TOKEN
from narwhal_bench.reader import ResponseReader, request_bytes
from narwhal_bench.stats import HitRate, RequestResult
from narwhal_bench.trace import PromptSynth, TraceRequest

__all__ = ["FleetError", "FleetSpec", "RELAYS", "parse_fleet", "VirtualFleet", "VirtualOutcome", "run_virtual"]

#: How streamed tokens reach the router: each at its step's end, or a run of steps at once.
RELAYS = ("run", "token")


class FleetError(ValueError):
    """A fleet description or engine option that cannot be used."""


@attrs.frozen
class FleetSpec:
    prefill: int
    decode: int
    mixed: int = 0


def parse_fleet(text: str) -> FleetSpec:
    """``4P2D`` (4 prefill, 2 decode), ``2M`` (2 mixed), ``1P1D2M``..."""
    import re

    parts = re.findall(r"(\d+)([PDMpdm])", text)
    if not parts or "".join(n + k for n, k in parts) != text.replace(" ", ""):
        raise FleetError(f"fleet must look like 4P2D or 2M (counts of Prefill, Decode, Mixed engines), got {text!r}")
    counts = {"P": 0, "D": 0, "M": 0}
    for n, kind in parts:
        counts[kind.upper()] += int(n)
    spec = FleetSpec(counts["P"], counts["D"], counts["M"])
    if spec.decode + spec.mixed == 0:
        raise FleetError("a fleet needs at least one decode or mixed engine")
    return spec


# --------------------------------------------------------------------------- the loop


class _Loop:
    __slots__ = ("now", "_heap", "_seq")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (when if when > self.now else self.now, next(self._seq), fn, args))

    def step(self) -> bool:
        if not self._heap:
            return False
        when, _, fn, args = heapq.heappop(self._heap)
        self.now = when
        fn(*args)
        return True


# --------------------------------------------------------------------------- engines


class _LegRequest:
    """httptools callbacks collecting one request (method, path, headers, body)."""

    __slots__ = ("path", "headers", "body", "complete")

    def __init__(self) -> None:
        self.path = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.path += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


def _parse_request(data: bytes) -> tuple[str, bytes, dict[bytes, bytes], bytes]:
    sink = _LegRequest()
    parser = httptools.HttpRequestParser(sink)
    parser.feed_data(data)
    if not sink.complete:
        raise ValueError("incomplete request")
    return parser.get_method().decode(), sink.path.split(b"?", 1)[0], sink.headers, b"".join(sink.body)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Leg:
    __slots__ = ("leg", "rid", "job", "kind", "request_id", "closed", "fmt", "events", "first", "sent",
                 "generated", "cached", "remote", "kv_phase", "node")  # fmt: skip

    def __init__(self, leg: str, node: _EngineNode) -> None:
        self.leg = leg
        self.node = node
        self.rid = ""
        self.job: Any = None
        self.kind = ""
        self.request_id = ""
        self.closed = False
        self.fmt: Any = None
        self.events: list[bytes] | None = None
        self.first = 0
        self.sent = 0
        self.generated = 0
        self.cached = 0
        #: Decode leg: (prefill engine, owner key, block count).
        self.remote: tuple[_EngineNode, str, int] | None = None
        self.kv_phase = ""


class _EngineNode:
    """One engine of the fleet: an EngineCore behind a virtual HTTP front."""

    def __init__(self, fleet: VirtualFleet, url: str, host: str, port: int, role: str, index: int) -> None:
        self.fleet = fleet
        self.loop = fleet.loop
        self.url = url
        self.host = host
        self.port = port
        self.role = role
        self.engine_id = f"virtual-{role}-{index}"
        if fleet.relay == "token":
            try:
                # One step per token: every token leaves at its own step's end.
                self.core = EngineCore(fleet.step_config, coalesce=False)
            except TypeError:  # a core that always coalesces runs: _kick and _wake split them
                self.core = EngineCore(fleet.step_config)
        else:
            # Runs of identical decode steps are one output; their tokens leave together.
            self.core = EngineCore(fleet.step_config)
        self.legs: dict[str, _Leg] = {}  # router leg id -> leg
        self.by_rid: dict[str, _Leg] = {}  # core request id -> leg
        self.held: dict[str, float] = {}  # owner -> lease expiry
        self._wake_at: float | None = None
        self._owner_seq = 0
        self.counters = {"requests": 0, "errors": 0, "pulls": 0, "pull_misses": 0, "released": 0, "expired": 0}

    # -- requests

    def start_leg(self, leg_id: str, data: bytes) -> None:
        leg = _Leg(leg_id, self)
        self.legs[leg_id] = leg
        self.counters["requests"] += 1
        fleet = self.fleet
        try:
            try:
                method, path, headers, body = _parse_request(data)
            except (ValueError, httptools.HttpParserError) as exc:
                raise ApiError(400, f"bad request: {exc}") from None
            chat = path.rstrip(b"/").endswith(b"/chat/completions")
            if method != "POST" or not (chat or path.rstrip(b"/").endswith(b"/completions")):
                raise ApiError(404, f"no route {method} {path.decode('latin-1')}")
            job = parse_completion(body, chat=chat, served_model=fleet.model, max_model_len=fleet.max_model_len)
            mode = job.kv.mode if job.kv is not None else None
            if mode == "prefill":
                if self.role == "decode":
                    raise ApiError(400, "this is a decode engine: it does not take do_remote_decode requests",
                                   param="kv_transfer_params")  # fmt: skip
                if job.stream:
                    raise ApiError(400, "streaming is not supported for prefill requests", param="stream")
            elif mode in ("decode", "invalid") and self.role == "prefill":
                raise ApiError(400, "this is a prefill engine: it does not take do_remote_prefill requests",
                               param="kv_transfer_params")  # fmt: skip
            leg.job = job
            leg.request_id = headers.get(b"x-request-id", b"").decode("latin-1") or leg_id
            if mode == "prefill":
                leg.kind = PREFILL_REMOTE
                while True:
                    self._owner_seq += 1
                    rid = owner_key(fleet.seed, leg.request_id, self._owner_seq)
                    if rid not in self.by_rid and rid not in self.held:
                        break
            else:
                leg.kind = DECODE_REMOTE if mode == "decode" else PLAIN
                rid = f"{leg_id}#{self._owner_seq}"
                self._owner_seq += 1
            if mode == "decode":
                kv: Any = job.kv
                source = fleet.engine_at(kv.remote_host, kv.remote_port)
                if source is None:
                    # Nowhere to pull from: vLLM recomputes the prompt.
                    leg.kind = PLAIN
                else:
                    leg.remote = (source, kv.remote_request_id, len(kv.remote_block_ids or ()))
                    leg.kv_phase = "pending"
            leg.rid = rid
            prompt = job.prompt
            request = EngineRequest(
                request_id=rid,
                kind=leg.kind,
                prompt_tokens=prompt.num_tokens,
                max_tokens=job.max_tokens,
                block_hashes=fleet.prompt_hashes(prompt) if fleet.step_config.prefix_caching else (),
            )
            try:
                self.core.add_request(request, now=self.loop.now)
            except ValueError as exc:
                raise ApiError(400, str(exc)) from None
        except ApiError as exc:
            self.counters["errors"] += 1
            self._release_remote(leg)
            self._send(leg, self._whole(exc.status, exc.body()))
            return
        self.by_rid[rid] = leg
        self._kick()

    def leg_closed(self, leg_id: str, *, cancelled: bool) -> None:
        leg = self.legs.pop(leg_id, None)
        if leg is None:
            return
        leg.closed = True
        if leg.rid and self.by_rid.pop(leg.rid, None) is not None:
            self.core.abort(leg.rid, now=self.loop.now)
            self._kick()
        if cancelled:
            self._release_remote(leg)

    # -- KV ownership (prefill side)

    def take_kv(self, owner: str, *, outcome: str) -> bool:
        """Unpin the KV held for ``owner`` (pulled or released); ``False`` if none is held."""
        if self.held.pop(owner, None) is None:
            return False
        self.core.free_held(owner, now=self.loop.now)
        self.counters["pulls" if outcome == "pulled" else "released"] += 1
        self._kick()
        return True

    def _expire(self, owner: str, expiry: float) -> None:
        if self.held.get(owner) == expiry:
            del self.held[owner]
            self.core.free_held(owner, now=self.loop.now)
            self.counters["expired"] += 1
            self._kick()

    def _release_remote(self, leg: _Leg) -> None:
        # A decode leg that ends before its pull frees the prefill engine's KV (vLLM does).
        if leg.remote is not None and leg.kv_phase == "pending":
            leg.kv_phase = "released"
            source, owner, _ = leg.remote
            source.take_kv(owner, outcome="released")

    # -- stepping

    def _kick(self) -> None:
        core = self.core
        when = core.next_event_time()
        if when is None:
            return
        step = getattr(core, "_step", None) if self.fleet.relay == "token" else None
        if step is not None and step.count > 1 and step.dur > 0:
            # A run of identical decode steps reports at its end: wake at every
            # step instead, so each token leaves at its own time.
            now = self.loop.now
            done = int((now - step.start) / step.dur + 1e-9)
            boundary = step.start + (done + 1) * step.dur
            if boundary < when:
                when = boundary
        if self._wake_at is not None and self._wake_at <= when:
            return
        self._wake_at = when
        self.loop.at(when, self._wake, when)

    def _wake(self, when: float) -> None:
        if self._wake_at != when:
            return
        self._wake_at = None
        core = self.core
        now = self.loop.now
        step = getattr(core, "_step", None) if self.fleet.relay == "token" else None
        if step is not None and step.count > 1 and now < step.end - 1e-9:
            core._changed(now)  # noqa: SLF001 - cut the run at this step boundary (see _kick)
        self._outputs(core.advance(now=now))
        self._kick()

    def _outputs(self, outputs: Sequence[Any]) -> None:
        for out in outputs:
            leg = self.by_rid.get(out.request_id)
            if leg is None:
                continue
            kind = type(out)
            if kind is Tokens:
                self._tokens(leg, out.count, out.at, out.step_s)
            elif kind is Started:
                leg.cached = out.cached_tokens
                if leg.kind == DECODE_REMOTE and leg.remote is not None:
                    blocks = leg.remote[2]
                    self.loop.at(self.loop.now + self.fleet.step_config.transfer_s(blocks), self._pulled, leg)
            elif kind is Finished:
                self._finished(leg, out)

    def _pulled(self, leg: _Leg) -> None:
        if leg.closed or leg.kv_phase != "pending" or leg.remote is None:
            return
        source, owner, _ = leg.remote
        ok = source.take_kv(owner, outcome="pulled")
        leg.kv_phase = "pulled" if ok else "failed"
        if not ok:
            self.counters["pull_misses"] += 1
        self.core.kv_loaded(leg.rid, now=self.loop.now, ok=ok)
        self._kick()

    # -- answers

    def _stream_events(self, leg: _Leg) -> list[bytes]:
        job = leg.job
        rid = leg.request_id
        fmt = StreamFormat(response_id=("chatcmpl-" if job.chat else "cmpl-") + rid, created=0, model=self.fleet.model,
                           chat=job.chat, mode="text", tool_name=None, digest=job.prompt.digest)  # fmt: skip
        tokens = generate_tokens(self.fleet.seed, job.prompt.digest, job.max_tokens, chat=job.chat)
        answer_usage = usage(job.prompt.num_tokens, job.max_tokens, self._cached(leg)) if job.include_usage else None
        leg.first = fmt.first_token_event()
        return fmt.events(tokens, answer_usage)

    def _cached(self, leg: _Leg) -> int:
        # A decode engine counts every transferred prompt token as cached, as narwhal sim does.
        return int(leg.job.prompt.num_tokens) if leg.kv_phase == "pulled" else leg.cached

    def _tokens(self, leg: _Leg, count: int, at: float, step_s: float) -> None:
        job = leg.job
        leg.generated += count
        if not job.stream or leg.kind == PREFILL_REMOTE:
            return
        times = [at - (count - 1 - i) * step_s for i in range(count)]
        head = b""
        if leg.events is None:
            leg.events = self._stream_events(leg)
            # The response head, and any event before the first token (a chat answer's role).
            head = self._head(leg, None)
            if leg.first:
                head += _chunk(b"".join(leg.events[: leg.first]))
            leg.sent = leg.first
        events = leg.events
        start = leg.sent
        upto = min(start + count, len(events))
        leg.sent = upto
        if self.fleet.relay == "token":
            for i, k in enumerate(range(start, upto)):
                self._send(leg, (head if i == 0 else b"") + _chunk(events[k]), times[i])
        else:
            # One read for the run; the client takes each token's time from its step.
            data = head + _chunk(b"".join(events[start:upto]))
            self._send(leg, data, at, times[: upto - start])

    def _finished(self, leg: _Leg, out: Any) -> None:
        self.by_rid.pop(leg.rid, None)
        job = leg.job
        fleet = self.fleet
        if leg.kind == PREFILL_REMOTE:
            owner = leg.rid
            expiry = self.loop.now + fleet.kv_lease_s
            self.held[owner] = expiry
            self.loop.at(expiry, self._expire, owner, expiry)
            params: dict[str, Any] | None = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": list(out.block_ids),
                "remote_engine_id": self.engine_id,
                "remote_request_id": owner,
                "remote_host": self.host,
                "remote_port": self.port,
                "tp_size": 1,
            }
            n_out = 1
        else:
            params = None
            n_out = job.max_tokens
        if job.stream and leg.kind != PREFILL_REMOTE:
            events = leg.events or []
            self._send(leg, _chunk(b"".join(events[leg.sent :])) + b"0\r\n\r\n")
            return
        tokens = generate_tokens(fleet.seed, job.prompt.digest, n_out, chat=job.chat)
        answer_usage = usage(job.prompt.num_tokens, n_out, self._cached(leg))
        rid = leg.request_id
        if job.chat:
            body = chat_body(response_id="chatcmpl-" + rid, created=0, model=fleet.model, tokens=tokens, mode="text",
                             tool_name=None, digest=job.prompt.digest, usage=answer_usage,
                             kv_transfer_params=params)  # fmt: skip
        else:
            body = completion_body(response_id="cmpl-" + rid, created=0, model=fleet.model, text="".join(tokens),
                                   usage=answer_usage, kv_transfer_params=params)  # fmt: skip
        self._send(leg, self._whole(200, orjson.dumps(body), leg))

    def _head(self, leg: _Leg, length: int | None, status: int = 200) -> bytes:
        extra = [(b"x-request-id", leg.request_id.encode("latin-1"))] if leg.request_id else ()
        content_type = b"text/event-stream; charset=utf-8" if length is None else JSON
        return response_head(status, content_type=content_type, length=length, keep_alive=True, extra=extra)

    def _whole(self, status: int, body: bytes, leg: _Leg | None = None) -> bytes:
        extra = [(b"x-request-id", leg.request_id.encode("latin-1"))] if leg is not None and leg.request_id else ()
        return response_head(status, content_type=JSON, length=len(body), keep_alive=True, extra=extra) + body

    def _send(self, leg: _Leg, data: bytes, at: float | None = None, stamps: list[float] | None = None) -> None:
        self.loop.at(self.loop.now if at is None else at, self.fleet.deliver, leg, data, stamps)


# --------------------------------------------------------------------------- the fleet


@attrs.define
class VirtualOutcome:
    results: list[RequestResult]
    hit_rate: HitRate
    virtual_s: float
    wall_s: float
    engines: dict[str, dict[str, Any]]
    #: Engine reads (``LegData``) the router processed.
    leg_reads: int = 0


class _Client:
    __slots__ = ("conn", "request", "data", "result", "reader", "sent", "done")

    def __init__(self, conn: int, request: TraceRequest, data: bytes, result: RequestResult) -> None:
        self.conn = conn
        self.request = request
        self.data = data
        self.result = result
        self.reader = ResponseReader()
        self.sent = 0.0
        self.done = False


class VirtualFleet:
    """The router core and the fleet's engines on one virtual clock."""

    def __init__(self, *, fleet: str = "4P2D", model: str = "meta-llama/Llama-3.1-8B-Instruct",
                 engine_options: Sequence[str] = (), router_config: str | None = None,
                 config: Any = None, relay: str = "run") -> None:  # fmt: skip
        spec = parse_fleet(fleet)
        if relay not in RELAYS:
            raise FleetError(f"relay must be one of {', '.join(RELAYS)}")
        #: ``token``: every token reaches the router at its own step's end; ``run``: a run of
        #: identical decode steps reaches it in one read at the run's end, each token
        #: stamped with its own step's end for the client (docs/bench.md).
        self.relay = relay
        options = _engine_options(engine_options)
        self.model = model
        self.seed = int(options.pop("seed", 0))
        self.kv_lease_s = float(options.pop("kv_lease_s", 30.0))
        self.max_model_len = int(options.pop("max_model_len", 131_072))
        if "max_num_batched_tokens" not in options and options.get("chunked_prefill") is False:
            options["max_num_batched_tokens"] = max(self.max_model_len, 8192)  # as narwhal sim does
        try:
            self.step_config = StepConfig(**options)
            self.step_config.check()
        except (TypeError, ValueError) as exc:
            raise FleetError(f"engine options: {exc}") from None
        self.loop = _Loop()
        self.engines: dict[str, _EngineNode] = {}
        self._by_address: dict[tuple[str, int], _EngineNode] = {}
        prefill_urls: list[str] = []
        decode_urls: list[str] = []
        for role, count, urls, net in (("prefill", spec.prefill, (prefill_urls,), 1),
                                        ("decode", spec.decode, (decode_urls,), 2),
                                        # Mixed engines serve both legs beside prefill engines, else
                                        # whole requests (one leg each).
                                        ("mixed", spec.mixed, (prefill_urls, decode_urls) if spec.prefill
                                         else (decode_urls,), 3)):  # fmt: skip
            for i in range(count):
                host, port = f"10.{net}.0.{i + 1}", 8000 + net * 100
                url = f"http://{host}:{port}"
                node = _EngineNode(self, url, host, port, role, i)
                self.engines[url] = node
                self._by_address[(host, port)] = node
                for target in urls:
                    target.append(url)
        self.config = self._router_config(config, router_config, prefill_urls, decode_urls)
        self.router = Router(
            self.config,
            rid_source=RidSource("virtual"),
            authenticator=Authenticator.from_config(self.config.ingress, None),
            wall_offset=0.0,
            now=0.0,
        )
        self._deadline: float | None = None
        self._clients: dict[int, _Client] = {}
        self._leg_engine: dict[str, _EngineNode] = {}
        self._leg_conn: dict[str, Any] = {}
        #: LegData events fed to the router.
        self.leg_reads = 0
        self.journal_lines = 0
        self._recent_hashes: dict[Any, list[int]] = {}
        self.logs: list[tuple[str, Any]] = []
        # The router asks for its first probes as soon as it is built (docs/embedding.md).
        self._drain()

    def _router_config(self, config: Any, path: str | None, prefill: list[str], decode: list[str]) -> Any:
        from narwhal_core.config import Config, EngineConfig, IngressConfig, JournalConfig, ModelConfig

        if config is None and path is not None:
            from narwhal_runtime.app import load_config
            from narwhal_core.errors import ConfigError

            try:
                config = load_config(path)
            except ConfigError as exc:
                raise FleetError(exc.line()) from None
        if config is None:
            config = Config(model=ModelConfig(name=self.model), ingress=IngressConfig(listen="127.0.0.1:0"),
                            engine=EngineConfig(prefill=prefill, decode=decode), journal=JournalConfig(path="-"))  # fmt: skip
        else:
            config = attrs.evolve(config, engine=attrs.evolve(config.engine, prefill=tuple(prefill),
                                                              decode=tuple(decode)))  # fmt: skip
        return config

    # -- engines

    def engine_at(self, host: Any, port: Any) -> _EngineNode | None:
        return self._by_address.get((host, port)) if isinstance(host, str) and type(port) is int else None

    def prompt_hashes(self, prompt: Any) -> list[int]:
        """Chained keys of the prompt's full blocks: the blocks ``narwhal sim`` hashes, keyed faster.

        ``narwhal sim`` hashes each full block's token ids with SHA-256 (stable
        across processes, for KV events); a virtual engine publishes no events,
        so it keys the same 16-token pieces of the prompt with Python's own
        ``hash((parent, piece))``: equal prefixes get equal keys, as there, at a
        fraction of the cost.
        """
        size = self.step_config.block_size
        if prompt.token_ids is not None:
            seq: Any = prompt.token_ids
            unit = size
        else:
            seq = prompt.text or ""
            unit = size * CHARS_PER_TOKEN
        # A request's prefill and decode legs carry the same prompt: remember the last few.
        recent = self._recent_hashes
        out = recent.get(seq)
        if out is not None:
            return out
        full = prompt.num_tokens // size
        out = []
        key = 0
        for start in range(0, full * unit, unit):
            key = hash((key, seq[start : start + unit]))
            out.append(key)
        recent[seq] = out
        if len(recent) > 512:
            del recent[next(iter(recent))]
        return out

    def deliver(self, leg: _Leg, data: bytes, stamps: list[float] | None = None) -> None:
        if leg.closed:
            return
        if stamps:
            client = self._clients.get(self._leg_conn.get(leg.leg))  # type: ignore[arg-type]
            if client is not None:
                client.reader.stamps.extend(stamps)
        self.leg_reads += 1
        self._feed(LegData(leg.leg, data))

    # -- the router

    def _feed(self, event: Any) -> None:
        self.router.receive(event, now=self.loop.now)
        self._drain()

    def _drain(self) -> None:
        router = self.router
        now = self.loop.now
        while True:
            cmd: Any = router.next_output()
            if cmd is None:
                break
            kind = type(cmd)
            if kind is Transmit:
                client = self._clients.get(cmd.conn)
                if client is not None and not client.done:
                    try:
                        client.reader.feed(cmd.data, now)
                    except ValueError as exc:
                        client.result.error = str(exc)
                        self._finish(client)
                        continue
                    if client.reader.complete:
                        self._finish(client)
            elif kind is WriteJournal:
                self.journal_lines += 1
            elif kind is StartLeg:
                node = self.engines.get(cmd.engine.url)
                if node is None:
                    self.loop.at(now, self._feed, LegFailed(cmd.leg, "connect_failed"))
                else:
                    self._leg_engine[cmd.leg] = node
                    self._leg_conn[cmd.leg] = cmd.conn
                    node.start_leg(cmd.leg, cmd.data)
            elif kind is FinishLeg or kind is CancelLeg:
                self._leg_conn.pop(cmd.leg, None)
                node = self._leg_engine.pop(cmd.leg, None)
                if node is not None:
                    node.leg_closed(cmd.leg, cancelled=kind is CancelLeg)
            elif kind is CloseClient:
                client = self._clients.pop(cmd.conn, None)
                if client is not None and not client.done:
                    client.reader.eof()
                    self._finish(client)
            elif kind is StartControl:
                self._control(cmd)
            elif kind is Log:
                if len(self.logs) < 1000:
                    self.logs.append((cmd.event, cmd.fields))
        self._arm()

    def _arm(self) -> None:
        deadline = self.router.get_deadline()
        if deadline is not None and deadline != self._deadline:
            self._deadline = deadline
            self.loop.at(deadline, self._fire, deadline)

    def _fire(self, deadline: float) -> None:
        if self._deadline != deadline:
            return
        self._deadline = None
        current = self.router.get_deadline()
        if current is not None and current <= self.loop.now + 1e-9:
            self.router.handle_deadline(now=self.loop.now)
            self._drain()
        else:
            self._arm()

    def _control(self, cmd: Any) -> None:
        now = self.loop.now
        node = self.engines.get(cmd.engine.url)
        if cmd.drop_after_send:
            # decode_abort: a decode request carrying the KV params, closed at once: the
            # decode engine frees the prefill engine's KV without computing anything.
            try:
                _, _, _, body = _parse_request(cmd.data)
                params = orjson.loads(body).get("kv_transfer_params") or {}
                source = self.engine_at(params.get("remote_host"), params.get("remote_port"))
                if source is not None and isinstance(params.get("remote_request_id"), str):
                    source.take_kv(params["remote_request_id"], outcome="released")
            except (ValueError, httptools.HttpParserError, AttributeError):
                pass
            self.loop.at(now, self._feed, ControlDone(cmd.key, None, None))
            return
        if node is None:
            self.loop.at(now, self._feed, ControlDone(cmd.key, None, "connect_failed"))
            return
        if getattr(cmd, "resolve", False):
            # A probe that resolves the engine's name first: its "addresses" are its host.
            from narwhal_core.events import EngineResolved  # type: ignore[attr-defined,unused-ignore]

            self.loop.at(now, self._feed, EngineResolved(cmd.engine, (cmd.engine.host,)))
        target = cmd.target.split("?", 1)[0]
        if cmd.method == "POST" and target == self.config.engine.abort_path:
            try:
                owner = orjson.loads(cmd.body).get("request_id")
            except (orjson.JSONDecodeError, AttributeError):
                owner = None
            released = isinstance(owner, str) and node.take_kv(owner, outcome="released")
            answer = orjson.dumps({"request_id": owner, "released": released})
            self.loop.at(now, self._feed, ControlDone(cmd.key, 200, None, body=answer))
        else:
            # Health probes and anything else an engine answers with 200.
            self.loop.at(now, self._feed, ControlDone(cmd.key, 200, None))

    # -- clients

    def _start(self, client: _Client) -> None:
        client.sent = self.loop.now
        client.result.sent_s = client.sent
        self._clients[client.conn] = client
        self._feed(ClientConnected(client.conn, "10.255.0.1", 10000 + client.conn % 50000))
        if client.conn in self._clients:
            self._feed(ClientData(client.conn, client.data))

    def _finish(self, client: _Client) -> None:
        if client.done:
            return
        client.done = True
        finish_result(client.result, client.reader, client.sent, self.loop.now)
        self._on_finish(client)

    def _on_finish(self, client: _Client) -> None:  # replaced by run()
        pass

    def run(self, requests: Sequence[TraceRequest], target: Target, *, synth: PromptSynth,
            concurrency: int = 0, progress: Progress | None = None) -> VirtualOutcome:  # fmt: skip
        """Replay ``requests``; returns when every one has its answer (or its error)."""
        wall = time.perf_counter()
        loop = self.loop
        results = [RequestResult(index=r.index, scheduled_s=r.arrival_s, input_length=r.input_length,
                                 output_length=r.output_length) for r in requests]  # fmt: skip
        items = list(zip(requests, results))
        waiting: list[_Client] = []
        state = {"out": 0, "left": len(requests)}
        authority = "narwhal.virtual"

        def arrive(i: int) -> None:
            request, result = items[i]
            body = request_body(request, synth.prompt(request), target)
            data = request_bytes(authority, target.path(), body, api_key=target.api_key, keep_alive=False,
                                 extra=target.headers)
            client = _Client(request.index, request, data, result)
            if i + 1 < len(items):
                loop.at(items[i + 1][0].arrival_s, arrive, i + 1)
            if concurrency > 0 and state["out"] >= concurrency:
                waiting.append(client)
            else:
                state["out"] += 1
                self._start(client)

        def finished(client: _Client) -> None:
            state["out"] -= 1
            state["left"] -= 1
            if progress is not None:
                progress.update(ok=client.result.ok, now=time.perf_counter())
            if waiting:
                state["out"] += 1
                loop.at(loop.now, self._start, waiting.pop(0))

        self._on_finish = finished  # type: ignore[method-assign]
        if progress is not None:
            progress.start(wall)
        if items:
            loop.at(items[0][0].arrival_s, arrive, 0)
        while state["left"] > 0 and loop.step():
            pass
        for client in list(self._clients.values()):
            if not client.done:
                client.result.error = client.result.error or "no answer (the virtual fleet went idle)"
                self._finish(client)
        virtual_s = loop.now
        hits = queries = 0.0
        per: dict[str, float | None] = {}
        engines: dict[str, dict[str, Any]] = {}
        for url, node in self.engines.items():
            m = node.core.metrics()
            hits += m.prefix_cache_hits
            queries += m.prefix_cache_queries
            if m.prefix_cache_queries:
                per[url] = m.prefix_cache_hits / m.prefix_cache_queries
            engines[url] = {"role": node.role, **node.counters, "steps": m.steps,
                            "prefix_cache_queries": m.prefix_cache_queries,
                            "prefix_cache_hits": m.prefix_cache_hits}  # fmt: skip
        return VirtualOutcome(results=results, hit_rate=HitRate(hits=hits, queries=queries, per_engine=per),
                              virtual_s=virtual_s, wall_s=time.perf_counter() - wall, engines=engines,
                              leg_reads=self.leg_reads)  # fmt: skip


def _engine_options(items: Sequence[str]) -> dict[str, Any]:
    types = {f.name: f.type for f in attrs.fields(StepConfig)}
    extra = {"seed": "int", "kv_lease_s": "float", "max_model_len": "int"}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or (name not in types and name not in extra):
            known = ", ".join(sorted([*types, *extra]))
            raise FleetError(f"engine option must be NAME=VALUE with NAME one of {known}; got {item!r}")
        kind = str(types.get(name) or extra[name])
        try:
            if "bool" in kind:
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                out[name] = value.lower() in ("true", "1", "yes")
            elif "int" in kind:
                out[name] = int(value)
            else:
                out[name] = float(value)
        except ValueError:
            raise FleetError(f"engine option {name}: {value!r} is not a {kind}") from None
    return out


def run_virtual(requests: Sequence[TraceRequest], target: Target, *, synth: PromptSynth, fleet: str = "4P2D",
                engine_options: Sequence[str] = (), router_config: str | None = None, concurrency: int = 0,
                progress: Progress | None = None, config: Any = None, relay: str = "run") -> VirtualOutcome:  # fmt: skip
    """Build a :class:`VirtualFleet` and replay ``requests`` through it."""
    virtual = VirtualFleet(fleet=fleet, model=target.model, engine_options=engine_options,
                           router_config=router_config, config=config, relay=relay)  # fmt: skip
    return virtual.run(requests, target, synth=synth, concurrency=concurrency, progress=progress)
