"""An engine's load, read from its Prometheus ``/metrics`` text.

The routing policies weigh what an engine reports about itself (its queue,
its running sequences, how full its KV cache is, how big that cache is)
beside what Narwhal has in flight there. This module turns the bytes of one
scrape into an :class:`EngineLoad`, and does nothing else: no I/O, no clock
(the caller knows when it scraped).

The names are vLLM V1's (``PrometheusStatLogger``,
``vllm/v1/metrics/loggers.py``, vLLM 0.9-0.10, commit 005a810b):

* ``vllm:num_requests_waiting`` and ``vllm:num_requests_running`` (gauges);
* ``vllm:kv_cache_usage_perc`` (a gauge, 1 meaning full), called
  ``vllm:gpu_cache_usage_perc`` before 0.9 (kept as a deprecated twin until
  0.10): read when the new name is absent;
* ``vllm:cache_config_info``, a gauge set to 1 whose labels are the engine's
  cache configuration (``log_metrics_info``): ``num_gpu_blocks`` ×
  ``block_size`` is its KV capacity in tokens.

An engine running several data-parallel engine cores reports one sample per
core (the ``engine`` label): queues, running sequences and capacities are
summed, the KV usage is their mean. Anything that is not a readable sample
of these families is ignored; a figure with no readable sample is ``None``.
"""

from __future__ import annotations

import math
import re
from typing import Final

import attrs

__all__ = ["MAX_METRICS_BYTES", "EngineLoad", "MetricsError", "parse_engine_metrics"]

#: The largest ``/metrics`` body read (vLLM's, histograms included, is a few
#: hundred KB): past it, :class:`MetricsError`, so a scrape's work is bounded.
MAX_METRICS_BYTES: Final = 8 * 1024 * 1024

_WAITING: Final = b"vllm:num_requests_waiting"
_RUNNING: Final = b"vllm:num_requests_running"
_KV_USAGE: Final = b"vllm:kv_cache_usage_perc"
_KV_USAGE_OLD: Final = b"vllm:gpu_cache_usage_perc"
_CACHE_CONFIG: Final = b"vllm:cache_config_info"

# One sample line of the families above: the name at the start of a line,
# its labels (if any), blanks, the value (a timestamp may follow). Searched
# for by its literal beginning, so the work is linear in the input.
_SAMPLE: Final = re.compile(
    rb"^(vllm:(?:num_requests_waiting|num_requests_running|kv_cache_usage_perc|gpu_cache_usage_perc"
    rb"|cache_config_info))(\{[^\n]*\})?[ \t]+([^ \t\r\n]+)",
    re.MULTILINE,
)
_LABEL: Final = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"')
# Integers in labels: enough digits for any real cache, few enough to stay cheap.
_MAX_INT_DIGITS: Final = 18


class MetricsError(ValueError):
    """The ``/metrics`` body cannot be read at all (too large)."""


@attrs.frozen
class EngineLoad:
    """What one scrape of an engine's ``/metrics`` says about its load (``None``: not reported)."""

    #: Requests waiting to be scheduled.
    waiting: int | None
    #: Requests in the running batch.
    running: int | None
    #: KV-cache usage, 0 to 1.
    kv_usage: float | None
    #: KV-cache capacity in tokens (``num_gpu_blocks × block_size``).
    kv_capacity_tokens: int | None


def parse_engine_metrics(data: bytes) -> EngineLoad:
    """The load an engine reports in its Prometheus text exposition ``data``.

    Never raises on malformed text (unreadable lines are skipped); raises
    :class:`MetricsError` only when ``data`` is longer than
    :data:`MAX_METRICS_BYTES`.
    """
    if len(data) > MAX_METRICS_BYTES:
        raise MetricsError(f"/metrics body of {len(data)} bytes is over {MAX_METRICS_BYTES}")
    waiting: list[float] = []
    running: list[float] = []
    usage: list[float] = []
    old_usage: list[float] = []
    capacities: dict[bytes, int] = {}
    for match in _SAMPLE.finditer(data):
        name, labels, text = match.groups()
        if name == _CACHE_CONFIG:
            _add_capacity(capacities, labels or b"")
            continue
        value = _number(text)
        if value is None:
            continue
        if name == _WAITING:
            waiting.append(value)
        elif name == _RUNNING:
            running.append(value)
        elif name == _KV_USAGE:
            usage.append(value)
        else:
            old_usage.append(value)
    usage = usage or old_usage
    return EngineLoad(
        waiting=_count(waiting),
        running=_count(running),
        kv_usage=min(1.0, max(0.0, math.fsum(usage) / len(usage))) if usage else None,
        kv_capacity_tokens=sum(capacities.values()) if capacities else None,
    )


def _number(text: bytes) -> float | None:
    """A sample's value, if it is a finite number (Prometheus writes ``NaN`` and ``+Inf`` too)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _count(values: list[float]) -> int | None:
    """A gauge of requests summed over engine cores; a negative sample is not a count and is left out."""
    counts = [int(v) for v in values if v >= 0]
    return sum(counts) if counts else None


def _add_capacity(capacities: dict[bytes, int], labels: bytes) -> None:
    """One ``vllm:cache_config_info`` sample: its engine core's capacity, if its labels give one."""
    found = dict(_LABEL.findall(labels))
    blocks = _label_int(found.get(b"num_gpu_blocks"))
    block_size = _label_int(found.get(b"block_size"))
    if blocks is not None and block_size is not None:
        capacities[found.get(b"engine", b"")] = blocks * block_size


def _label_int(text: bytes | None) -> int | None:
    """A label holding a positive integer (``num_gpu_blocks`` is ``"None"`` before the engine has measured it)."""
    if text is None or not text.isdigit() or len(text) > _MAX_INT_DIGITS:
        return None
    value = int(text)
    return value if value > 0 else None
