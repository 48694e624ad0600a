"""The simulated engine: an OpenAI-compatible server that speaks the PD protocol of docs/simulator.md.

:class:`SimEngine` wires the pure model (:mod:`narwhal_sim.model`) and the
wire shapes (:mod:`narwhal_sim.protocol`) to the HTTP layer
(:mod:`narwhal_sim.http1`). It runs on one asyncio loop.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health``, ``GET /v1/models``, ``GET /metrics``,
``POST /abort_request`` (free the KV of an owner key), ``POST /kv/pull``
(the internal KV pull a decode engine sends to the prefill engine named by
``remote_host``/``remote_port``), and the control routes ``/sim/stats``,
``/sim/requests``, ``/sim/reset``, ``/sim/faults`` (never authenticated,
never recorded).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import os
import sys
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Coroutine, Sequence
from typing import IO, Any

import attrs
import orjson

from narwhal_sim.kv_events import KvEventPublisher
from narwhal_sim.tokens import CHARS_PER_TOKEN, Tokenizer, pseudo_token_text
from narwhal_sim.http1 import JSON, EngineClient, HttpRequest, HttpServer, Limits, ServerConnection
from narwhal_sim.engine import (
    DECODE_REMOTE,
    PLAIN,
    PREFILL_REMOTE,
    EngineCore,
    EngineOutput,
    EngineRequest,
    Finished,
    Started,
    StepConfig,
    Tokens,
)
from narwhal_sim.model import (
    ROLES,
    FaultPlan,
    Faults,
    FaultsError,
    KvEntry,
    KvLedger,
    Prompt,
    PromptError,
    generate_tokens,
    owner_key,
)
from narwhal_sim.versions import VllmFamily, kv_event_maps, resolve_version
from narwhal_sim.protocol import (
    ApiError,
    CompletionJob,
    KvParams,
    flat_block_ids,
    StreamFormat,
    chat_body,
    completion_body,
    error_body,
    parse_completion,
    usage,
)

__all__ = ["SimConfig", "SimEngine", "KV_PULL_PATH", "KV_NOTIFY_PATH", "KV_HEARTBEAT_PATH", "ABORT_PATH",
           "ABORT_REQUESTS_PATH", "DEFAULT_MODEL"]  # fmt: skip

#: The internal route a decode engine pulls KV from (on the prefill engine's listener; NIXL's READ).
KV_PULL_PATH = "/kv/pull"
#: The internal route a decode engine tells a prefill engine to free KV it will not read (NIXL's notification).
KV_NOTIFY_PATH = "/kv/notify"
#: The internal route a decode engine renews KV leases on (NIXL's heartbeat, lease family).
KV_HEARTBEAT_PATH = "/kv/heartbeat"
#: The simulator's own (not vLLM's) route that frees the KV of an owner key, ``--abort-request-route``.
ABORT_PATH = "/abort_request"
#: vLLM's ``POST /abort_requests`` (``--tokens-only`` or ``--dev-mode``; external request IDs).
ABORT_REQUESTS_PATH = "/abort_requests"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"

_SSE = b"text/event-stream; charset=utf-8"
_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"
_NO_FAULTS = FaultPlan()


@attrs.frozen(kw_only=True)
class SimConfig:
    """Every setting of one simulated engine; each has a ``narwhal sim`` flag of the same name."""

    #: ``prefill``, ``decode`` or ``mixed`` (both, like vLLM's ``kv_both``).
    role: str = "mixed"
    #: Address to listen on; port 0 picks a free port.
    host: str = "127.0.0.1"
    port: int = 0
    #: The served model name; requests naming another model get 404.
    model: str = DEFAULT_MODEL
    #: Seeds the output text, the KV owner suffixes and every fault decision.
    seed: int = 0
    #: Divides every modelled time; 0 answers at once without sleeping.
    speed: float = 1.0
    #: Required bearer credential on every route but ``/sim/*``; sent on KV pulls and releases.
    api_key: str | None = None
    #: ``remote_engine_id`` of this engine; random per start when ``None``.
    engine_id: str | None = None
    #: ``remote_host`` handed to decode engines; the listen host when ``None`` (127.0.0.1 for a wildcard).
    advertise_host: str | None = None
    #: ``tp_size`` reported in ``kv_transfer_params``.
    tp_size: int = 1
    #: The vLLM version family modelled (docs/simulator.md, "vLLM versions"): a family name
    #: (``0.9``, ``0.10``, ``0.11``, ``0.14``, ``0.18``, ``lease``, ``0.28``) or a release like ``0.14.1``; ``None``: ``0.28``.
    vllm_version: str | None = None
    #: ``usage.prompt_tokens_details`` is filled (vLLM's ``--enable-prompt-tokens-details``); else ``null``.
    enable_prompt_tokens_details: bool = False
    #: vLLM's ``--tokens-only``: ``POST /abort_requests`` (fire and forget), where the family has it.
    tokens_only: bool = False
    #: vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``): ``POST /abort_requests`` answering ``{"status", "aborted"}``.
    dev_mode: bool = False
    #: Serve the simulator's own ``POST /abort_request`` (no vLLM has it; SGLang has a route of that name):
    #: ``True``/``"json"`` answers ``{"request_id", "released", "num_blocks"}``; ``"bare"`` answers 200 with
    #: no body, as SGLang does.
    abort_request_route: bool | str = False
    #: Real milliseconds the serving layer takes before a request reaches the engine (rendering,
    #: tokenizing); a decode request whose client leaves within it never reached the engine.
    pre_admission_ms: float = 0.0
    #: A decode request whose ``kv_transfer_params`` lack a field the connector reads: ``reject`` (400),
    #: ``recompute`` (warn and recompute, what the connector's validity check does) or ``crash`` (the
    #: engine dies: 500 on every later completion, as CVE-2026-94622 describes).
    incomplete_kv_params: str = "reject"
    #: The NIXL connector's ``transfer_mode`` (lease family only): ``pull`` (the decode engine reads the
    #: blocks) or ``push`` (vLLM's push scheduler: prefill answers say ``transfer_mode: "push"``; see
    #: docs/simulator.md, "vLLM versions").
    kv_transfer_mode: str = "pull"
    #: Tokens per KV block.
    block_size: int = 16
    #: KV blocks of the engine (28,000 x 16 tokens ~ an H100 80 GB serving Llama-3.1-8B).
    num_gpu_blocks: int = 28_000
    #: Sequences running at once; more wait in a FCFS queue.
    max_num_seqs: int = 256
    #: Token budget of one engine step; ``None``: 8192, or ``max_model_len`` without chunked prefill.
    max_num_batched_tokens: int | None = None
    #: Split prompts over steps when they do not fit the budget.
    chunked_prefill: bool = True
    #: Longest prompt plus output, in tokens.
    max_model_len: int = 131_072
    #: Seconds a prefill engine holds unpulled KV before freeing it as *expired* (wall clock);
    #: ``None``: the version family's (120 s, 480 s, or the 30 s lease).
    kv_lease_s: float | None = None
    #: vLLM's ``kv_connector_extra_config.bidirectional_kv_xfer`` on a decode engine (``0.28`` family on):
    #: a finished decode request's answer carries the engine's own ``kv_transfer_params`` and its
    #: blocks stay held for ``decoder_kv_blocks_ttl_s`` (docs/simulator.md, "vLLM versions").
    bidirectional_kv: bool = False
    #: vLLM's ``decoder_kv_blocks_ttl`` (480 s by default): how long a decode engine holds those blocks.
    decoder_kv_blocks_ttl_s: float = 480.0
    #: Whether prompts hit the prefix cache (full blocks kept in the KV pool until evicted).
    prefix_caching: bool = True
    #: Step time: ``step_base_ms + prefill tokens × prefill_per_token_ms + decoding sequences ×
    #: decode_per_seq_ms`` (see :class:`narwhal_sim.engine.StepConfig`).
    step_base_ms: float = 7.0
    prefill_per_token_ms: float = 0.08
    decode_per_seq_ms: float = 0.05
    kv_transfer_base_ms: float = 2.0
    kv_transfer_per_block_ms: float = 0.05
    #: Timeout of a KV pull or release sent to a prefill engine.
    kv_pull_timeout_s: float = 10.0
    #: Real (unscaled) time a decode leg watches its client before pulling, so a
    #: router's decode_abort (send, close at once) counts as released; ``None``:
    #: 2 ms, or 0 at speed 0 (only a few loop turns). See docs/simulator.md.
    kv_pull_grace_ms: float | None = None
    #: A failed pull ``recompute``\\ s the prompt (vLLM's default) or ``fail``\\ s the request (500).
    kv_load_failure: str = "recompute"
    #: Idle keep-alive connections close after this long (uvicorn's default).
    keep_alive_s: float = 5.0
    #: Headers and body of a request must arrive within this time.
    read_timeout_s: float = 30.0
    #: Largest request body.
    max_body_bytes: int = 64 * 1024 * 1024
    #: Requests kept in memory for ``/sim/requests``.
    record_limit: int = 10_000
    #: Request log: ``None``/``"none"`` off, ``"-"`` stdout, ``"stderr"``, or a file path.
    log: str | None = None
    #: Fault settings at start.
    faults: Faults = Faults()
    #: ``tcp://HOST:PORT``: publish vLLM KV events on a ZMQ PUB socket bound there.
    kv_events_endpoint: str | None = None
    #: ``tcp://HOST:PORT`` of the replay ROUTER socket; ``None``: the PUB port + 1.
    kv_events_replay_endpoint: str | None = None
    #: Topic frame of every published batch.
    kv_events_topic: str = ""
    #: The engine's data-parallel rank (vLLM's ``--data-parallel-rank``): its KV events go to the
    #: endpoints' ports + the rank, and every batch says it (docs/simulator.md, "KV events").
    data_parallel_rank: int = 0
    #: The KV-event batch as a map, not an array (``EventBatch`` without ``array_like``; docs/simulator.md).
    kv_events_batch_map: bool = False
    #: A Hugging Face ``tokenizer.json`` (or its directory): counts and hashes prompts by its ids.
    tokenizer: str | None = None
    #: A jinja2 chat template file (default: the tokenizer's; none: chat is refused, as vLLM refuses it).
    chat_template: str | None = None

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if self.speed < 0:
            raise ValueError("speed must be >= 0")
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_model_len", "tp_size", "record_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.step_config.check()
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not _tcp_endpoint(value):
                raise ValueError(f"{name} must be tcp://HOST:PORT, got {value!r}")
        if self.data_parallel_rank < 0:
            raise ValueError("data_parallel_rank must be >= 0")
        if self.kv_pull_grace_ms is not None and self.kv_pull_grace_ms < 0:
            raise ValueError("kv_pull_grace_ms must be >= 0")
        family, _ = resolve_version(self.vllm_version)  # ValueError naming the accepted forms
        if self.bidirectional_kv and not family.bidirectional_expiry:
            raise ValueError(f"bidirectional_kv is modelled from the 0.28 family on, not {family.name}")
        if self.decoder_kv_blocks_ttl_s <= 0:
            raise ValueError("decoder_kv_blocks_ttl_s must be > 0")
        if self.abort_request_route not in (False, True, "json", "bare"):
            raise ValueError("abort_request_route must be json or bare")
        if self.pre_admission_ms < 0:
            raise ValueError("pre_admission_ms must be >= 0")
        if self.incomplete_kv_params not in ("reject", "recompute", "crash"):
            raise ValueError("incomplete_kv_params must be reject, recompute or crash")
        if self.kv_transfer_mode not in ("pull", "push"):
            raise ValueError("kv_transfer_mode must be pull or push")
        if self.kv_transfer_mode == "push" and not resolve_version(self.vllm_version)[0].lease_keys:
            raise ValueError("kv_transfer_mode push needs the lease family (vLLM's push scheduler came with it)")
        if (self.kv_lease_s is not None and self.kv_lease_s <= 0) or self.kv_pull_timeout_s <= 0:
            raise ValueError("kv_lease_s and kv_pull_timeout_s must be > 0")
        if self.kv_load_failure not in ("recompute", "fail"):
            raise ValueError("kv_load_failure must be recompute or fail")
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be between 0 and 65535")

    @property
    def pull_grace_s(self) -> float:
        """The pre-pull grace in seconds."""
        if self.kv_pull_grace_ms is None:
            return 0.0 if self.speed == 0 else 0.002
        return self.kv_pull_grace_ms / 1000.0

    @property
    def step_config(self) -> StepConfig:
        """The engine core's settings."""
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 8192 if self.chunked_prefill else max(self.max_model_len, 8192)
        return StepConfig(
            block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            chunked_prefill=self.chunked_prefill,
            prefix_caching=self.prefix_caching,
            step_base_ms=self.step_base_ms,
            prefill_per_token_ms=self.prefill_per_token_ms,
            decode_per_seq_ms=self.decode_per_seq_ms,
            kv_transfer_base_ms=self.kv_transfer_base_ms,
            kv_transfer_per_block_ms=self.kv_transfer_per_block_ms,
        )


