"""An engine's load from its ``/metrics`` text (``narwhal_core.engine_metrics``).

Oracles: the exposition vLLM V1 writes (``vllm/v1/metrics/loggers.py``,
``PrometheusStatLogger``: the families, their labels, ``cache_config_info``
as a gauge of 1 whose labels are the cache configuration) and the one the
simulator writes (``narwhal_sim/server.py``, ``_prometheus``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal_core.engine_metrics import MAX_METRICS_BYTES, EngineLoad, MetricsError, parse_engine_metrics

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

VLLM = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
# HELP vllm:num_requests_waiting_by_priority Not a family read here.
vllm:num_requests_waiting_by_priority{engine="0"} 99.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.9
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.25
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 12.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27971",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
"""

# What narwhal_sim/server.py's _prometheus writes: the first three families, no cache_config_info.
SIM = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0625
# HELP narwhal_sim_requests_total Requests received.
# TYPE narwhal_sim_requests_total counter
narwhal_sim_requests_total 12
"""


def test_vllm_exposition() -> None:
    assert parse_engine_metrics(VLLM) == EngineLoad(waiting=3, running=7, kv_usage=0.25, kv_capacity_tokens=27971 * 16)


def test_simulator_exposition() -> None:
    assert parse_engine_metrics(SIM) == EngineLoad(waiting=0, running=2, kv_usage=0.0625, kv_capacity_tokens=None)


def test_older_vllm_names_the_usage_gpu_cache_usage_perc() -> None:
    old = b'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
    assert parse_engine_metrics(old) == EngineLoad(waiting=1, running=None, kv_usage=0.5, kv_capacity_tokens=None)


def test_data_parallel_engine_cores_add_up() -> None:
    text = b"".join(
        b'vllm:num_requests_waiting{engine="%d",model_name="m"} %d.0\n'
        b'vllm:num_requests_running{engine="%d",model_name="m"} 1.0\n'
        b'vllm:kv_cache_usage_perc{engine="%d",model_name="m"} %s\n'
        b'vllm:cache_config_info{block_size="16",engine="%d",num_gpu_blocks="1000"} 1.0\n' % (i, i, i, i, usage, i)
        for i, usage in enumerate((b"0.2", b"0.4"))
    )
    load = parse_engine_metrics(text)
    assert (load.waiting, load.running, load.kv_capacity_tokens) == (1, 2, 32000)
    assert load.kv_usage == pytest.approx(0.3)


def test_unreadable_samples_are_left_out() -> None:
    text = (
        b"vllm:num_requests_waiting NaN\n"
        b"vllm:num_requests_running -1\n"
        b"vllm:kv_cache_usage_perc +Inf\n"
        b'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
        b"vllm:num_requests_waiting{engine=\"0\"} many\n"
        b"  vllm:num_requests_running 4\n"  # not at the start of a line
    )
    assert parse_engine_metrics(text) == EngineLoad(None, None, None, None)
    assert parse_engine_metrics(b"") == EngineLoad(None, None, None, None)
    # A usage a hair over 1 (float error) is full, not unknown.
    assert parse_engine_metrics(b"vllm:kv_cache_usage_perc 1.0000001\n").kv_usage == 1.0


def test_labels_with_quotes_braces_and_a_timestamp() -> None:
    text = (
        b'vllm:num_requests_waiting{model_name="a \\"}\\" b",engine="0"} 5 1712345678000\n'
        b'vllm:cache_config_info{engine="0",note="x}y",block_size="32",num_gpu_blocks="10"} 1\r\n'
    )
    assert parse_engine_metrics(text) == EngineLoad(waiting=5, running=None, kv_usage=None, kv_capacity_tokens=320)


def test_too_large_is_refused() -> None:
    with pytest.raises(MetricsError) as caught:
        parse_engine_metrics(b"#" * (MAX_METRICS_BYTES + 1))
    assert isinstance(caught.value, ValueError)


def test_a_long_pathological_line_is_read_in_linear_time() -> None:
    # A quadratic scan would not finish here (the suite's timeout fails it).
    line = b"vllm:num_requests_waiting{" + b'a="}' * 250_000 + b"\n"
    assert parse_engine_metrics(line * 4).waiting is None


FRAGMENTS = st.sampled_from([
    b"vllm:num_requests_waiting", b"vllm:num_requests_running", b"vllm:kv_cache_usage_perc",
    b"vllm:gpu_cache_usage_perc", b"vllm:cache_config_info", b"{", b"}", b'engine="0"', b'block_size="16"',
    b'num_gpu_blocks="7"', b'num_gpu_blocks="99999999999999999999999"', b",", b"=", b'"', b"\\", b" ", b"\t",
    b"\n", b"\r\n", b"# HELP ", b"1", b"0.5", b"-3", b"1e308", b"1e999", b"NaN", b"+Inf", b"\xff", b"\x00",
])  # fmt: skip


@SETTINGS
@given(data=st.lists(FRAGMENTS, max_size=40).map(b"".join) | st.binary(max_size=300))
def test_any_bytes_give_a_load_or_none(data: bytes) -> None:
    load = parse_engine_metrics(data)
    assert load.waiting is None or (isinstance(load.waiting, int) and load.waiting >= 0)
    assert load.running is None or (isinstance(load.running, int) and load.running >= 0)
    assert load.kv_usage is None or 0.0 <= load.kv_usage <= 1.0
    assert load.kv_capacity_tokens is None or load.kv_capacity_tokens > 0
    assert parse_engine_metrics(data) == load


def test_the_load_is_a_frozen_value() -> None:
    load = parse_engine_metrics(SIM)
    with pytest.raises(AttributeError):
        load.waiting = 3  # type: ignore[misc]
    assert load == parse_engine_metrics(SIM) and hash(load) == hash(parse_engine_metrics(SIM))
