"""A simulated SGLang engine (``narwhal sim --protocol sglang``): SGLang's bootstrap PD, not vLLM's pull.

A router sends the prefill and the decode engine the same request at once,
each carrying ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``
(sgl-project/sglang, ``sgl-router/src/routers/bootstrap_injector.rs``,
``inject_bootstrap_fields``: the prefill worker's host and bootstrap port, a
random room in [0, 2^63 - 1]). The prefill engine keeps the room on its
bootstrap port (:mod:`narwhal_sim.sglang_rooms`) and answers once the decode
engine has taken the KV; the decode engine waits for the room's KV, bounded by
SGLang's waiting timeout, then decodes. ``POST /abort_request`` (``rid``,
``abort_all``) is SGLang's route (``python/sglang/srt/entrypoints/http_server.py``,
``abort_request``: 200 with no body). docs/simulator.md, "SGLang PD", has the
routes, the faults and the counters.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from typing import Any

import orjson

from narwhal_sim.config import SimConfig
from narwhal_sim.http1 import HttpRequest, HttpServer, Limits, ServerConnection
from narwhal_sim.http_client import EngineClient
from narwhal_sim.sglang_answers import SglangJob, error_body, parse_job, stream_chunks, whole_body
from narwhal_sim.sglang_rooms import Room, RoomFailed, Rooms, collect

__all__ = ["SglangEngine", "SGLANG_FAULTS"]

#: Faults of ``POST /sim/faults`` on a SGLang engine (docs/simulator.md, "SGLang PD").
SGLANG_FAULTS = ("prefill_fails", "prefill_hangs", "decode_dies")

_SSE = b"text/event-stream; charset=utf-8"


class SglangEngine:
    """One simulated SGLang engine (prefill, decode or mixed) on the running asyncio loop."""

    def __init__(self, config: SimConfig) -> None:
        config.check()
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.engine_id = config.engine_id or f"sim-sglang-{config.role}-{uuid.uuid4().hex[:12]}"
        self.counters: Counter[str] = Counter()
        self.faults: dict[str, bool] = dict.fromkeys(SGLANG_FAULTS, False)
        self.records: deque[dict[str, Any]] = deque(maxlen=config.record_limit)
        self._seq = 0
        self.rooms = Rooms(self.counters, bootstrap_timeout_s=config.bootstrap_timeout_s)
        limits = Limits(keep_alive_s=config.keep_alive_s, read_timeout_s=config.read_timeout_s,
                        max_body_bytes=config.max_body_bytes)  # fmt: skip
        self._http = HttpServer(self, limits=limits, loop=self.loop)
        self._bootstrap = HttpServer(self.rooms, limits=limits, loop=self.loop) if config.role == "prefill" else None
        self._client = EngineClient(self.loop, timeout_s=config.waiting_timeout_s + 5.0)
        #: Live decode waits by rid, for ``/abort_request``.
        self._waiting: dict[str, asyncio.Task[int]] = {}
        self.host, self.port, self.url = config.host, config.port, ""
        self.bootstrap_port: int | None = None
        self._routes: dict[tuple[str, str], Callable[[ServerConnection, HttpRequest], Any]] = {
            ("POST", "/v1/completions"): self._completion,
            ("POST", "/v1/chat/completions"): self._completion,
            ("POST", "/abort_request"): self._abort_request,
            ("GET", "/health"): self._health,
            ("GET", "/health_generate"): self._health,
            ("GET", "/get_server_info"): self._server_info,
            ("GET", "/server_info"): self._server_info,
            ("GET", "/get_model_info"): self._model_info,
            ("GET", "/model_info"): self._model_info,
            ("GET", "/v1/models"): self._models,
            ("GET", "/sim/stats"): lambda c, r: c.respond(200, orjson.dumps(self.stats())),
            ("GET", "/sim/requests"): lambda c, r: c.respond(200, orjson.dumps(list(self.records))),
            ("GET", "/sim/faults"): lambda c, r: c.respond(200, orjson.dumps(self.faults)),
            ("POST", "/sim/faults"): self._set_faults,
            ("POST", "/sim/reset"): self._reset,
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self, on_listening: Callable[[SglangEngine], None] | None = None) -> None:
        """Listen (API port, and a prefill engine's bootstrap port), call ``on_listening``, serve."""
        config = self.config
        self.host, self.port = self._http.bind(config.host, config.port)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"
        if self._bootstrap is not None:
            _, self.bootstrap_port = self._bootstrap.bind(config.host, config.bootstrap_port)
            await self._bootstrap.start_serving()
        if on_listening is not None:
            on_listening(self)
        await self._http.start_serving()

    async def close(self) -> None:
        """Stop serving; live rooms are forgotten with the process."""
        for task in list(self._waiting.values()):
            task.cancel()
        await self._http.close()
        if self._bootstrap is not None:
            await self._bootstrap.close()
        self._client.close()

    def stats(self) -> dict[str, Any]:
        """``GET /sim/stats``: the rooms' and decode waits' counters (docs/simulator.md, "SGLang PD")."""
        c = self.counters
        names = ("requests", "completions", "rooms_registered", "rooms_collected", "rooms_timed_out",
                 "rooms_aborted", "rooms_failed", "decode_collected", "decode_timed_out", "decode_aborted",
                 "decode_failed", "aborts", "bad_requests", "faults_prefill_fails", "faults_prefill_hangs",
                 "faults_decode_dies")  # fmt: skip
        stats: dict[str, Any] = {name: c[name] for name in names}
        stats.update(protocol="sglang", role=self.config.role, engine_id=self.engine_id,
                     bootstrap_port=self.bootstrap_port, rooms_held=self.rooms.held(),
                     decode_waiting=len(self._waiting),
                     # Rooms held for the whole bootstrap timeout for a decode that never came: the
                     # prefill-side leak SGLang itself bounds (docs/simulator.md, "SGLang PD").
                     kv_leaked=c["rooms_timed_out"])  # fmt: skip
        return stats

    # ------------------------------------------------------------------ HTTP app

    def handle(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None] | None:
        """Route one request (called by the HTTP layer); every route but ``/sim/*`` is recorded."""
        if not request.path.startswith("/sim/"):
            self._record(request)
        handler = self._routes.get((request.method, request.path))
        if handler is None:
            conn.respond(404, error_body(404, f"Not Found: {request.method} {request.path}"))
            return None
        result: Coroutine[Any, Any, None] | None = handler(conn, request)
        return result

    def abandon(self, request: HttpRequest) -> None:
        self.counters["client_gone"] += 1

    def bad_request(self) -> None:
        self.counters["bad_requests"] += 1

    def _record(self, request: HttpRequest) -> dict[str, Any]:
        self._seq += 1
        self.counters["requests"] += 1
        try:
            body: Any = orjson.loads(request.body) if request.body else None
        except orjson.JSONDecodeError:
            body = request.body[:2000].decode("utf-8", "replace")
        record = {"seq": self._seq, "method": request.method, "path": request.path, "at": time.time(),
                  "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.headers
                              if k.lower() != b"authorization"],
                  "body": body, "status": None, "outcome": None}  # fmt: skip
        request.tag = record
        self.records.append(record)
        return record

    @staticmethod
    def _finish(request: HttpRequest, status: int, outcome: str) -> None:
        if isinstance(request.tag, dict):
            request.tag.update(status=status, outcome=outcome, finished_at=time.time())

    # ------------------------------------------------------------------ small routes

    def _health(self, conn: ServerConnection, request: HttpRequest) -> None:
        conn.respond(200, b"", content_type=None)
        self._finish(request, 200, "ok")

    def _server_info(self, conn: ServerConnection, request: HttpRequest) -> None:
        # http_server.py's get_server_info: the server args, among them the PD mode and bootstrap port.
        info = {"model_path": self.config.model, "served_model_name": self.config.model,
                "disaggregation_mode": "null" if self.config.role == "mixed" else self.config.role,
                "disaggregation_bootstrap_port": self.bootstrap_port, "tp_size": self.config.tp_size,
                "dp_size": 1, "version": "sim"}  # fmt: skip
        conn.respond(200, orjson.dumps(info))
        self._finish(request, 200, "ok")

    def _model_info(self, conn: ServerConnection, request: HttpRequest) -> None:
        info = {"model_path": self.config.model, "tokenizer_path": self.config.model, "is_generation": True}
        conn.respond(200, orjson.dumps(info))
        self._finish(request, 200, "ok")

    def _models(self, conn: ServerConnection, request: HttpRequest) -> None:
        card = {"id": self.config.model, "object": "model", "created": 0, "owned_by": "sglang",
                "root": self.config.model, "max_model_len": self.config.max_model_len}  # fmt: skip
        conn.respond(200, orjson.dumps({"object": "list", "data": [card]}))
        self._finish(request, 200, "ok")

    def _set_faults(self, conn: ServerConnection, request: HttpRequest) -> None:
        try:
            data = orjson.loads(request.body or b"{}")
            unknown = sorted(set(data) - set(SGLANG_FAULTS)) if isinstance(data, dict) else ["(not an object)"]
            if unknown or not all(type(v) is bool for v in data.values()):
                raise ValueError(f"SGLang faults are booleans named {', '.join(SGLANG_FAULTS)}; got {unknown}")
        except (orjson.JSONDecodeError, ValueError) as exc:
            conn.respond(400, error_body(400, str(exc)))
            return
        self.faults = {name: bool(data.get(name, False)) for name in SGLANG_FAULTS}
        conn.respond(200, orjson.dumps(self.faults))

    def _reset(self, conn: ServerConnection, request: HttpRequest) -> None:
        self.counters.clear()
        self.records.clear()
        conn.respond(200, orjson.dumps({"reset": True}))

    def _abort_request(self, conn: ServerConnection, request: HttpRequest) -> None:
        """SGLang's ``POST /abort_request``: ``{"rid", "abort_all"}``, 200 with no body."""
        try:
            data = orjson.loads(request.body)
            if not isinstance(data, dict):
                raise ValueError("the body must be a JSON object")
            rid, abort_all = data.get("rid", ""), data.get("abort_all", False)
            if not isinstance(rid, str) or type(abort_all) is not bool:
                raise ValueError("rid must be a string and abort_all a boolean")
        except (orjson.JSONDecodeError, ValueError) as exc:
            conn.respond(400, error_body(400, f"invalid abort request: {exc}"))
            self._finish(request, 400, "invalid")
            return
        self.counters["aborts"] += 1
        self.rooms.abort_rid(rid, abort_all=abort_all)
        for wait_rid, task in list(self._waiting.items()):
            if abort_all or wait_rid == rid:
                task.cancel(f"Abort request {wait_rid}")
        conn.respond(200, b"", content_type=None)
        self._finish(request, 200, "ok")

    # ------------------------------------------------------------------ completions

    def _completion(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None] | None:
        self.counters["completions"] += 1
        try:
            job = parse_job(request, chat=request.path.endswith("/chat/completions"), config=self.config)
        except RoomFailed as exc:
            self._fail(conn, request, exc, "invalid")
            return None
        role = self.config.role
        if role == "prefill":
            return self._prefill(conn, request, job)
        if role == "decode" and self.faults["decode_dies"]:
            # A decode engine that dies: the connection closes and no one asks for the room's KV.
            self.counters["faults_decode_dies"] += 1
            self._finish(request, 0, "died")
            conn.abort()
            return None
        return self._decode(conn, request, job)

    def _fail(self, conn: ServerConnection, request: HttpRequest, exc: RoomFailed, outcome: str) -> None:
        conn.respond(exc.status, error_body(exc.status, exc.reason))
        self._finish(request, exc.status, outcome)

    async def _prefill(self, conn: ServerConnection, request: HttpRequest, job: SglangJob) -> None:
        """Register the room, wait for the decode side, compute, hand the KV over, answer one token."""
        if job.room is None:
            self._fail(conn, request, RoomFailed("bootstrap_room is required on a prefill engine", status=400),
                       "invalid")  # fmt: skip
            return
        if self.faults["prefill_fails"]:
            # Fails before its room exists: the decode side is never told (docs/simulator.md, "SGLang PD").
            self.counters["faults_prefill_fails"] += 1
            self._fail(conn, request, RoomFailed("prefill failed (injected)"), "failed")
            return
        if self.faults["prefill_hangs"]:
            self.counters["faults_prefill_hangs"] += 1
            await asyncio.Event().wait()
        try:
            entry = self.rooms.register(job.room, job.rid, job.prompt_tokens)
        except RoomFailed as exc:
            self._fail(conn, request, exc, "invalid")
            return
        try:
            await self.rooms.wait_for_decode(entry)
            entry.state = "prefilling"
            await self._sleep(job.prompt_tokens * self.config.prefill_per_token_ms)
            if entry.failure is not None:
                raise entry.failure
            self.rooms.collected(entry)
        except RoomFailed as exc:
            # prefill.py, pop_bootstrapped: a failed sender's request is aborted with 500.
            reason = f"Prefill bootstrap failed for request rid={job.rid!r} bootstrap_room={job.room}: {exc.reason}"
            self._fail(conn, request, RoomFailed(reason, status=exc.status), "failed")
            return
        finally:
            self._fail_live(entry)
        # prefill.py, _process_req: max_new_tokens is 1 on the prefill side; it answers its one token.
        await self._answer(conn, request, job, 1, job.prompt_tokens)

    def _fail_live(self, entry: Room) -> None:
        """A prefill handler leaving (its client gone, cancelled) fails a room not yet concluded."""
        self.rooms.fail(entry, f"Request {entry.room} aborted: its prefill request ended", counter="rooms_failed")

    async def _decode(self, conn: ServerConnection, request: HttpRequest, job: SglangJob) -> None:
        """Wait for the room's KV (a decode engine), then decode and answer."""
        cached = 0
        if self.config.role == "decode":
            if job.room is None or job.bootstrap_host is None or job.bootstrap_port is None:
                self._fail(conn, request, RoomFailed(
                    "bootstrap_host, bootstrap_port and bootstrap_room are required on a decode engine",
                    status=400), "invalid")  # fmt: skip
                return
            wait = asyncio.ensure_future(collect(self._client, job.bootstrap_host, job.bootstrap_port, job.room,
                                                 waiting_timeout_s=self.config.waiting_timeout_s))  # fmt: skip
            self._waiting[job.rid] = wait
            try:
                cached = await wait
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not wait.cancelled() or (current is not None and current.cancelling()):
                    raise  # this handler itself is cancelled (its client left), not an /abort_request
                self.counters["decode_aborted"] += 1
                self._fail(conn, request, RoomFailed(f"Abort request {job.rid}"), "aborted")
                return
            except RoomFailed as exc:
                timed_out = "KVPoll.WaitingForInput" in exc.reason
                self.counters["decode_timed_out" if timed_out else "decode_failed"] += 1
                reason = f"Decode transfer failed for request rid={job.rid!r} bootstrap_room={job.room}: {exc.reason}"
                self._fail(conn, request, RoomFailed(reason), "timed_out" if timed_out else "failed")
                return
            finally:
                self._waiting.pop(job.rid, None)
            self.counters["decode_collected"] += 1
        await self._answer(conn, request, job, job.max_tokens, cached)

    async def _answer(self, conn: ServerConnection, request: HttpRequest, job: SglangJob, tokens: int,
                      cached: int) -> None:  # fmt: skip
        per_token = self.config.decode_per_seq_ms
        if not job.stream:
            await self._sleep(tokens * per_token)
            conn.respond(200, whole_body(job, tokens, cached, seed=self.config.seed))
            self._finish(request, 200, "completed")
            return
        conn.start_stream(200, content_type=_SSE)
        for chunk in stream_chunks(job, tokens, cached, seed=self.config.seed):
            conn.send_chunks([chunk])
            await self._sleep(per_token)
        conn.end_stream()
        self._finish(request, 200, "completed")

    async def _sleep(self, ms: float) -> None:
        speed = self.config.speed
        if speed > 0 and ms > 0:
            await asyncio.sleep(ms / 1000.0 / speed)