def _tcp_endpoint(value: str) -> bool:
    if not value.startswith("tcp://"):
        return False
    host, sep, port = value[6:].rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) <= 65535)


class _Record:
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


class _DecodeKv:
    """A decode leg's claim on remote KV: ``pending`` until pulled, released or failed.

    ``notify_id`` is the request ID the decode engine names when it tells the prefill engine
    to free the blocks: its own (connector 1) or ``remote_request_id`` (connector 2).
    """

    __slots__ = ("params", "phase", "notify_id", "fail_pull")

    def __init__(self, params: KvParams, notify_id: str | None) -> None:
        self.params = params
        self.phase = "pending"
        self.notify_id = notify_id
        #: The ``pull_fail`` fault: the read fails (the prefill engine is not told).
        self.fail_pull = False


class _ClientGone(Exception):
    pass


_COUNTERS = (
    "requests", "completions", "completions_ok", "errors", "client_gone", "auth_failures", "bad_requests",
    "prompt_tokens", "generation_tokens", "cached_tokens", "recomputed",
    "kv_pulls", "kv_pull_failures", "kv_prompt_mismatch", "kv_releases_sent", "kv_release_failures",
    "kv_params_invalid", "kv_notifs_unrecognized", "kv_heartbeats", "kv_stale_reads", "aborted",
    "faults_error", "faults_drop", "faults_delay", "faults_stall", "faults_drop_after_chunks",
    "faults_omit_kv_params", "faults_malformed_json", "faults_unhealthy", "faults_pull_fail",
)  # fmt: skip

Handler = Callable[[ServerConnection, HttpRequest], "Coroutine[Any, Any, None] | None"]


