"""``narwhal bench --client openai``: each request sent through the ``openai`` package, as an application would.

The raw client (:mod:`narwhal_bench.client`) is what measures a router
without measuring itself; this one measures what an application using the
official SDK sees, streaming included: TTFT is the SDK's first chunk that
carries output (text, chat content, reasoning or tool-call arguments),
stamped when the SDK hands it over. The SDK's own retries are off (an error
is an error of the run, as with the raw client). Its per-chunk cost is the
SDK's (pydantic models, httpx), far above the raw client's, so use it for
latencies under load, not for a router's throughput (docs/bench.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from narwhal_bench.stats import RequestResult

__all__ = ["SdkSender", "api_base", "has_output"]


def api_base(base_url: str, endpoint: str) -> str:
    """The SDK's ``base_url``: ``--base-url`` plus the endpoint without its ``/completions`` or ``/chat/completions``."""
    path = "/" + endpoint.strip("/")
    for tail in ("/chat/completions", "/completions"):
        if path.endswith(tail):
            return base_url.rstrip("/") + path[: -len(tail)]
    raise ValueError(f"--client openai sends /v1/completions or /v1/chat/completions, not {endpoint!r}")


def has_output(chunk: Any) -> bool:
    """Whether one streamed SDK chunk carries output: text, content, reasoning or tool-call arguments."""
    for choice in getattr(chunk, "choices", None) or ():
        if getattr(choice, "text", None):
            return True
        delta = getattr(choice, "delta", None)
        if delta is None:
            continue
        if delta.content or getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None):
            return True
        if any(call.function is not None and call.function.arguments for call in delta.tool_calls or ()):
            return True
    return False


def _cached(usage: Any) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = getattr(details, "cached_tokens", None)
    return cached if type(cached) is int else None


class SdkSender:
    """One ``openai.AsyncOpenAI`` client (its own connection pool) that sends the replay's requests."""

    def __init__(self, target: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        import openai

        self.target = target
        self.clock = clock
        self.client = openai.AsyncOpenAI(
            base_url=api_base(target.base_url, target.endpoint), api_key=target.api_key or "none",
            max_retries=0, timeout=target.timeout_s, default_headers=dict(target.headers),
        )  # fmt: skip

    def arguments(self, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
        """The ``create`` arguments of one request: as the raw client's body (docs/bench.md)."""
        target = self.target
        args: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "temperature": 0.0,
                                "extra_body": {"min_tokens": max_tokens, "ignore_eos": True}}  # fmt: skip
        if target.chat:
            if not isinstance(prompt, str):
                raise ValueError("token-id prompts need /v1/completions")
            args["messages"] = [{"role": "user", "content": prompt}]
        else:
            args["prompt"] = prompt
        if target.stream:
            args["stream"] = True
            args["stream_options"] = {"include_usage": True}
        return args

    async def send(self, args: dict[str, Any], result: RequestResult, origin: float) -> None:
        """Send one request, fill ``result`` (times from the send, on this sender's clock)."""
        import openai

        api = self.client.chat.completions if self.target.chat else self.client.completions
        times: list[float] = []
        sent = self.clock()
        result.sent_s = sent - origin
        try:
            answer = await api.create(**args)
            if self.target.stream:
                async for chunk in answer:
                    if has_output(chunk):
                        times.append(self.clock())
                    if getattr(chunk, "usage", None) is not None:
                        result.cached_tokens = _cached(chunk.usage)
            else:
                times = [self.clock()] * (answer.usage.completion_tokens if answer.usage else 1)
                result.cached_tokens = _cached(answer.usage)
            result.status = 200
        except openai.APIStatusError as exc:
            result.status = exc.status_code
            result.error = f"HTTP {exc.status_code}: {exc.message}"
        except openai.APIError as exc:  # connection refused or broken, timeout, a stream's error event
            result.error = f"{type(exc).__name__}: {exc}"
        ended = self.clock()
        if times:
            result.ttft_s = times[0] - sent
            result.itl_s = [b - a for a, b in zip(times, times[1:])]
        result.output_tokens = len(times)
        result.e2e_s = ended - sent
        if result.error is None and not times:
            result.error = "no output tokens"
        result.ok = result.error is None

    async def close(self) -> None:
        await self.client.close()
