"""The control side of one engine: ``/sim/*`` (never authenticated, never recorded) and the abort routes.

``GET /sim/stats``, ``GET /sim/requests``, ``POST /sim/reset`` and
``GET``/``POST /sim/faults`` read and steer the simulator; ``POST /abort_request``
(the simulator's own, ``--abort-request-route``) frees the KV of an owner key, and
vLLM's ``POST /abort_requests`` aborts live requests (docs/simulator.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from narwhal_sim.decode import DecodeKv
from narwhal_sim.driving import CoreDriver
from narwhal_sim.http1 import HttpRequest, ServerConnection
from narwhal_sim.model import Faults, FaultsError
from narwhal_sim.prefill import PrefillKv
from narwhal_sim.protocol import ApiError, error_body
from narwhal_sim.serving import ABORT_PATH, ABORT_REQUESTS_PATH, Routes, Serving, json_body

__all__ = ["Control"]


class Control:
    """Counters, records and faults of the simulator, and the routes that abort or free by ID."""

    def __init__(self, serving: Serving, driver: CoreDriver, prefill: PrefillKv, decode: DecodeKv, *,
                 vllm_version: str, connections: Callable[[], int]) -> None:  # fmt: skip
        self.serving = serving
        self.driver = driver
        self.prefill = prefill
        self.decode = decode
        self.vllm_version = vllm_version
        self._connections = connections
        self.control: Routes = {
            "/sim/stats": {"GET": self._sim_stats},
            "/sim/requests": {"GET": self._sim_requests},
            "/sim/reset": {"POST": self._sim_reset},
            "/sim/faults": {"GET": self._sim_get_faults, "POST": self._sim_set_faults},
        }
        config = serving.config
        self.routes: Routes = {}
        if config.abort_request_route:
            self.routes[ABORT_PATH] = {"POST": self._abort_request}
        if (config.tokens_only or config.dev_mode) and serving.family.abort_requests_route:
            self.routes[ABORT_REQUESTS_PATH] = {"POST": self._abort_requests}

    # ------------------------------------------------------------------ in-process API

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (``GET /sim/stats``)."""
        serving = self.serving
        config = serving.config
        ledger = self.prefill.ledger
        decoder_ledger = self.decode.decoder_ledger
        core = self.driver.core
        publisher = self.driver.publisher
        out: dict[str, Any] = {
            "role": config.role,
            "engine_id": serving.engine_id,
            "vllm_version": self.vllm_version,
            "vllm_family": serving.family.name,
            "kv_lease_s": ledger.lease_s,
            "model": config.model,
            "url": serving.url,
            "speed": config.speed,
            "running": core.num_running,
            "waiting": core.num_waiting,
            "free_blocks": core.pool.num_free,
            "total_blocks": core.pool.num_blocks,
            "kv_cache_usage": core.pool.usage,
            "prefix_cache_queries": core.prefix_cache_queries,
            "prefix_cache_hits": core.prefix_cache_hits,
            "steps": core.steps,
            "kv_events_endpoint": publisher.endpoint if publisher is not None else None,
            "kv_events_replay_endpoint": publisher.replay_endpoint if publisher is not None else None,
            "kv_events_published": publisher.published if publisher is not None else 0,
            "kv_events_encoding": publisher.encoding if publisher is not None else None,
            "connections": self._connections(),
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
            "decoder_kv_held": len(decoder_ledger),
            "decoder_kv_held_blocks": decoder_ledger.held_blocks,
            "decoder_kv_expired": decoder_ledger.counts["expired"],
        }
        out.update(serving.counters)
        return out

    def requests(self) -> list[dict[str, Any]]:
        """The recorded requests, oldest first (``GET /sim/requests``)."""
        return [r.to_json() for r in self.serving.records]

    def reset(self) -> None:
        """Zero the counters and forget recorded requests (held KV stays held)."""
        counters = self.serving.counters
        for key in counters:
            counters[key] = 0
        self.prefill.ledger.reset_counts()
        self.decode.decoder_ledger.reset_counts()
        core = self.driver.core
        core.prefix_cache_queries = core.prefix_cache_hits = core.steps = 0
        core.prompt_tokens_computed = core.generation_tokens = 0
        self.serving.records.clear()

    # ------------------------------------------------------------------ control routes

    def _sim_stats(self, conn: ServerConnection, request: HttpRequest) -> None:
        conn.respond(200, orjson.dumps(self.stats()))

    def _sim_requests(self, conn: ServerConnection, request: HttpRequest) -> None:
        conn.respond(200, orjson.dumps(self.requests()))

    def _sim_reset(self, conn: ServerConnection, request: HttpRequest) -> None:
        self.reset()
        conn.respond(200, b'{"reset":true}')

    def _sim_get_faults(self, conn: ServerConnection, request: HttpRequest) -> None:
        conn.respond(200, orjson.dumps(self.serving.faults.to_json()))

    def _sim_set_faults(self, conn: ServerConnection, request: HttpRequest) -> None:
        try:
            faults = Faults.from_json(orjson.loads(request.body))
        except (orjson.JSONDecodeError, FaultsError) as exc:
            conn.respond(400, error_body(400, f"bad fault settings: {exc}"))
            return
        self.serving.set_faults(faults)
        conn.respond(200, orjson.dumps(faults.to_json()))

    # ------------------------------------------------------------------ abort routes

    def _abort_request(self, conn: ServerConnection, request: HttpRequest) -> None:
        serving = self.serving
        try:
            data = json_body(request)
            owner = data.get("request_id", data.get("rid"))  # "rid": SGLang's name
            if not isinstance(owner, str):
                raise ApiError(400, "request_id must be a string", param="request_id")
        except ApiError as exc:
            serving.answer_error(conn, request, exc)
            return
        # Unknown owners answer 200 and free nothing: releases are idempotent.
        entry = self.prefill.ledger.release(owner)
        if entry is not None:
            self.prefill.kv_ended(entry)
        if serving.config.abort_request_route == "bare":
            serving.answer(conn, request, 200, b"", content_type=None)  # SGLang confirms nothing
            return
        answer = {"request_id": owner, "released": entry is not None, "num_blocks": len(entry.block_ids) if entry else 0}
        serving.answer(conn, request, 200, orjson.dumps(answer))

    def _abort_requests(self, conn: ServerConnection, request: HttpRequest) -> None:
        """vLLM's ``POST /abort_requests``: abort live requests by their external IDs.

        It aborts requests the engine is still working on; a finished prefill's held
        blocks are not a live request, so they stay held (docs/simulator.md). With
        ``--tokens-only``: 200 with an empty body, whatever happened; in dev mode
        ``{"status": "aborted", "aborted": N}``, and an empty list aborts everything.
        """
        serving = self.serving
        config = serving.config
        driver = self.driver
        try:
            data = json_body(request)
        except ApiError as exc:
            serving.answer_error(conn, request, exc)
            return
        ids = data.get("request_ids")
        if config.dev_mode and not config.tokens_only:
            targets = list(driver.external) if not ids else [i for i in ids if isinstance(i, str)]
        else:
            if ids is None:
                serving.answer(conn, request, 400, serving.error_body(400, "Missing 'request_ids' in request body"))
                return
            targets = [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []
        aborted = 0
        now = driver.core_now()
        for external in targets:
            core_id = driver.external.get(external)
            flow = driver.flows.get(core_id) if core_id is not None else None
            if core_id is None or flow is None:
                continue
            if driver.core.abort(core_id, now=now):
                flow.block_ids = []
            flow.abort()
            aborted += 1
        serving.counters["aborted"] += aborted
        if aborted:
            driver.pump()
        if config.dev_mode and not config.tokens_only:
            serving.answer(conn, request, 200, orjson.dumps({"status": "aborted", "aborted": aborted}))
        else:
            serving.answer(conn, request, 200, b"", content_type=None)