class SimEngine:
    """One simulated engine on the running asyncio loop."""

    def __init__(self, config: SimConfig, *, log_stream: IO[bytes] | None = None) -> None:
        config.check()
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.engine_id = config.engine_id or f"sim-{config.role}-{uuid.uuid4().hex[:12]}"
        family, self.vllm_version = resolve_version(config.vllm_version)
        self.family: VllmFamily = family
        self._flat_errors = not family.nested_errors
        self._dead = False
        #: External request ID (``cmpl-<X-Request-Id>-0``) -> engine request ID, of live requests.
        self._external: dict[str, str] = {}
        self.step_config = config.step_config
        #: The pure engine core; at speed > 0 it steps in real time (one step per token), at
        #: speed 0 instantly (runs of identical decode steps coalesced).
        self.core = EngineCore(
            self.step_config, kv_events=config.kv_events_endpoint is not None, coalesce=config.speed == 0
        )
        self.tokenizer: Tokenizer | None = (
            Tokenizer(config.tokenizer, chat_template=config.chat_template) if config.tokenizer else None
        )
        #: With a tokenizer, prompts are rendered and encoded on a thread of their own, not the serving loop
        #: that steps the engine: vLLM's API server tokenizes in its own process, apart from the engine
        #: core's step loop (vLLM V1, ``vllm/v1/engine/async_llm.py``: ``AsyncLLM`` runs the input
        #: processing, the ``EngineCore`` runs in a background process). The ``tokenizers`` library
        #: releases the GIL in ``encode_batch`` (:meth:`Tokenizer.encode`), so the thread runs beside it.
        self._tokenizing: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(1, thread_name_prefix="narwhal-sim-tokenize") if self.tokenizer is not None else None
        )
        self.publisher: KvEventPublisher | None = None
        self.ledger = KvLedger(
            config.kv_lease_s if config.kv_lease_s is not None else family.hold_s,
            reaper_stops_at_first_live=family.reaper_stops_at_first_live,
        )
        #: A decode engine's own finished requests' KV, held for ``decoder_kv_blocks_ttl`` (bidirectional).
        self.decoder_ledger = KvLedger(config.decoder_kv_blocks_ttl_s)
        self._decoder_timer: asyncio.TimerHandle | None = None
        self._flows: dict[str, _Flow] = {}
        self._core_t0 = time.monotonic()
        self._step_timer: asyncio.TimerHandle | None = None
        self._internal_seq = 0
        self._hash_memo: dict[str, list[int]] = {}
        self.faults = config.faults
        self._faults_active = config.faults.active
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._records: deque[_Record] = deque(maxlen=config.record_limit)
        self._seq = 0
        self._owner_seq = 0
        self._auth = b"Bearer " + config.api_key.encode() if config.api_key is not None else None
        self.client = EngineClient(self.loop, timeout_s=config.kv_pull_timeout_s, authorization=self._auth)
        self._http = HttpServer(
            self,
            limits=Limits(
                keep_alive_s=config.keep_alive_s,
                read_timeout_s=config.read_timeout_s,
                max_body_bytes=config.max_body_bytes,
            ),
            loop=self.loop,
        )
        self._lease_timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._log_stream = log_stream
        self._log_file: IO[bytes] | None = None
        self.host = config.host
        self.port = config.port
        self.url = ""
        # vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST defaults to "localhost" (docs/simulator.md, "vLLM versions").
        self.advertise_host = config.advertise_host or "localhost"
        self.started_at = int(time.time())
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat_completions},
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            "/metrics": {"GET": self._metrics},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
            "/reset_prefix_cache": {"POST": self._reset_prefix_cache},
            "/version": {"GET": self._version},
            KV_PULL_PATH: {"POST": self._kv_pull},
            KV_NOTIFY_PATH: {"POST": self._kv_notify},
            KV_HEARTBEAT_PATH: {"POST": self._kv_heartbeat},
        }
        if config.abort_request_route:
            self._routes[ABORT_PATH] = {"POST": self._abort_request}
        if (config.tokens_only or config.dev_mode) and family.abort_requests_route:
            self._routes[ABORT_REQUESTS_PATH] = {"POST": self._abort_requests}
        self._control: dict[str, dict[str, Handler]] = {
            "/sim/stats": {"GET": self._sim_stats},
            "/sim/requests": {"GET": self._sim_requests},
            "/sim/reset": {"POST": self._sim_reset},
            "/sim/faults": {"GET": self._sim_get_faults, "POST": self._sim_set_faults},
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self, on_listening: Callable[[SimEngine], None] | None = None) -> None:
        """Listen, call ``on_listening`` (nothing has been served yet), then serve."""
        if self._log_stream is None and self.config.log not in (None, "none"):
            if self.config.log == "-":
                self._log_stream = sys.stdout.buffer
            elif self.config.log == "stderr":
                self._log_stream = sys.stderr.buffer
            else:
                self._log_file = open(self.config.log, "ab")  # noqa: SIM115 - closed in close()
                self._log_stream = self._log_file
        self.host, self.port = self._http.bind(self.config.host, self.config.port)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"
        config = self.config
        if config.kv_events_endpoint is not None:
            replay = config.kv_events_replay_endpoint
            if replay is None and config.data_parallel_rank == 0:
                # vLLM names no default either; ours is the PUB port + 1 on the same host (none for a rank
                # past 0: rank 1 publishes on that port, docs/simulator.md).
                pub_host, _, pub_port = config.kv_events_endpoint.rpartition(":")
                replay = f"{pub_host}:{int(pub_port) + 1}" if pub_port.isdigit() and int(pub_port) else None
            self.publisher = KvEventPublisher(
                config.kv_events_endpoint, replay_endpoint=replay, topic=config.kv_events_topic,
                data_parallel_rank=config.data_parallel_rank, map_batch=config.kv_events_batch_map,
                map_events=kv_event_maps(self.family, self.vllm_version),
            )
        if on_listening is not None:
            on_listening(self)
        await self._http.start_serving()

    async def close(self) -> None:
        """Stop serving; held KV is forgotten with the process."""
        if self._lease_timer is not None:
            self._lease_timer.cancel()
        if self._decoder_timer is not None:
            self._decoder_timer.cancel()
        if self._step_timer is not None:
            self._step_timer.cancel()
        await self._http.close()
        if self.publisher is not None:
            self.publisher.close()
        if self._tokenizing is not None:
            self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        for task in list(self._background):
            task.cancel()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # ------------------------------------------------------------------ in-process API

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (``GET /sim/stats``)."""
        ledger = self.ledger
        out: dict[str, Any] = {
            "role": self.config.role,
            "engine_id": self.engine_id,
            "vllm_version": self.vllm_version,
            "vllm_family": self.family.name,
            "kv_lease_s": self.ledger.lease_s,
            "model": self.config.model,
            "url": self.url,
            "speed": self.config.speed,
            "running": self.core.num_running,
            "waiting": self.core.num_waiting,
            "free_blocks": self.core.pool.num_free,
            "total_blocks": self.core.pool.num_blocks,
            "kv_cache_usage": self.core.pool.usage,
            "prefix_cache_queries": self.core.prefix_cache_queries,
            "prefix_cache_hits": self.core.prefix_cache_hits,
            "steps": self.core.steps,
            "kv_events_endpoint": self.publisher.endpoint if self.publisher is not None else None,
            "kv_events_replay_endpoint": self.publisher.replay_endpoint if self.publisher is not None else None,
            "kv_events_published": self.publisher.published if self.publisher is not None else 0,
            "kv_events_encoding": self.publisher.encoding if self.publisher is not None else None,
            "connections": len(self._http.connections),
            "kv_held": len(ledger),
            "kv_held_blocks": ledger.held_blocks,
            "kv_held_total": ledger.counts["held"],
            "kv_pulled": ledger.counts["pulled"],
            "kv_released": ledger.counts["released"],
            "kv_expired": ledger.counts["expired"],
            "kv_held_total_blocks": ledger.block_counts["held"],
            "kv_pulled_blocks": ledger.block_counts["pulled"],
            "kv_released_blocks": ledger.block_counts["released"],
            "kv_expired_blocks": ledger.block_counts["expired"],
            "decoder_kv_held": len(self.decoder_ledger),
            "decoder_kv_held_blocks": self.decoder_ledger.held_blocks,
            "decoder_kv_expired": self.decoder_ledger.counts["expired"],
        }
        out.update(self.counters)
        return out

    def requests(self) -> list[dict[str, Any]]:
        """The recorded requests, oldest first (``GET /sim/requests``)."""
        return [r.to_json() for r in self._records]

    def set_faults(self, faults: Faults) -> None:
        """Replace the fault settings."""
        self.faults = faults
        self._faults_active = faults.active

    def reset(self) -> None:
        """Zero the counters and forget recorded requests (held KV stays held)."""
        for key in self.counters:
            self.counters[key] = 0
        self.ledger.reset_counts()
        self.decoder_ledger.reset_counts()
        core = self.core
        core.prefix_cache_queries = core.prefix_cache_hits = core.steps = 0
        core.prompt_tokens_computed = core.generation_tokens = 0
        self._records.clear()

    # ------------------------------------------------------------------ HTTP app

    def handle(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None] | None:
        """Route one request (called by the HTTP layer)."""
        path = request.path
        if path.startswith("/sim/"):
            methods = self._control.get(path)
            handler = methods.get(request.method) if methods else None
            if handler is None:
                status = 405 if methods else 404
                conn.respond(status, error_body(status, f"no route {request.method} {path}"))
                return None
            return handler(conn, request)
        record = self._record(request)
        if self._auth is not None and not self._authorized(request):
            self.counters["auth_failures"] += 1
            self._answer(conn, request, 401, self._error_body(401, "Unauthorized"), outcome="unauthorized")
            return None
        methods = self._routes.get(path)
        if methods is None:
            self._answer(conn, request, 404, self._error_body(404, f"Not Found: {path}"), outcome="error")
            return None
        handler = methods.get(request.method)
        if handler is None:
            self._answer(conn, request, 405, self._error_body(405, "Method Not Allowed"), outcome="error")
            return None
        return handler(conn, request)

    def abandon(self, request: HttpRequest) -> None:
        """A pipelined request whose connection closed before it was handled."""
        if request.path.startswith("/sim/"):
            return
        record = self._record(request)
        record.outcome = "client_gone"
        self.counters["client_gone"] += 1
        try:
            data = orjson.loads(request.body)
            params = KvParams.parse(data.get("kv_transfer_params")) if isinstance(data, dict) else None
        except (orjson.JSONDecodeError, ApiError):
            params = None
        if params is not None and params.mode == "decode" and self.config.role != "prefill":
            # Never reached the engine: before the lease family nothing tells the prefill engine.
            if self.family.notify_on_rejection:
                self._release_remote(_DecodeKv(params, params.remote_request_id), record)
        self._finish(record)

    def bad_request(self) -> None:
        """A connection sent something unparsable or too slow."""
        self.counters["bad_requests"] += 1

    def _error_body(self, status: int, message: str, *, param: str | None = None) -> bytes:
        """An error body in the shape of the modelled vLLM version (flat before 0.10.1)."""
        return error_body(status, message, param=param, flat=self._flat_errors)

    def _authorized(self, request: HttpRequest) -> bool:
        given = request.authorization
        return given is not None and self._auth is not None and hmac.compare_digest(given, self._auth)

    def _record(self, request: HttpRequest) -> _Record:
        self._seq += 1
        self.counters["requests"] += 1
        record = _Record(self._seq, request, time.perf_counter())
        self._records.append(record)
        request.tag = record
        return record

    def _answer(
        self,
        conn: ServerConnection,
        request: HttpRequest,
        status: int,
        body: bytes,
        *,
        content_type: bytes | None = JSON,
        outcome: str | None = None,
    ) -> None:
        headers = _rid_header(request)
        conn.respond(status, body, content_type=content_type, headers=headers)
        record: _Record = request.tag
        record.status = status
        if outcome is not None:
            record.outcome = outcome
        self._finish(record)

    def _finish(self, record: _Record) -> None:
        if record.duration_ms is not None:
            return
        record.duration_ms = round((time.perf_counter() - record.started) * 1000.0, 3)
        if record.outcome is None:
            record.outcome = "ok" if record.status is not None and record.status < 400 else "error"
        if self._log_stream is not None:
            self._log(
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

    def _log(self, entry: dict[str, Any]) -> None:
        stream = self._log_stream
        if stream is None:
            return
        try:
            stream.write(orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE))
            stream.flush()
        except (OSError, ValueError):
            self._log_stream = None

    # ------------------------------------------------------------------ simple routes

    def _health(self, conn: ServerConnection, request: HttpRequest) -> None:
        if self.faults.unhealthy:
            self.counters["faults_unhealthy"] += 1
            self._answer(conn, request, 503, self._error_body(503, "engine unhealthy (injected)"))
        else:
            self._answer(conn, request, 200, b"", content_type=None)

    def _models(self, conn: ServerConnection, request: HttpRequest) -> None:
        model = self.config.model
        card = {
            "id": model,
            "object": "model",
            "created": self.started_at,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": self.config.max_model_len,
            "permission": [],
        }
        self._answer(conn, request, 200, orjson.dumps({"object": "list", "data": [card]}))

    def _tokenize(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None] | None:
        """vLLM's ``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` → ``{count, max_model_len, tokens, token_strs}``.

        With a tokenizer, answered from the tokenizing thread (see ``_tokenizing``).
        """
        if self._tokenizing is None:
            self._answer(conn, request, *self._tokenize_answer(request))
            return None
        return self._tokenize_off_loop(conn, request)

    async def _tokenize_off_loop(self, conn: ServerConnection, request: HttpRequest) -> None:
        loop = asyncio.get_running_loop()
        status, body = await loop.run_in_executor(self._tokenizing, self._tokenize_answer, request)
        self._answer(conn, request, status, body)

    def _tokenize_answer(self, request: HttpRequest) -> tuple[int, bytes]:
        """The ``/tokenize`` answer's status and body."""
        try:
            data = self._json_body(request)
            model = data.get("model")
            if model is not None and model != self.config.model:
                raise ApiError(404, f"The model `{model}` does not exist.", param="model")
            flags = {}
            for name in ("add_special_tokens", "add_generation_prompt", "continue_final_message", "return_token_strs"):
                value = data.get(name)
                if value is not None and type(value) is not bool:
                    raise ApiError(400, f"{name} must be a boolean", param=name)
                flags[name] = value
            tokenizer = self.tokenizer
            if "messages" in data:
                # vLLM's TokenizeChatRequest: rendered and encoded as a chat completion's prompt is.
                ids = list(Prompt.from_chat_body(data, tokenizer).ids())
            else:
                prompt = data.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(400, "prompt must be a string (or send messages)", param="prompt")
                if tokenizer is not None:
                    ids = tokenizer.encode(prompt, add_special_tokens=flags["add_special_tokens"] is not False)
                else:
                    ids = list(Prompt(text=prompt).ids()) if prompt else []
        except PromptError as exc:
            return 400, self._error_body(400, str(exc), param=exc.param)
        except ApiError as exc:
            return exc.status, exc.body(flat=self._flat_errors)
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                                  "token_strs": None}  # fmt: skip
        if flags["return_token_strs"]:
            answer["token_strs"] = (
                [tokenizer.decode([t]) for t in ids] if tokenizer is not None else [pseudo_token_text([t]) for t in ids]
            )
        return 200, orjson.dumps(answer)

    def _detokenize(self, conn: ServerConnection, request: HttpRequest) -> None:
        """vLLM's ``POST /detokenize``: ``{"tokens": [...]}`` → ``{"prompt": text}``."""
        try:
            data = self._json_body(request)
            model = data.get("model")
            if model is not None and model != self.config.model:
                raise ApiError(404, f"The model `{model}` does not exist.", param="model")
            ids = data.get("tokens")
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise ApiError(400, "tokens must be an array of integers", param="tokens")
            if self.tokenizer is not None:
                try:
                    text = self.tokenizer.decode(ids)
                except ValueError as exc:
                    raise ApiError(400, str(exc), param="tokens") from None
            else:
                text = pseudo_token_text(ids)
        except ApiError as exc:
            self._answer(conn, request, exc.status, exc.body(flat=self._flat_errors))
            return
        self._answer(conn, request, 200, orjson.dumps({"prompt": text}))

    def _reset_prefix_cache(self, conn: ServerConnection, request: HttpRequest) -> None:
        """vLLM's ``POST /reset_prefix_cache``: forget every cached block (``AllBlocksCleared``)."""
        self.core.reset_prefix_cache(now=self._core_now())
        self._pump()
        self._answer(conn, request, 200, b"", content_type=None)

    def _metrics(self, conn: ServerConnection, request: HttpRequest) -> None:
        self._answer(conn, request, 200, self._prometheus(), content_type=_PROMETHEUS)

    def _prometheus(self) -> bytes:
        label = '{engine="0",model_name="%s"}' % self.config.model.replace("\\", "\\\\").replace('"', '\\"')
        c = self.counters
        ledger = self.ledger
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value}")

        core = self.core
        # vLLM's PrometheusStatLogger: gauges, and counters exposed with ``_total`` (prometheus_client).
        metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               [(label, core.num_running)])  # fmt: skip
        metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               [(label, core.num_waiting)])  # fmt: skip
        metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               [(label, core.pool.usage)])  # fmt: skip
        # vLLM's log_metrics_info("cache_config", ...): an info metric as a gauge set to 1, the cache
        # config's metrics_info() as labels (vllm/v1/metrics/loggers.py, 0.10); a few of them here.
        pool = core.pool
        info = '{block_size="%d",enable_prefix_caching="True",engine="0",num_gpu_blocks="%d"}' % (
            pool.block_size, pool.num_blocks)
        metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [(info, 1.0)])
        metric("vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.",
               [(label, core.prefix_cache_queries)])  # fmt: skip
        metric("vllm:prompt_tokens_total", "counter", "Prefill tokens processed.", [(label, c["prompt_tokens"])])
        metric("vllm:generation_tokens_total", "counter", "Tokens generated.", [(label, c["generation_tokens"])])
        metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
               [(label, core.prefix_cache_hits)])  # fmt: skip
        metric("narwhal_sim_requests_total", "counter", "Requests received.", [("", c["requests"])])
        metric("narwhal_sim_kv_held_requests", "gauge", "KV owners held.", [("", len(ledger))])
        metric("narwhal_sim_kv_held_blocks", "gauge", "KV blocks held for owners.", [("", ledger.held_blocks)])
        metric("narwhal_sim_kv_owners_total", "counter", "KV owners by outcome.",
               [(f'{{outcome="{k}"}}', v) for k, v in ledger.counts.items()])  # fmt: skip
        metric("narwhal_sim_kv_blocks_total", "counter", "KV blocks by outcome.",
               [(f'{{outcome="{k}"}}', v) for k, v in ledger.block_counts.items()])  # fmt: skip
        faults = [(f'{{fault="{k[7:]}"}}', v) for k, v in c.items() if k.startswith("faults_")]
        metric("narwhal_sim_faults_total", "counter", "Injected faults.", faults)
        return ("\n".join(lines) + "\n").encode()

    def _json_body(self, request: HttpRequest) -> dict[str, Any]:
        try:
            data = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            raise ApiError(400, "request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    # ------------------------------------------------------------------ KV ownership (prefill side)

    def _abort_request(self, conn: ServerConnection, request: HttpRequest) -> None:
        try:
            data = self._json_body(request)
            owner = data.get("request_id", data.get("rid"))  # "rid": SGLang's name
            if not isinstance(owner, str):
                raise ApiError(400, "request_id must be a string", param="request_id")
        except ApiError as exc:
            self._answer(conn, request, exc.status, exc.body(flat=self._flat_errors))
            return
        # Unknown owners answer 200 and free nothing: releases are idempotent.
        entry = self.ledger.release(owner)
        if entry is not None:
            self._kv_ended(entry)
        if self.config.abort_request_route == "bare":
            self._answer(conn, request, 200, b"", content_type=None)  # SGLang confirms nothing
            return
        answer = {"request_id": owner, "released": entry is not None, "num_blocks": len(entry.block_ids) if entry else 0}
        self._answer(conn, request, 200, orjson.dumps(answer))

    def _kv_pull(self, conn: ServerConnection, request: HttpRequest) -> None:
        """A decode engine reads held blocks (NIXL's READ) and names the request to free (its notification).

        ``remote_request_id`` (connector 2) finds the entry by owner; without it (connector 1)
        the blocks are found by their ids. The blocks are freed only when ``notify_id`` names
        the owner; any other name is an "unrecognized request": the data was read but the
        blocks stay held until the timeout. A pull after the hold ran out reads the freed
        blocks all the same: it answers 200 marked ``stale`` (docs/simulator.md, "vLLM versions").
        """
        stale = False
        try:
            data = self._json_body(request)
            owner = data.get("remote_request_id")
            if owner is not None and not isinstance(owner, str):
                raise ApiError(400, "remote_request_id must be a string", param="remote_request_id")
            expected = data.get("remote_engine_id")
            if expected is not None and expected != self.engine_id:
                raise ApiError(409, f"this is engine {self.engine_id}, not {expected}", param="remote_engine_id")
            block_ids = flat_block_ids(data.get("remote_block_ids"))
            if owner is None:
                entry = self.ledger.find_blocks(block_ids)
                if entry is None:
                    entry = self.ledger.find_blocks(block_ids, expired=True)
                    stale = entry is not None
                if entry is None:
                    raise ApiError(404, "no KV held in blocks " + str(block_ids[:8]))
                owner = entry.owner
            else:
                entry = self.ledger.get(owner)
                if entry is None:
                    entry = self.ledger.expired_entry(owner)
                    stale = entry is not None
                if entry is None:
                    raise ApiError(404, f"no KV held for {owner} (never held, or pulled or released)")
                if data.get("remote_block_ids") is not None and block_ids != entry.block_ids:
                    raise ApiError(409, f"remote_block_ids do not match the blocks held for {owner}")
        except ApiError as exc:
            self._answer(conn, request, exc.status, exc.body(flat=self._flat_errors))
            return
        notify_id = data.get("notify_id", owner)
        if stale:
            self._stale_read(entry)
        elif notify_id == owner:
            self.ledger.pull(owner)
            self._kv_ended(entry)
        else:
            self._unrecognized(notify_id, entry)
        answer = {
            "remote_request_id": owner,
            "num_blocks": len(entry.block_ids),
            "prompt_tokens": entry.prompt_tokens,
            "prompt_digest": entry.prompt_digest,
            "stale": stale,
        }
        self._answer(conn, request, 200, orjson.dumps(answer))

    def _stale_read(self, entry: KvEntry) -> None:
        """A READ of blocks freed at the hold's end: vLLM's prefill side only logs the late notification.

        ``NixlConnectorWorker._get_new_notifs`` (``nixl/base_worker.py``) warns of
        "potentially invalid KV blocks for unrecognized request"; the decode engine
        is told nothing (vLLM issue 21570). The simulator counts it and marks the record.
        """
        self.counters["kv_stale_reads"] += 1
        record: _Record | None = entry.tag
        if record is not None and record.kv is not None:
            record.kv["stale_read"] = True
        self._log({"ts": time.time(), "event": "kv_stale_read", "engine_id": self.engine_id, "owner": entry.owner})

    def _hold(self, owner: str, block_ids: list[int], prompt: Prompt, record: _Record) -> dict[str, Any]:
        """Lease a finished prefill's blocks (pinned in the core) to ``owner``; the ``kv_transfer_params``."""
        entry = self.ledger.hold(
            owner,
            block_ids,
            now=self.loop.time(),
            prompt_tokens=prompt.num_tokens,
            prompt_digest=prompt.digest,
            tag=record,
        )
        record.kv = {"role": "prefill", "owner": owner, "blocks": len(entry.block_ids), "outcome": "held"}
        if self._lease_timer is None:
            self._arm_lease_timer()
        # The NIXL connector's fields, in its order, for the modelled version
        # (docs/simulator.md, "Prefill leg" and "vLLM versions").
        family = self.family
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [entry.block_ids] if family.block_groups else entry.block_ids,
            "remote_engine_id": self.engine_id,
        }
        if family.connector >= 2:
            params["remote_request_id"] = owner
        params["remote_host"] = self.advertise_host
        params["remote_port"] = self.port
        params["tp_size"] = self.config.tp_size
        if self.config.kv_transfer_mode == "push":
            # vLLM's push scheduler (nixl/push_scheduler.py, NixlPushConnectorScheduler.request_finished,
            # commit 0316d25a): the pull answer's keys without dcp_size and remote_blocks_expiry_time.
            params["pp_size"] = 1
            params["remote_num_tokens"] = prompt.num_tokens
            params["transfer_mode"] = "push"
        elif family.lease_keys:
            params["dcp_size"] = 1
            params["pp_size"] = 1
            params["remote_num_tokens"] = prompt.num_tokens
            params["remote_blocks_expiry_time"] = None
            params["transfer_mode"] = "pull"
        return params

    def _hold_decoded(self, owner: str, flow: _Flow, computed: int, prompt: Prompt, record: _Record) -> dict[str, Any]:
        """Hold a finished decode request's blocks for ``decoder_kv_blocks_ttl`` (bidirectional transfer).

        vLLM's ``NixlPullConnectorScheduler.request_finished`` (nixl/pull_scheduler.py, commit
        0050936b): on a decode engine with ``bidirectional_kv_xfer`` a request that finished
        (length or stop) keeps its blocks for ``decoder_kv_blocks_ttl`` (base_scheduler.py, 480 s
        by default; no lease renewal) so that the next turn's prefill can read them, and answers
        the engine's own ``kv_transfer_params``: ``do_remote_decode: true``, the blocks, and
        ``remote_blocks_expiry_time``, the deadline on the engine's clock (PR 47021), and
        ``remote_num_tokens``, the tokens whose KV it computed (``computed``: the prompt and the
        output but its last token). Only a prefill request carrying these params would read them:
        nothing here does, so they expire.
        """
        entry = self.decoder_ledger.hold(owner, flow.block_ids, now=self.loop.time(),
                                         prompt_tokens=computed, prompt_digest=prompt.digest)  # fmt: skip
        flow.block_ids = []
        if record.kv is not None:
            record.kv["decoder_held_blocks"] = len(entry.block_ids)
        if self._decoder_timer is None:
            self._arm_decoder_timer()
        return {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [entry.block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": owner,
            "remote_host": self.advertise_host,
            "remote_port": self.port,
            "tp_size": self.config.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": entry.prompt_tokens,
            "remote_blocks_expiry_time": entry.expires_at,
            "transfer_mode": "pull",
        }

    def _arm_decoder_timer(self) -> None:
        deadline = self.decoder_ledger.next_deadline()
        if deadline is not None:
            self._decoder_timer = self.loop.call_at(deadline, self._expire_decoded)

    def _expire_decoded(self) -> None:
        self._decoder_timer = None
        for entry in self.decoder_ledger.expire_due(self.loop.time() + 0.001):
            self.core.free_held(entry.owner, now=self._core_now())
        self._pump()
        self._arm_decoder_timer()

    def _unrecognized(self, notify_id: Any, entry: KvEntry | None) -> None:
        """A notification naming no held request: logged and ignored, as vLLM's prefill side does."""
        self.counters["kv_notifs_unrecognized"] += 1
        record: _Record | None = entry.tag if entry is not None else None
        if record is not None and record.kv is not None:
            record.kv["unrecognized_notify"] = str(notify_id)[:200]
        self._log({"ts": time.time(), "event": "kv_unrecognized", "engine_id": self.engine_id,
                   "notify_id": str(notify_id)[:200], "held_owner": entry.owner if entry is not None else None})

    def _kv_notify(self, conn: ServerConnection, request: HttpRequest) -> None:
        """A decode engine that will not read the blocks tells the prefill engine to free them."""
        try:
            data = self._json_body(request)
            notify_id = data.get("notify_id")
            if not isinstance(notify_id, str):
                raise ApiError(400, "notify_id must be a string", param="notify_id")
        except ApiError as exc:
            self._answer(conn, request, exc.status, exc.body(flat=self._flat_errors))
            return
        entry = self.ledger.release(notify_id)
        if entry is not None:
            self._kv_ended(entry)
        else:
            self._unrecognized(notify_id, self.ledger.find_blocks(flat_block_ids(data.get("remote_block_ids"))))
        self._answer(conn, request, 200, orjson.dumps({"freed": entry is not None}))

    def _kv_heartbeat(self, conn: ServerConnection, request: HttpRequest) -> None:
        """Renew the leases a decode engine names (lease family); expired entries stay gone."""
        try:
            ids = self._json_body(request).get("remote_request_ids")
            if not isinstance(ids, list):
                raise ApiError(400, "remote_request_ids must be an array", param="remote_request_ids")
        except ApiError as exc:
            self._answer(conn, request, exc.status, exc.body(flat=self._flat_errors))
            return
        now = self.loop.time()
        renewed = sum(1 for owner in ids if isinstance(owner, str) and self.ledger.renew(owner, now))
        if renewed and self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
            self._arm_lease_timer()
        self._answer(conn, request, 200, orjson.dumps({"renewed": renewed}))

    def _abort_requests(self, conn: ServerConnection, request: HttpRequest) -> None:
        """vLLM's ``POST /abort_requests``: abort live requests by their external IDs.

        It aborts requests the engine is still working on; a finished prefill's held
        blocks are not a live request, so they stay held (docs/simulator.md). With
        ``--tokens-only``: 200 with an empty body, whatever happened; in dev mode
        ``{"status": "aborted", "aborted": N}``, and an empty list aborts everything.
        """
        try:
            data = self._json_body(request)
        except ApiError as exc:
            self._answer(conn, request, exc.status, exc.body(flat=self._flat_errors))
            return
        ids = data.get("request_ids")
        if self.config.dev_mode and not self.config.tokens_only:
            targets = list(self._external) if not ids else [i for i in ids if isinstance(i, str)]
        else:
            if ids is None:
                self._answer(conn, request, 400, self._error_body(400, "Missing 'request_ids' in request body"))
                return
            targets = [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []
        aborted = 0
        now = self._core_now()
        for external in targets:
            core_id = self._external.get(external)
            flow = self._flows.get(core_id) if core_id is not None else None
            if core_id is None or flow is None:
                continue
            if self.core.abort(core_id, now=now):
                flow.block_ids = []
            flow.abort()
            aborted += 1
        self.counters["aborted"] += aborted
        if aborted:
            self._pump()
        if self.config.dev_mode and not self.config.tokens_only:
            self._answer(conn, request, 200, orjson.dumps({"status": "aborted", "aborted": aborted}))
        else:
            self._answer(conn, request, 200, b"", content_type=None)

    def _version(self, conn: ServerConnection, request: HttpRequest) -> None:
        self._answer(conn, request, 200, orjson.dumps({"version": self.vllm_version}))

    def _kv_ended(self, entry: KvEntry) -> None:
        self.core.free_held(entry.owner, now=self._core_now())
        self._pump()
        if entry.outcome != "expired" and self._lease_timer is not None:
            # The reaper's next deadline may have moved (the head of the lease era's reaper).
            self._lease_timer.cancel()
            self._lease_timer = None
            self._arm_lease_timer()
        record: _Record | None = entry.tag
        if record is not None and record.kv is not None:
            record.kv["outcome"] = entry.outcome
        if self._log_stream is not None:
            self._log(
                {
                    "ts": time.time(),
                    "event": "kv",
                    "engine_id": self.engine_id,
                    "owner": entry.owner,
                    "request_id": record.request_id if record is not None else None,
                    "blocks": len(entry.block_ids),
                    "outcome": entry.outcome,
                }
            )

    def _arm_lease_timer(self) -> None:
        deadline = self.ledger.next_deadline()
        if deadline is not None:
            self._lease_timer = self.loop.call_at(deadline, self._expire_leases)

    def _expire_leases(self) -> None:
        self._lease_timer = None
        # Timers may fire up to a clock tick early; a millisecond of slack avoids a spin.
        for entry in self.ledger.expire_due(self.loop.time() + 0.001):
            self._kv_ended(entry)
        self._arm_lease_timer()

    def _block_hashes(self, prompt: Prompt) -> list[int]:
        """The prompt's block hashes; those of recent texts are remembered (clients repeat prompts)."""
        size = self.step_config.block_size
        if prompt.num_tokens < size:
            return []
        text = prompt.text
        if prompt.token_ids is not None or text is None:
            return prompt.block_hashes(size)
        key = text[: (prompt.num_tokens // size) * size * CHARS_PER_TOKEN]
        memo = self._hash_memo
        hashes = memo.get(key)
        if hashes is None:
            hashes = prompt.block_hashes(size)
            memo[key] = hashes
            if len(memo) > 4096:
                del memo[next(iter(memo))]
        return hashes

    def _engine_request_id(self, request_id: str, chat: bool) -> tuple[str, str]:
        """The external and the engine request ID of a completion, as vLLM mangles ``X-Request-Id``.

        External: ``cmpl-<X-Request-Id>-0`` (the prompt's index) or ``chatcmpl-<X-Request-Id>``.
        Engine: the same, plus ``-<8 hex>`` from the 0.14 family on (deterministic here: from the
        seed, the ID and a per-engine sequence). The engine ID names the KV (``remote_request_id``).
        """
        external = f"chatcmpl-{request_id}" if chat else f"cmpl-{request_id}-0"
        if not self.family.request_id_suffix:
            if external in self._external or external in self.ledger or self.core.state_of(external) is not None:
                raise ApiError(400, f"Request id {external} already running.")
            return external, external
        while True:  # a client reusing a request id may meet a key in use: take the next one
            self._owner_seq += 1
            owner = owner_key(self.config.seed, external, self._owner_seq)
            if owner not in self.ledger and self.core.state_of(owner) is None:
                return external, owner

    def _incomplete_params(self, params: KvParams) -> None:
        """A decode request whose params lack a field the connector reads (docs/simulator.md)."""
        setting = self.config.incomplete_kv_params
        if setting == "recompute":
            return  # counted with the plain request it becomes
        self.counters["kv_params_invalid"] += 1
        message = f"kv_transfer_params.{params.missing} is missing or not usable"
        if setting == "crash":
            # vLLM through 0.29.0 dies on a KeyError in the scheduler (CVE-2026-94622).
            self._dead = True
            raise ApiError(500, f"EngineCore encountered an issue: KeyError: {params.missing!r}")
        raise ApiError(400, message, param="kv_transfer_params")

    def _rejected_before_admission(self, body: bytes, record: _Record) -> None:
        """A decode request refused before it reached the engine: only the lease family tells the prefill engine."""
        if not self.family.notify_on_rejection or self.config.role == "prefill":
            return
        try:
            data = orjson.loads(body)
            params = KvParams.parse(data.get("kv_transfer_params")) if isinstance(data, dict) else None
        except (orjson.JSONDecodeError, ApiError):
            return
        if params is not None and params.mode == "decode":
            self._release_remote(_DecodeKv(params, params.remote_request_id), record)

    def _start_heartbeats(self, decode_kv: _DecodeKv) -> None:
        """Renew the prefill engine's lease while this decode request waits (lease family)."""
        task = self.loop.create_task(self._heartbeats(decode_kv))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _heartbeats(self, decode_kv: _DecodeKv) -> None:
        params = decode_kv.params
        assert params.remote_host is not None and params.remote_port is not None
        period = self.ledger.lease_s / 6.0  # vLLM: kv_lease_duration // 6
        body = orjson.dumps({"remote_request_ids": [params.remote_request_id]})
        while decode_kv.phase == "pending":
            try:
                await self.client.post(params.remote_host, params.remote_port, KV_HEARTBEAT_PATH, body)
                self.counters["kv_heartbeats"] += 1
            except (OSError, TimeoutError, ConnectionError):
                pass
            await asyncio.sleep(period)

    # ------------------------------------------------------------------ driving the engine core

    def _core_now(self) -> float:
        """The core's time: modelled seconds since start (at speed 0, the core's own clock)."""
        speed = self.config.speed
        if speed == 0:
            return self.core.now
        return (time.monotonic() - self._core_t0) * speed

    def _pump(self) -> None:
        """Hand the core's due outputs to their requests and arm the timer for the next step end."""
        core = self.core
        speed = self.config.speed
        if speed == 0:
            # Instantly: every step runs now, one after the other.
            self._dispatch(core.run_until_idle())
        else:
            now = self._core_now()
            self._dispatch(core.advance(now=now))
            t = core.next_event_time()
            if self._step_timer is not None:
                self._step_timer.cancel()
                self._step_timer = None
            if t is not None:
                self._step_timer = self.loop.call_later(max(t - now, 0.0) / speed, self._on_step_timer)
        self._publish()

    def _publish(self) -> None:
        if self.publisher is not None:
            events = self.core.take_kv_events()
            if events:
                self.publisher.publish(events, time.time())

    def _on_step_timer(self) -> None:
        self._step_timer = None
        self._pump()

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        flows = self._flows
        for out in outputs:
            flow = flows.get(out.request_id)
            if flow is None:
                continue
            if type(out) is Tokens:
                flow.generated += out.count
            elif type(out) is Started:
                flow.started = True
                if flow.kind != DECODE_REMOTE:
                    flow.cached = out.cached_tokens
                    counters = self.counters
                    counters["prompt_tokens"] += flow.prompt_tokens - out.cached_tokens
                    counters["cached_tokens"] += out.cached_tokens
            elif type(out) is Finished:
                flow.finished = True
                flow.block_ids = list(out.block_ids)
            waiter = flow.waiter
            if waiter is not None:
                flow.waiter = None
                if not waiter.done():
                    waiter.set_result(None)

    # ------------------------------------------------------------------ completions

    def _completions(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None]:
        return self._complete(conn, request, chat=False)

    def _chat_completions(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None]:
        return self._complete(conn, request, chat=True)

    def _check_role(self, job: CompletionJob) -> None:
        mode = job.kv.mode if job.kv is not None else None
        role = self.config.role
        if mode == "prefill":
            if role == "decode":
                raise ApiError(400, "this is a decode engine: it does not take do_remote_decode (prefill) requests",
                               param="kv_transfer_params")  # fmt: skip
            if job.stream:
                raise ApiError(400, "streaming is not supported for prefill requests (do_remote_decode)",
                               param="stream")  # fmt: skip
        elif mode in ("decode", "invalid") and role == "prefill":
            raise ApiError(400, "this is a prefill engine: it does not take do_remote_prefill (decode) requests",
                           param="kv_transfer_params")  # fmt: skip

    async def _complete(self, conn: ServerConnection, request: HttpRequest, *, chat: bool) -> None:
        record: _Record = request.tag
        counters = self.counters
        counters["completions"] += 1
        request_id = request.request_id or os.urandom(16).hex()
        faults = self.faults
        plan = faults.plan(self.config.seed, request_id) if self._faults_active else _NO_FAULTS
        core_id: str | None = None
        flow: _Flow | None = None
        decode_kv: _DecodeKv | None = None
        done = False
        admitted = False
        external: str | None = None
        finish_reason = "length"
        try:
            if self._dead:
                counters["errors"] += 1
                self._answer(conn, request, 500, self._error_body(
                    500, "EngineCore encountered an issue. See stack trace (above) for the root cause."))
                done = True
                return
            try:
                parse = functools.partial(
                    parse_completion,
                    request.body,
                    chat=chat,
                    served_model=self.config.model,
                    max_model_len=self.config.max_model_len,
                    tokenizer=self.tokenizer,
                    require_request_id=self.family.connector >= 2,
                )
                if self._tokenizing is None:
                    job = parse()
                else:
                    job = await asyncio.get_running_loop().run_in_executor(self._tokenizing, parse)
                self._check_role(job)
                if job.kv is not None and job.kv.mode == "invalid":
                    self._incomplete_params(job.kv)
            except ApiError as exc:
                counters["errors"] += 1
                self._answer(conn, request, exc.status, exc.body(flat=self._flat_errors))
                self._rejected_before_admission(request.body, record)
                done = True
                return
            if plan.drop:
                counters["faults_drop"] += 1
                record.outcome = "dropped"
                conn.close()
                done = True
                return
            if plan.delay_s:
                counters["faults_delay"] += 1
                await asyncio.sleep(plan.delay_s)
            if plan.error_status is not None:
                counters["faults_error"] += 1
                counters["errors"] += 1
                status = plan.error_status
                self._answer(conn, request, status, self._error_body(status, "injected fault"), outcome="fault_error")
                done = True
                return

            kv = job.kv
            mode = kv.mode if kv is not None else None
            prompt = job.prompt
            prompt_tokens = prompt.num_tokens
            out_tokens = 1 if mode == "prefill" else job.max_tokens
            if plan.eos and job.min_tokens < 1:
                # The first sampled token is the end of sequence (FINISHED_STOPPED).
                out_tokens, finish_reason = 1, "stop"
            step = self.step_config
            needed = step.blocks_for(prompt_tokens if mode == "prefill" else prompt_tokens + out_tokens)
            if needed > step.num_gpu_blocks:
                raise ApiError(400, f"request needs {needed} KV blocks; the engine has {step.num_gpu_blocks}")
            if not step.chunked_prefill and prompt_tokens > step.max_num_batched_tokens and mode != "decode":
                raise ApiError(400, f"the prompt has {prompt_tokens} tokens, more than max_num_batched_tokens "
                                    f"({step.max_num_batched_tokens}) with chunked prefill off")  # fmt: skip
            if mode == "decode" and self.config.pre_admission_ms > 0:
                # The serving layer's own work before the engine sees the request: a client that
                # leaves meanwhile wins the race, and the request never reaches the engine.
                if conn.closed or await conn.wait_closed(self.config.pre_admission_ms / 1000.0):
                    self._rejected_before_admission(request.body, record)
                    raise _ClientGone
            external, engine_rid = self._engine_request_id(request_id, chat)
            if mode == "decode":
                assert kv is not None
                # From here on, a request that ends before its pull releases the
                # prefill engine's KV, as vLLM's NIXL connector does -- naming its own
                # request ID with connector 1, remote_request_id with connector 2.
                decode_kv = _DecodeKv(kv, engine_rid if self.family.connector == 1 else kv.remote_request_id)
                decode_kv.fail_pull = plan.pull_fail
                record.kv = {"role": "decode", "owner": kv.remote_request_id, "outcome": "pending"}
                if self.family.lease_renewal and kv.tp_size is not None:
                    self._start_heartbeats(decode_kv)
            elif mode == "invalid":
                counters["kv_params_invalid"] += 1
            core_id = engine_rid
            if mode == "prefill":
                kind = PREFILL_REMOTE
            else:
                kind = DECODE_REMOTE if decode_kv is not None else PLAIN
            if kind == PLAIN and (self.config.role == "decode" or mode == "invalid"):
                counters["recomputed"] += 1
            flow = _Flow(kind, prompt_tokens)
            self._flows[core_id] = flow
            self._external[external] = core_id
            admitted = True
            events_on = self.publisher is not None
            engine_request = EngineRequest(
                request_id=core_id,
                kind=kind,
                prompt_tokens=prompt_tokens,
                max_tokens=out_tokens,
                block_hashes=self._block_hashes(prompt) if step.prefix_caching else (),
                token_ids=prompt.block_token_ids(step.block_size) if events_on else None,
                linger=plan.stall_after is not None,
                hold=decode_kv is not None and self.config.bidirectional_kv,
            )
            if self.config.speed == 0:
                self._dispatch(self.core.serve_now(engine_request, now=self.core.now))
                self._publish()
            else:
                self.core.add_request(engine_request, now=self._core_now())
                self._pump()

            if decode_kv is not None:
                await flow.wait_for(lambda: flow.started)
                flow.check_aborted(external)
                cached = await self._load_kv(conn, job, decode_kv, record)
                if cached is None and self.config.kv_load_failure == "fail":
                    raise ApiError(500, "KV transfer from the prefill engine failed")
                if cached is None:
                    # The pull failed: the core recomputes the prompt here (with prefix hits).
                    counters["recomputed"] += 1
                    flow.kind = PLAIN
                    flow.started = False
                else:
                    flow.cached = cached
                self.core.kv_loaded(core_id, now=self._core_now(), ok=cached is not None)
                self._pump()
            if flow.generated < 1:
                await flow.wait_for(lambda: flow.generated >= 1)
                flow.check_aborted(external)
            if conn.closed:
                raise _ClientGone

            tokens = generate_tokens(self.config.seed, prompt.digest, out_tokens, chat=job.chat)
            counters["generation_tokens"] += out_tokens
            kv_params = None
            if mode == "prefill":
                if not flow.finished:
                    await flow.wait_for(lambda: flow.finished)
                    flow.check_aborted(external)
                if plan.omit_kv_params:
                    # Like an engine without the KV connector: no params, nothing held.
                    counters["faults_omit_kv_params"] += 1
                    self.core.free_held(core_id, now=self._core_now())
                    self._pump()
                elif finish_reason == "stop" and self.family.null_params_on_stop:
                    # Connectors before the lease hold KV only for FINISHED_LENGTH_CAPPED:
                    # a prefill that stopped frees its blocks and hands off nothing.
                    self.core.free_held(core_id, now=self._core_now())
                    self._pump()
                    record.kv = {"role": "prefill", "owner": None, "blocks": 0, "outcome": "none",
                                 "reason": "finished_stopped"}  # fmt: skip
                else:
                    kv_params = self._hold(core_id, flow.block_ids, prompt, record)
                flow.block_ids = []
            answer_usage = usage(prompt_tokens, out_tokens, flow.cached,
                                 details=self.config.enable_prompt_tokens_details)  # fmt: skip
            response_id = ("chatcmpl-" if job.chat else "cmpl-") + request_id
            chat_mode = "tool" if job.tool_name else ("reasoning" if faults.reasoning_only else "text")
            if job.stream:
                await self._stream(conn, request, job, plan, flow, tokens, answer_usage, response_id, chat_mode,
                                   finish_reason)  # fmt: skip
                if decode_kv is not None and self.config.bidirectional_kv and flow.finished:
                    self._hold_decoded(core_id, flow, prompt_tokens + out_tokens - 1, prompt, record)
            else:
                if not flow.finished:
                    await flow.wait_for(lambda: flow.finished)
                    flow.check_aborted(external)
                if decode_kv is not None and self.config.bidirectional_kv:
                    kv_params = self._hold_decoded(core_id, flow, prompt_tokens + out_tokens - 1, prompt, record)
                body = self._whole_body(job, response_id, tokens, chat_mode, answer_usage, kv_params, finish_reason)
                await self._send_whole(conn, request, plan, body)
            done = True
        except ApiError as exc:
            counters["errors"] += 1
            self._answer(conn, request, exc.status, exc.body(flat=self._flat_errors))
            if decode_kv is None:
                self._rejected_before_admission(request.body, record)
            done = True
        except _ClientGone:
            pass
        finally:
            if admitted and external is not None:
                self._external.pop(external, None)
            if core_id is not None:
                self._flows.pop(core_id, None)
                now = self._core_now()
                if self.core.abort(core_id, now=now) or (
                    flow is not None and flow.block_ids and self.core.free_held(core_id, now=now) is not None
                ):
                    self._pump()
            if decode_kv is not None and decode_kv.phase == "pending":
                # Aborted before the pull: tell the prefill engine to free the blocks (vLLM does).
                self._release_remote(decode_kv, record)
            if not done and record.outcome is None:
                record.outcome = "client_gone"
                counters["client_gone"] += 1
            self._finish(record)

    def _whole_body(
        self,
        job: CompletionJob,
        response_id: str,
        tokens: list[str],
        chat_mode: str,
        answer_usage: dict[str, Any],
        kv_params: dict[str, Any] | None,
        finish_reason: str = "length",
    ) -> bytes:
        if job.chat:
            body = chat_body(
                response_id=response_id,
                created=int(time.time()),
                model=self.config.model,
                tokens=tokens,
                mode=chat_mode,
                tool_name=job.tool_name,
                digest=job.prompt.digest,
                usage=answer_usage,
                kv_transfer_params=kv_params,
                finish_reason=finish_reason if chat_mode != "tool" else "tool_calls",
            )
        else:
            body = completion_body(
                response_id=response_id,
                created=int(time.time()),
                model=self.config.model,
                text="".join(tokens),
                usage=answer_usage,
                kv_transfer_params=kv_params,
                finish_reason=finish_reason,
            )
        return orjson.dumps(body)

    async def _send_whole(self, conn: ServerConnection, request: HttpRequest, plan: FaultPlan, body: bytes) -> None:
        record: _Record = request.tag
        if plan.malformed_json:
            self.counters["faults_malformed_json"] += 1
            body = body[: max(len(body) // 2, 1)]
            record.outcome = "fault_malformed_json"
        # A non-streaming answer is one chunk: a stall or drop "after 0 chunks" hits it.
        if plan.stall_after == 0:
            self.counters["faults_stall"] += 1
            record.outcome = "fault_stall"
            await conn.wait_closed()
            return
        if plan.drop_after == 0:
            self.counters["faults_drop_after_chunks"] += 1
            record.outcome = "fault_drop_after_chunks"
            conn.close()
            return
        record.status = 200
        conn.respond(200, body, headers=_rid_header(request))
        self.counters["completions_ok"] += 1

    async def _stream(
        self,
        conn: ServerConnection,
        request: HttpRequest,
        job: CompletionJob,
        plan: FaultPlan,
        flow: _Flow,
        tokens: list[str],
        answer_usage: dict[str, Any],
        response_id: str,
        chat_mode: str,
        finish_reason: str = "length",
    ) -> None:
        record: _Record = request.tag
        fmt = StreamFormat(
            finish_reason=finish_reason if chat_mode != "tool" else "tool_calls",
            response_id=response_id,
            created=int(time.time()),
            model=self.config.model,
            chat=job.chat,
            mode=chat_mode,
            tool_name=job.tool_name,
            digest=job.prompt.digest,
        )
        events = fmt.events(tokens, answer_usage if job.include_usage else None)
        if plan.malformed_json:
            self.counters["faults_malformed_json"] += 1
            record.outcome = "fault_malformed_json"
            first = fmt.first_token_event()
            events[first] = events[first][: len(events[first]) // 2] + b"\n\n"
        # Where a stall or drop cuts the stream, if anywhere.
        limit, action = len(events), None
        if plan.stall_after is not None and plan.stall_after < limit:
            limit, action = plan.stall_after, "stall"
        if plan.drop_after is not None and plan.drop_after < limit:
            limit, action = plan.drop_after, "drop"
        record.status = 200
        conn.start_stream(200, content_type=_SSE, headers=_rid_header(request))
        total = len(tokens)
        if flow.generated >= total:
            conn.send_chunks(events[:limit], end=action is None)
        else:
            # The first token is ready now; each further one comes with an engine step.
            upto = fmt.first_token_event() + 1
            conn.send_chunks(events[: min(upto, limit)])
            sent = 1
            while sent < total and upto < limit:
                if flow.generated <= sent:
                    await flow.wait_for(lambda: flow.generated > sent)
                if flow.aborted:
                    limit = upto  # vLLM ends an aborted stream where it stands
                    break
                if conn.closed:
                    raise _ClientGone
                n = min(flow.generated, total) - sent
                conn.send_chunks(events[upto : min(upto + n, limit)])
                upto += n
                sent += n
            if upto < limit:
                conn.send_chunks(events[upto:limit])
        if action == "stall":
            self.counters["faults_stall"] += 1
            record.outcome = "fault_stall"
            conn.flush()
            await conn.wait_closed()
        elif action == "drop":
            self.counters["faults_drop_after_chunks"] += 1
            record.outcome = "fault_drop_after_chunks"
            conn.flush()
            conn.close()
        else:
            conn.end_stream()
            self.counters["completions_ok"] += 1

    # ------------------------------------------------------------------ KV ownership (decode side)

    async def _load_kv(
        self, conn: ServerConnection, job: CompletionJob, decode_kv: _DecodeKv, record: _Record
    ) -> int | None:
        """Pull the prompt's KV from the prefill engine; cached tokens, or ``None`` to recompute."""
        params = decode_kv.params
        # decode_abort (docs/simulator.md, "Decode leg"): a router frees KV by sending this request and
        # closing at once. Give the loop a few turns to see that EOF (it may
        # come in a later read than the request) before committing to the pull.
        for _ in range(3):
            await asyncio.sleep(0)
        grace = self.config.pull_grace_s
        if conn.closed or (grace > 0 and await conn.wait_closed(grace)):
            raise _ClientGone
        speed = self.config.speed
        if speed > 0:
            # The load takes the transfer time (the first token then takes one engine
            # step); a client leaving meanwhile cancels us (and releases).
            blocks = len(params.flat_block_ids)
            await asyncio.sleep(self.step_config.transfer_s(blocks) / speed)
        if conn.closed:
            raise _ClientGone
        decode_kv.phase = "pulling"
        # Shielded: a client leaving mid-pull must not leave the prefill engine guessing.
        task = self.loop.create_task(self._pull(job, decode_kv, record))
        return await asyncio.shield(task)

    async def _pull(self, job: CompletionJob, decode_kv: _DecodeKv, record: _Record) -> int | None:
        params = decode_kv.params
        assert params.remote_host is not None and params.remote_port is not None
        body = orjson.dumps(
            {
                # Connector 1 reads by block ids and names no remote request.
                "remote_request_id": params.remote_request_id if self.family.connector >= 2 else None,
                "remote_engine_id": params.remote_engine_id,
                "remote_block_ids": params.remote_block_ids,
                "notify_id": decode_kv.notify_id,
                "requester_engine_id": self.engine_id,
            }
        )
        kv_record = record.kv if record.kv is not None else {}
        if decode_kv.fail_pull:
            # An injected failed read: nothing reaches the prefill engine, which keeps the blocks.
            decode_kv.phase = "failed"
            self.counters["kv_pull_failures"] += 1
            self.counters["faults_pull_fail"] += 1
            kv_record["outcome"] = "pull_failed"
            kv_record["error"] = "injected pull failure"
            return None
        try:
            status, answer = await self.client.post(params.remote_host, params.remote_port, KV_PULL_PATH, body)
            if status != 200:
                raise ConnectionError(f"prefill engine answered {status}: {answer[:200]!r}")
            data = orjson.loads(answer)
        except (OSError, TimeoutError, ConnectionError, orjson.JSONDecodeError) as exc:
            decode_kv.phase = "failed"
            self.counters["kv_pull_failures"] += 1
            kv_record["outcome"] = "pull_failed"
            kv_record["error"] = str(exc) or type(exc).__name__
            return None
        decode_kv.phase = "pulled"
        self.counters["kv_pulls"] += 1
        kv_record["outcome"] = "pulled"
        kv_record["blocks"] = data.get("num_blocks")
        if data.get("stale"):
            # The blocks were freed before this read: vLLM's decode engine cannot tell and
            # answers normally (vLLM issue 21570); only the simulator's counters say so.
            self.counters["kv_stale_reads"] += 1
            kv_record["stale_read"] = True
        if data.get("prompt_digest") != job.prompt.digest:
            # The router changed the prompt between the legs: this KV is for another prompt.
            self.counters["kv_prompt_mismatch"] += 1
            kv_record["outcome"] = "prompt_mismatch"
            return None
        # A decode engine counts every transferred prompt token as cached (docs/simulator.md, "Decode leg").
        return job.prompt.num_tokens

    def _release_remote(self, decode_kv: _DecodeKv, record: _Record) -> None:
        decode_kv.phase = "released"
        self.counters["kv_releases_sent"] += 1
        if record.kv is None:
            record.kv = {"role": "decode", "owner": decode_kv.params.remote_request_id}
        record.kv["outcome"] = "released"
        task = self.loop.create_task(self._send_release(decode_kv))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_release(self, decode_kv: _DecodeKv) -> None:
        params = decode_kv.params
        assert params.remote_host is not None and params.remote_port is not None
        body = orjson.dumps({"notify_id": decode_kv.notify_id, "remote_block_ids": params.remote_block_ids})
        try:
            status, _ = await self.client.post(params.remote_host, params.remote_port, KV_NOTIFY_PATH, body)
        except (OSError, TimeoutError, ConnectionError):
            status = 0
        if status != 200:
            self.counters["kv_release_failures"] += 1

    # ------------------------------------------------------------------ control routes

    def _sim_stats(self, conn: ServerConnection, request: HttpRequest) -> None:
        conn.respond(200, orjson.dumps(self.stats()))

    def _sim_requests(self, conn: ServerConnection, request: HttpRequest) -> None:
        conn.respond(200, orjson.dumps(self.requests()))

    def _sim_reset(self, conn: ServerConnection, request: HttpRequest) -> None:
        self.reset()
        conn.respond(200, b'{"reset":true}')

    def _sim_get_faults(self, conn: ServerConnection, request: HttpRequest) -> None:
        conn.respond(200, orjson.dumps(self.faults.to_json()))

    def _sim_set_faults(self, conn: ServerConnection, request: HttpRequest) -> None:
        try:
            faults = Faults.from_json(orjson.loads(request.body))
        except (orjson.JSONDecodeError, FaultsError) as exc:
            conn.respond(400, error_body(400, f"bad fault settings: {exc}"))
            return
        self.set_faults(faults)
        conn.respond(200, orjson.dumps(faults.to_json()))


class _Flow:
    """A completion's view of its request in the engine core, updated by :meth:`SimEngine._dispatch`."""

    __slots__ = ("kind", "prompt_tokens", "started", "generated", "finished", "cached", "block_ids", "waiter",
                 "aborted")  # fmt: skip

    def __init__(self, kind: str, prompt_tokens: int) -> None:
        self.kind = kind
        self.prompt_tokens = prompt_tokens
        self.started = False
        self.generated = 0
        self.finished = False
        self.cached = 0
        self.block_ids: list[int] = []
        self.waiter: asyncio.Future[None] | None = None
        #: ``POST /abort_requests`` named it (docs/simulator.md, "vLLM versions").
        self.aborted = False

    def abort(self) -> None:
        """Mark aborted and wake the waiting handler."""
        self.aborted = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def check_aborted(self, external: str | None) -> None:
        """500 for the client of an aborted request (vLLM ends it with ``finish_reason`` ``abort``)."""
        if self.aborted:
            raise ApiError(500, f"Request {external} was aborted")

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition()`` holds (checked after each output for this request) or it is aborted."""
        while not condition() and not self.aborted:
            waiter = asyncio.get_running_loop().create_future()
            self.waiter = waiter
            await waiter


def _rid_header(request: HttpRequest) -> list[tuple[bytes, bytes]] | tuple[()]:
    rid = request.request_id
    return [(b"x-request-id", rid.encode("latin-1"))] if rid is not None else ()
