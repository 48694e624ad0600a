"""The simulated engine: an OpenAI-compatible server that speaks the PD protocol of docs/simulator.md.

:class:`SimEngine` composes one engine's flows, each in a module of its own,
and routes every request to one of them. It runs on one asyncio loop.

* :mod:`narwhal_sim.serving` — identity, counters, request records, the JSON log;
* :mod:`narwhal_sim.driving` — the pure engine core (:mod:`narwhal_sim.engine`) stepped on the loop;
* :mod:`narwhal_sim.completion` — ``POST /v1/completions``, ``POST /v1/chat/completions``;
* :mod:`narwhal_sim.prefill` — a finished prefill's held KV and its lease;
* :mod:`narwhal_sim.decode` — a decode request's pull, release and lease renewals;
* :mod:`narwhal_sim.kv_pull` — the internal ``POST /kv/pull``, ``/kv/notify``, ``/kv/heartbeat``
  a decode engine sends to the prefill engine named by ``remote_host``/``remote_port``;
* :mod:`narwhal_sim.engine_routes` — ``GET /health``, ``/v1/models``, ``/metrics``, ``/version``,
  ``POST /tokenize``, ``/detokenize``, ``/reset_prefix_cache``;
* :mod:`narwhal_sim.control` — ``POST /abort_request`` (free the KV of an owner key), vLLM's
  ``POST /abort_requests``, and the control routes ``/sim/stats``, ``/sim/requests``,
  ``/sim/reset``, ``/sim/faults`` (never authenticated, never recorded);
* :mod:`narwhal_sim.versions` — the vLLM version families every flow reads.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Coroutine
from typing import IO, Any

import orjson

from narwhal_sim.completion import Completions
from narwhal_sim.config import DEFAULT_MODEL, SimConfig
from narwhal_sim.control import Control
from narwhal_sim.decode import DecodeClaim, DecodeKv
from narwhal_sim.driving import CoreDriver
from narwhal_sim.engine import EngineCore
from narwhal_sim.engine_routes import EngineRoutes
from narwhal_sim.http1 import HttpRequest, HttpServer, Limits, ServerConnection
from narwhal_sim.kv_events import KvEventPublisher
from narwhal_sim.kv_pull import KvPullRoutes
from narwhal_sim.model import Faults
from narwhal_sim.prefill import PrefillKv
from narwhal_sim.protocol import ApiError, KvParams, error_body
from narwhal_sim.serving import (
    ABORT_PATH,
    ABORT_REQUESTS_PATH,
    KV_HEARTBEAT_PATH,
    KV_NOTIFY_PATH,
    KV_PULL_PATH,
    Routes,
    Serving,
)
from narwhal_sim.versions import VllmFamily, kv_event_maps, resolve_version

__all__ = ["SimConfig", "SimEngine", "KV_PULL_PATH", "KV_NOTIFY_PATH", "KV_HEARTBEAT_PATH", "ABORT_PATH",
           "ABORT_REQUESTS_PATH", "DEFAULT_MODEL"]  # fmt: skip


class SimEngine:
    """One simulated engine on the running asyncio loop: its flows, composed, and the routes to them."""

    def __init__(self, config: SimConfig, *, log_stream: IO[bytes] | None = None) -> None:
        config.check()
        self.config = config
        self.loop = loop = asyncio.get_running_loop()
        self.engine_id = config.engine_id or f"sim-{config.role}-{uuid.uuid4().hex[:12]}"
        family, self.vllm_version = resolve_version(config.vllm_version)
        self.family: VllmFamily = family
        self.serving = serving = Serving(config, family, self.engine_id, log_stream=log_stream)
        self.driver = driver = CoreDriver(config.step_config, serving.counters, speed=config.speed,
                                          kv_events=config.kv_events_endpoint is not None, loop=loop)  # fmt: skip
        lease_s = config.kv_lease_s if config.kv_lease_s is not None else family.hold_s
        self.prefill = PrefillKv(serving, driver, lease_s=lease_s,
                                 reaper_stops_at_first_live=family.reaper_stops_at_first_live, loop=loop)  # fmt: skip
        self.decode = DecodeKv(serving, driver, lease_s=lease_s, loop=loop)
        self._http = HttpServer(
            self,
            limits=Limits(
                keep_alive_s=config.keep_alive_s,
                read_timeout_s=config.read_timeout_s,
                max_body_bytes=config.max_body_bytes,
            ),
            loop=loop,
        )
        self.control = Control(serving, driver, self.prefill, self.decode, vllm_version=self.vllm_version,
                               connections=lambda: len(self._http.connections))  # fmt: skip
        self._routes: Routes = {
            **Completions(serving, driver, self.prefill, self.decode).routes,
            **EngineRoutes(serving, driver, self.prefill.ledger, vllm_version=self.vllm_version).routes,
            **KvPullRoutes(serving, self.prefill).routes,
            **self.control.routes,
        }

    # ------------------------------------------------------------------ what tests and the CLI read

    @property
    def host(self) -> str:
        return self.serving.host

    @property
    def port(self) -> int:
        return self.serving.port

    @property
    def url(self) -> str:
        return self.serving.url

    @property
    def core(self) -> EngineCore:
        """The pure engine core."""
        return self.driver.core

    @property
    def publisher(self) -> KvEventPublisher | None:
        return self.driver.publisher

    @property
    def faults(self) -> Faults:
        return self.serving.faults

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (``GET /sim/stats``)."""
        return self.control.stats()

    def requests(self) -> list[dict[str, Any]]:
        """The recorded requests, oldest first (``GET /sim/requests``)."""
        return self.control.requests()

    def set_faults(self, faults: Faults) -> None:
        """Replace the fault settings."""
        self.serving.set_faults(faults)

    def reset(self) -> None:
        """Zero the counters and forget recorded requests (held KV stays held)."""
        self.control.reset()

    # ------------------------------------------------------------------ lifecycle

    async def start(self, on_listening: Callable[[SimEngine], None] | None = None) -> None:
        """Listen, call ``on_listening`` (nothing has been served yet), then serve."""
        serving = self.serving
        serving.open_log()
        serving.host, serving.port = self._http.bind(self.config.host, self.config.port)
        host = f"[{serving.host}]" if ":" in serving.host else serving.host
        serving.url = f"http://{host}:{serving.port}"
        config = self.config
        if config.kv_events_endpoint is not None:
            replay = config.kv_events_replay_endpoint
            if replay is None and config.data_parallel_rank == 0:
                # vLLM names no default either; ours is the PUB port + 1 on the same host (none for a rank
                # past 0: rank 1 publishes on that port, docs/simulator.md).
                pub_host, _, pub_port = config.kv_events_endpoint.rpartition(":")
                replay = f"{pub_host}:{int(pub_port) + 1}" if pub_port.isdigit() and int(pub_port) else None
            self.driver.publisher = KvEventPublisher(
                config.kv_events_endpoint, replay_endpoint=replay, topic=config.kv_events_topic,
                data_parallel_rank=config.data_parallel_rank, map_batch=config.kv_events_batch_map,
                map_events=kv_event_maps(self.family, self.vllm_version),
            )
        if on_listening is not None:
            on_listening(self)
        await self._http.start_serving()

    async def close(self) -> None:
        """Stop serving; held KV is forgotten with the process."""
        self.prefill.close()
        self.decode.cancel_timer()
        self.driver.cancel_timer()
        await self._http.close()
        if self.driver.publisher is not None:
            self.driver.publisher.close()
        self.serving.close_tokenizing()
        self.decode.close()
        self.serving.close_log()

    # ------------------------------------------------------------------ HTTP app

    def handle(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None] | None:
        """Route one request (called by the HTTP layer)."""
        path = request.path
        if path.startswith("/sim/"):
            methods = self.control.control.get(path)
            handler = methods.get(request.method) if methods else None
            if handler is None:
                status = 405 if methods else 404
                conn.respond(status, error_body(status, f"no route {request.method} {path}"))
                return None
            return handler(conn, request)
        serving = self.serving
        serving.record(request)
        if serving.auth is not None and not serving.authorized(request):
            serving.counters["auth_failures"] += 1
            serving.answer(conn, request, 401, serving.error_body(401, "Unauthorized"), outcome="unauthorized")
            return None
        methods = self._routes.get(path)
        if methods is None:
            serving.answer(conn, request, 404, serving.error_body(404, f"Not Found: {path}"), outcome="error")
            return None
        handler = methods.get(request.method)
        if handler is None:
            serving.answer(conn, request, 405, serving.error_body(405, "Method Not Allowed"), outcome="error")
            return None
        return handler(conn, request)

    def abandon(self, request: HttpRequest) -> None:
        """A pipelined request whose connection closed before it was handled."""
        if request.path.startswith("/sim/"):
            return
        serving = self.serving
        record = serving.record(request)
        record.outcome = "client_gone"
        serving.counters["client_gone"] += 1
        try:
            data = orjson.loads(request.body)
            push = self.config.kv_transfer_mode == "push"
            params = KvParams.parse(data.get("kv_transfer_params"), push=push) if isinstance(data, dict) else None
        except (orjson.JSONDecodeError, ApiError):
            params = None
        if params is not None and params.mode == "decode" and self.config.role != "prefill":
            # Never reached the engine: before the lease family nothing tells the prefill engine.
            if self.family.notify_on_rejection:
                self.decode.release_remote(DecodeClaim(params, params.remote_request_id), record)
        serving.finish(record)

    def bad_request(self) -> None:
        """A connection sent something unparsable or too slow."""
        self.serving.counters["bad_requests"] += 1
