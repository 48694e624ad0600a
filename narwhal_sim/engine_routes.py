"""The routes of vLLM's OpenAI server beside completions: health, models, metrics, tokenize, version.

``GET /health``, ``GET /v1/models``, ``GET /metrics`` (vLLM's Prometheus
families), ``POST /tokenize``, ``POST /detokenize``, ``POST /reset_prefix_cache``
and ``GET /version`` (docs/simulator.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import orjson

from narwhal_sim.driving import CoreDriver
from narwhal_sim.http1 import HttpRequest, ServerConnection
from narwhal_sim.model import KvLedger, Prompt, PromptError
from narwhal_sim.protocol import ApiError
from narwhal_sim.serving import Routes, Serving, json_body
from narwhal_sim.tokens import pseudo_token_text

__all__ = ["EngineRoutes"]

_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"


class EngineRoutes:
    """What an engine answers about itself, and its tokenizer's routes."""

    def __init__(self, serving: Serving, driver: CoreDriver, ledger: KvLedger, *, vllm_version: str) -> None:
        self.serving = serving
        self.driver = driver
        self.ledger = ledger
        self.vllm_version = vllm_version
        self.started_at = int(time.time())
        self.routes: Routes = {
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            "/metrics": {"GET": self._metrics},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
            "/reset_prefix_cache": {"POST": self._reset_prefix_cache},
            "/version": {"GET": self._version},
        }

    def _health(self, conn: ServerConnection, request: HttpRequest) -> None:
        if self.serving.faults.unhealthy:
            self.serving.counters["faults_unhealthy"] += 1
            self.serving.answer(conn, request, 503, self.serving.error_body(503, "engine unhealthy (injected)"))
        else:
            self.serving.answer(conn, request, 200, b"", content_type=None)

    def _models(self, conn: ServerConnection, request: HttpRequest) -> None:
        model = self.serving.config.model
        card = {
            "id": model,
            "object": "model",
            "created": self.started_at,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": self.serving.config.max_model_len,
            "permission": [],
        }
        self.serving.answer(conn, request, 200, orjson.dumps({"object": "list", "data": [card]}))

    def _tokenize(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None] | None:
        """vLLM's ``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` → ``{count, max_model_len, tokens, token_strs}``.

        With a tokenizer, answered from the tokenizing thread (see :attr:`Serving.tokenizing`).
        """
        if self.serving.tokenizing is None:
            self.serving.answer(conn, request, *self._tokenize_answer(request))
            return None
        return self._tokenize_off_loop(conn, request)

    async def _tokenize_off_loop(self, conn: ServerConnection, request: HttpRequest) -> None:
        loop = asyncio.get_running_loop()
        status, body = await loop.run_in_executor(self.serving.tokenizing, self._tokenize_answer, request)
        self.serving.answer(conn, request, status, body)

    def _tokenize_answer(self, request: HttpRequest) -> tuple[int, bytes]:
        """The ``/tokenize`` answer's status and body."""
        try:
            data = json_body(request)
            model = data.get("model")
            if model is not None and model != self.serving.config.model:
                raise ApiError(404, f"The model `{model}` does not exist.", param="model")
            flags = {}
            for name in ("add_special_tokens", "add_generation_prompt", "continue_final_message", "return_token_strs"):
                value = data.get(name)
                if value is not None and type(value) is not bool:
                    raise ApiError(400, f"{name} must be a boolean", param=name)
                flags[name] = value
            tokenizer = self.serving.tokenizer
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
            return 400, self.serving.error_body(400, str(exc), param=exc.param)
        except ApiError as exc:
            return exc.status, exc.body(flat=self.serving.flat_errors)
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": self.serving.config.max_model_len, "tokens": ids,
                                  "token_strs": None}  # fmt: skip
        if flags["return_token_strs"]:
            answer["token_strs"] = (
                [tokenizer.decode([t]) for t in ids] if tokenizer is not None else [pseudo_token_text([t]) for t in ids]
            )
        return 200, orjson.dumps(answer)

    def _detokenize(self, conn: ServerConnection, request: HttpRequest) -> None:
        """vLLM's ``POST /detokenize``: ``{"tokens": [...]}`` → ``{"prompt": text}``."""
        try:
            data = json_body(request)
            model = data.get("model")
            if model is not None and model != self.serving.config.model:
                raise ApiError(404, f"The model `{model}` does not exist.", param="model")
            ids = data.get("tokens")
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise ApiError(400, "tokens must be an array of integers", param="tokens")
            if self.serving.tokenizer is not None:
                try:
                    text = self.serving.tokenizer.decode(ids)
                except ValueError as exc:
                    raise ApiError(400, str(exc), param="tokens") from None
            else:
                text = pseudo_token_text(ids)
        except ApiError as exc:
            self.serving.answer(conn, request, exc.status, exc.body(flat=self.serving.flat_errors))
            return
        self.serving.answer(conn, request, 200, orjson.dumps({"prompt": text}))

    def _reset_prefix_cache(self, conn: ServerConnection, request: HttpRequest) -> None:
        """vLLM's ``POST /reset_prefix_cache``: forget every cached block (``AllBlocksCleared``)."""
        self.driver.core.reset_prefix_cache(now=self.driver.core_now())
        self.driver.pump()
        self.serving.answer(conn, request, 200, b"", content_type=None)

    def _metrics(self, conn: ServerConnection, request: HttpRequest) -> None:
        self.serving.answer(conn, request, 200, self._prometheus(), content_type=_PROMETHEUS)

    def _prometheus(self) -> bytes:
        label = '{engine="0",model_name="%s"}' % self.serving.config.model.replace("\\", "\\\\").replace('"', '\\"')
        c = self.serving.counters
        ledger = self.ledger
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value}")

        core = self.driver.core
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

    def _version(self, conn: ServerConnection, request: HttpRequest) -> None:
        self.serving.answer(conn, request, 200, orjson.dumps({"version": self.vllm_version}))
