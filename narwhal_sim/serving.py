"""What every flow of one simulated engine shares: its identity, counters, request records and log.

:class:`Serving` is built once per :class:`~narwhal_sim.server.SimEngine` and
handed to each flow (completion, prefill, decode, KV pull, control) at
construction; it points at none of them.
"""

from __future__ import annotations

import hmac
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import orjson

from narwhal_sim.config import SimConfig
from narwhal_sim.http1 import JSON, HttpRequest, ServerConnection
from narwhal_sim.model import FaultPlan, Faults
from narwhal_sim.protocol import ApiError, error_body
from narwhal_sim.tokens import Tokenizer
from narwhal_sim.versions import VllmFamily

__all__ = ["KV_PULL_PATH", "KV_PUSH_PATH", "KV_NOTIFY_PATH", "KV_HEARTBEAT_PATH", "ABORT_PATH", "ABORT_REQUESTS_PATH", "COUNTERS",
           "NO_FAULTS", "Handler", "Routes", "Record", "ClientGone", "Serving", "json_body", "rid_header"]  # fmt: skip

#: The internal route a decode engine pulls KV from (on the prefill engine's listener; NIXL's READ).
KV_PULL_PATH = "/kv/pull"
#: The internal route a decode engine tells a prefill engine to free KV it will not read (NIXL's notification).
KV_NOTIFY_PATH = "/kv/notify"
#: The internal route a push-mode decode engine registers its blocks on (NIXL's PUSH_REG notification).
KV_PUSH_PATH = "/kv/push"
#: The internal route a decode engine renews KV leases on (NIXL's heartbeat, lease family).
KV_HEARTBEAT_PATH = "/kv/heartbeat"
#: The simulator's own (not vLLM's) route that frees the KV of an owner key, ``--abort-request-route``.
ABORT_PATH = "/abort_request"
#: vLLM's ``POST /abort_requests`` (``--tokens-only`` or ``--dev-mode``; external request IDs).
ABORT_REQUESTS_PATH = "/abort_requests"

NO_FAULTS = FaultPlan()

COUNTERS = (
    "requests", "completions", "completions_ok", "errors", "client_gone", "auth_failures", "bad_requests",
    "prompt_tokens", "generation_tokens", "cached_tokens", "recomputed",
    "kv_pulls", "kv_pull_failures", "kv_prompt_mismatch", "kv_releases_sent", "kv_release_failures",
    "kv_params_invalid", "kv_notifs_unrecognized", "kv_heartbeats", "kv_stale_reads", "aborted",
    "faults_error", "faults_drop", "faults_delay", "faults_stall", "faults_drop_after_chunks",
    "faults_omit_kv_params", "faults_malformed_json", "faults_unhealthy", "faults_pull_fail",
    "kv_push_registrations", "kv_pushes", "kv_push_unmatched", "kv_push_registration_timeouts",
    "kv_push_parked", "kv_push_parked_paired", "faults_push_reg_lost",
)  # fmt: skip

Handler = Callable[[ServerConnection, HttpRequest], "Coroutine[Any, Any, None] | None"]
#: A flow's routes: path -> method -> handler.
Routes = dict[str, dict[str, Handler]]


class Record:
    """What the engine received and how it ended (``/sim/requests``, the JSON log)."""

    __slots__ = ("seq", "ts", "method", "target", "headers", "body", "request_id", "status", "outcome", "kv",
                 "started", "duration_ms")  # fmt: skip

    def __init__(self, seq: int, request: HttpRequest, started: float) -> None:
        self.seq = seq
        self.ts = time.time()
        self.method = request.method
        self.target = request.target
        self.headers = request.headers
        self.body = request.body
        self.request_id = request.request_id
        self.status: int | None = None
        self.outcome: str | None = None
        self.kv: dict[str, Any] | None = None
        self.started = started
        self.duration_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "ts": self.ts,
            "method": self.method,
            "path": self.target.decode("latin-1"),
            "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in self.headers],
            "body": self.body.decode("utf-8", "replace"),
            "request_id": self.request_id,
            "status": self.status,
            "outcome": self.outcome,
            "kv": dict(self.kv) if self.kv is not None else None,
            "duration_ms": self.duration_ms,
        }


class ClientGone(Exception):
    pass


