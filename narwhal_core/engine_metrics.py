"""What an engine's ``/metrics`` says about its load, read from the Prometheus text it serves.

vLLM's ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``, vLLM
0.10) exposes, per engine core (label ``engine``, several under data
parallelism):

* ``vllm:num_requests_waiting`` and ``vllm:num_requests_running`` (gauges,
  from the scheduler's stats);
* ``vllm:kv_cache_usage_perc`` (gauge, 0 to 1; ``vllm:gpu_cache_usage_perc``
  before 0.10, and beside it, deprecated, since);
* ``vllm:cache_config_info`` (an info metric written as a gauge set to 1,
  ``log_metrics_info("cache_config", ...)``) whose labels are the cache
  config's ``metrics_info()``: among them ``block_size`` and
  ``num_gpu_blocks``, whose product is the tokens of KV the engine can hold.

Only those lines are read; anything else, or a line that does not parse, is
skipped, so an engine that serves other metrics, or none of these, gives a
load with ``None`` where it said nothing. Pure and bounded: the text is at
most what the control request read (its ``body_limit``).
"""

from __future__ import annotations

from typing import Final

import attrs

__all__ = ["EngineLoad", "parse_load", "NOTHING_REPORTED"]


@attrs.frozen
class EngineLoad:
    """One engine's load as its metrics reported it (``None``: not reported)."""

    #: Requests waiting for the scheduler (summed over its engine cores).
    waiting: int | None = None
    #: Requests running (summed over its engine cores).
    running: int | None = None
    #: Fraction of its KV cache in use, 0 to 1 (the mean over its engine cores).
    kv_usage: float | None = None
    #: Tokens of KV cache it can hold (``num_gpu_blocks`` × ``block_size``, summed over its engine cores).
    kv_capacity_tokens: int | None = None


#: What an engine that reports none of the figures has said.
NOTHING_REPORTED: Final = EngineLoad()

_WAITING: Final = b"vllm:num_requests_waiting"
_RUNNING: Final = b"vllm:num_requests_running"
_USAGE: Final = b"vllm:kv_cache_usage_perc"
_USAGE_OLD: Final = b"vllm:gpu_cache_usage_perc"
_CACHE_INFO: Final = b"vllm:cache_config_info"
_NAMES: Final = (_WAITING, _RUNNING, _USAGE, _USAGE_OLD, _CACHE_INFO)


def parse_load(text: bytes) -> EngineLoad:
    """The load figures in an engine's ``/metrics`` answer (Prometheus text format 0.0.4)."""
    waiting: list[float] = []
    running: list[float] = []
    usage: list[float] = []
    usage_old: list[float] = []
    capacity: list[int] = []
    for line in text.split(b"\n"):
        if not line.startswith(b"vllm:"):
            continue  # comments, blank lines, other metrics
        sample = _sample(line)
        if sample is None:
            continue
        name, labels, value = sample
        if name == _WAITING:
            waiting.append(value)
        elif name == _RUNNING:
            running.append(value)
        elif name == _USAGE:
            usage.append(value)
        elif name == _USAGE_OLD:
            usage_old.append(value)
        elif name == _CACHE_INFO and value == 1.0:
            tokens = _capacity(labels)
            if tokens is not None:
                capacity.append(tokens)
    usage = usage or usage_old
    return EngineLoad(
        waiting=_count(waiting),
        running=_count(running),
        kv_usage=min(1.0, max(0.0, sum(usage) / len(usage))) if usage else None,
        kv_capacity_tokens=sum(capacity) if capacity else None,
    )


def _count(values: list[float]) -> int | None:
    if not values:
        return None
    total = sum(values)
    return int(total) if total >= 0 else None


def _sample(line: bytes) -> tuple[bytes, bytes, float] | None:
    """``name{labels} value [timestamp]`` -> (name, the raw labels, value); ``None``: not one of ours, or broken."""
    brace = line.find(b"{")
    if brace == -1:
        name, _, rest = line.partition(b" ")
        labels = b""
    else:
        name = line[:brace]
        close = line.rfind(b"}")
        if close < brace:
            return None
        labels = line[brace + 1 : close]
        rest = line[close + 1 :]
    if name not in _NAMES:
        return None
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return None  # NaN or infinite: says nothing
    return name, labels, value


def _capacity(labels: bytes) -> int | None:
    """``num_gpu_blocks`` × ``block_size`` from ``vllm:cache_config_info``'s labels; ``None`` if either is missing."""
    values = _label_values(labels)
    try:
        blocks = int(values[b"num_gpu_blocks"])
        size = int(values[b"block_size"])
    except (KeyError, ValueError):
        return None  # num_gpu_blocks is "None" until the engine has profiled its memory
    if blocks <= 0 or size <= 0:
        return None
    return blocks * size


def _label_values(labels: bytes) -> dict[bytes, bytes]:
    """``a="x",b="y\\"z"`` -> {a: x, b: y"z} (escapes ``\\\\``, ``\\"`` and ``\\n`` undone)."""
    values: dict[bytes, bytes] = {}
    i, end = 0, len(labels)
    while i < end:
        eq = labels.find(b"=", i)
        if eq == -1 or eq + 1 >= end or labels[eq + 1] != 0x22:  # '"'
            break
        key = labels[i:eq].strip(b" ,")
        j = eq + 2
        value = bytearray()
        while j < end and labels[j] != 0x22:
            if labels[j] == 0x5C and j + 1 < end:  # backslash
                j += 1
                value.append(0x0A if labels[j] == 0x6E else labels[j])  # \n, or the escaped byte itself
            else:
                value.append(labels[j])
            j += 1
        if j >= end:
            break  # unterminated value
        values[key] = bytes(value)
        i = j + 1
    return values
