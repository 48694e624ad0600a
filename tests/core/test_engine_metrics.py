"""Reading an engine's load from its ``/metrics`` text (narwhal_core/engine_metrics.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal_core.engine_metrics import NOTHING_REPORTED, EngineLoad, parse_load

#: Lines as vLLM 0.10's PrometheusStatLogger writes them (one engine core; a histogram and a counter beside).
VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="4096",num_gpu_blocks_override="None"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 12345.0
"""


def test_the_figures_of_a_vllm_engine() -> None:
    assert parse_load(VLLM) == EngineLoad(waiting=7, running=3, kv_usage=0.25, kv_capacity_tokens=16 * 4096)


def test_engine_cores_of_a_data_parallel_engine_add_up() -> None:
    text = b"\n".join([
        b'vllm:num_requests_waiting{engine="0"} 2', b'vllm:num_requests_waiting{engine="1"} 5',
        b'vllm:num_requests_running{engine="0"} 1', b'vllm:num_requests_running{engine="1"} 1',
        b'vllm:kv_cache_usage_perc{engine="0"} 0.2', b'vllm:kv_cache_usage_perc{engine="1"} 0.6',
        b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="10"} 1.0',
        b'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="30"} 1.0',
    ])
    load = parse_load(text)
    assert (load.waiting, load.running, load.kv_capacity_tokens) == (7, 2, 16 * 40)
    assert load.kv_usage is not None and abs(load.kv_usage - 0.4) < 1e-9


def test_an_older_vllm_reports_usage_under_its_old_name() -> None:
    assert parse_load(b'vllm:gpu_cache_usage_perc{engine="0"} 0.5\n').kv_usage == 0.5


def test_what_is_not_said_stays_unknown() -> None:
    assert parse_load(b"") == NOTHING_REPORTED
    assert parse_load(b"# HELP x\nprocess_cpu_seconds_total 1.0\n") == NOTHING_REPORTED
    # Not profiled yet: vLLM writes num_gpu_blocks="None".
    assert parse_load(b'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0').kv_capacity_tokens is None
    # NaN, a broken value, a broken label set: skipped, not guessed.
    assert parse_load(b'vllm:num_requests_waiting{engine="0"} NaN\nvllm:num_requests_running{ 3\n'
                      b'vllm:kv_cache_usage_perc{engine="0"} lots\n') == NOTHING_REPORTED


def test_label_values_with_escapes_are_read_whole() -> None:
    text = b'vllm:cache_config_info{model_name="a\\"},num_gpu_blocks=\\\\",block_size="8",num_gpu_blocks="3"} 1\n'
    assert parse_load(text).kv_capacity_tokens == 24


def test_a_timestamp_after_the_value_is_allowed() -> None:
    assert parse_load(b"vllm:num_requests_waiting 4 1700000000000\n").waiting == 4


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400) | st.lists(st.sampled_from([
    b"vllm:num_requests_waiting", b"vllm:cache_config_info", b"{", b"}", b'"', b"\\", b"=", b" ", b"\n", b"1.5",
    b"-3", b"inf", b"block_size", b"num_gpu_blocks", b",", b"nan", b"1e309",
]), max_size=40).map(b"".join))
def test_any_bytes_give_a_load_never_an_exception(text: bytes) -> None:
    load = parse_load(text)
    assert load.waiting is None or load.waiting >= 0
    assert load.running is None or load.running >= 0
    assert load.kv_usage is None or 0.0 <= load.kv_usage <= 1.0
    assert load.kv_capacity_tokens is None or load.kv_capacity_tokens > 0