class Serving:
    """One engine's identity and settings, its counters, its request records and its JSON log."""

    def __init__(self, config: SimConfig, family: VllmFamily, engine_id: str, *,
                 log_stream: IO[bytes] | None) -> None:  # fmt: skip
        self.config = config
        self.family = family
        self.engine_id = engine_id
        self.flat_errors = not family.nested_errors
        self.faults = config.faults
        self.faults_active = config.faults.active
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.records: deque[Record] = deque(maxlen=config.record_limit)
        self._seq = 0
        self.auth = b"Bearer " + config.api_key.encode() if config.api_key is not None else None
        self.tokenizer: Tokenizer | None = (
            Tokenizer(config.tokenizer, chat_template=config.chat_template) if config.tokenizer else None
        )
        #: With a tokenizer, prompts are rendered and encoded on a thread of their own, not the serving loop
        #: that steps the engine: vLLM's API server tokenizes in its own process, apart from the engine
        #: core's step loop (vLLM V1, ``vllm/v1/engine/async_llm.py``: ``AsyncLLM`` runs the input
        #: processing, the ``EngineCore`` runs in a background process). The ``tokenizers`` library
        #: releases the GIL in ``encode_batch`` (:meth:`Tokenizer.encode`), so the thread runs beside it.
        self.tokenizing: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(1, thread_name_prefix="narwhal-sim-tokenize") if self.tokenizer is not None else None
        )
        # vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST defaults to "localhost" (docs/simulator.md, "vLLM versions").
        self.advertise_host = config.advertise_host or "localhost"
        #: The bound address (set when the engine listens): ``remote_port`` in the KV params it hands out.
        self.host = config.host
        self.port = config.port
        self.url = ""
        self._log_stream = log_stream
        self._log_file: IO[bytes] | None = None

    def open_log(self) -> None:
        """Open the request log the config names, unless a stream was given."""
        if self._log_stream is None and self.config.log not in (None, "none"):
            if self.config.log == "-":
                self._log_stream = sys.stdout.buffer
            elif self.config.log == "stderr":
                self._log_stream = sys.stderr.buffer
            else:
                self._log_file = open(self.config.log, "ab")  # noqa: SIM115 - closed in close()
                self._log_stream = self._log_file

    def close_tokenizing(self) -> None:
        if self.tokenizing is not None:
            self.tokenizing.shutdown(wait=False, cancel_futures=True)

    def close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def set_faults(self, faults: Faults) -> None:
        """Replace the fault settings."""
        self.faults = faults
        self.faults_active = faults.active

    @property
    def logging(self) -> bool:
        return self._log_stream is not None

    def error_body(self, status: int, message: str, *, param: str | None = None) -> bytes:
        """An error body in the shape of the modelled vLLM version (flat before 0.10.1)."""
        return error_body(status, message, param=param, flat=self.flat_errors)

    def authorized(self, request: HttpRequest) -> bool:
        given = request.authorization
        return given is not None and self.auth is not None and hmac.compare_digest(given, self.auth)

    def record(self, request: HttpRequest) -> Record:
        self._seq += 1
        self.counters["requests"] += 1
        record = Record(self._seq, request, time.perf_counter())
        self.records.append(record)
        request.tag = record
        return record

    def answer(
        self,
        conn: ServerConnection,
        request: HttpRequest,
        status: int,
        body: bytes,
        *,
        content_type: bytes | None = JSON,
        outcome: str | None = None,
    ) -> None:
        headers = rid_header(request)
        conn.respond(status, body, content_type=content_type, headers=headers)
        record: Record = request.tag
        record.status = status
        if outcome is not None:
            record.outcome = outcome
        self.finish(record)

    def answer_error(self, conn: ServerConnection, request: HttpRequest, exc: ApiError) -> None:
        self.answer(conn, request, exc.status, exc.body(flat=self.flat_errors))

    def finish(self, record: Record) -> None:
        if record.duration_ms is not None:
            return
        record.duration_ms = round((time.perf_counter() - record.started) * 1000.0, 3)
        if record.outcome is None:
            record.outcome = "ok" if record.status is not None and record.status < 400 else "error"
        if self._log_stream is not None:
            self.log(
                {
                    "ts": record.ts,
                    "event": "request",
                    "engine_id": self.engine_id,
                    "role": self.config.role,
                    "request_id": record.request_id,
                    "method": record.method,
                    "path": record.target.decode("latin-1"),
                    "status": record.status,
                    "outcome": record.outcome,
                    "duration_ms": record.duration_ms,
                    "kv": record.kv,
                }
            )

    def log(self, entry: dict[str, Any]) -> None:
        stream = self._log_stream
        if stream is None:
            return
        try:
            stream.write(orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE))
            stream.flush()
        except (OSError, ValueError):
            self._log_stream = None


def json_body(request: HttpRequest) -> dict[str, Any]:
    try:
        data = orjson.loads(request.body)
    except orjson.JSONDecodeError:
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def rid_header(request: HttpRequest) -> list[tuple[bytes, bytes]] | tuple[()]:
    rid = request.request_id
    return [(b"x-request-id", rid.encode("latin-1"))] if rid is not None else ()
