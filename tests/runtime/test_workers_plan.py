"""What each worker of ``narwhal serve --workers N`` gets (docs/operate.md, "Workers"; docs/configure.md)."""

from __future__ import annotations

import pytest

from narwhal_core import ConfigError
from narwhal_runtime.group_metrics import aggregate
from narwhal_runtime.workers import resolve_workers, share, worker_config, worker_journal_path

from ..harness import make_config


@pytest.mark.parametrize(("value", "workers", "each"), [
    (256, 2, 128), (5, 2, 3), (1, 4, 1), (3, 3, 1), (0, 4, 0), (20000, 3, 6667),
])
def test_a_fleet_wide_limit_is_split_rounding_up_and_never_to_zero(value: int, workers: int, each: int) -> None:
    assert share(value, workers) == each
    if value:
        assert value <= workers * each < value + workers


@pytest.mark.parametrize(("path", "expected"), [
    ("journal.jsonl", "journal.w3.jsonl"),
    ("/var/log/narwhal/journal.jsonl", "/var/log/narwhal/journal.w3.jsonl"),
    ("journal", "journal.w3"),
    ("dir.d/journal", "dir.d/journal.w3"),
])
def test_worker_journal_path(path: str, expected: str) -> None:
    assert worker_journal_path(path, 3) == expected


def test_stdout_journal_cannot_be_split() -> None:
    with pytest.raises(ConfigError, match="journal.path"):
        worker_journal_path("-", 0)


def test_worker_config_takes_its_share_and_the_group_port(tmp_path) -> None:
    config = make_config(tmp_path / "j.jsonl", decode=("http://127.0.0.1:9",),
                         ingress={"max_connections": 101},
                         admission={"max_inflight": 10, "queue_size": 0, "per_client_max_inflight": 3},
                         engine={"max_inflight_per_engine": 7})
    mine = worker_config(config, index=1, workers=2, port=4321)
    assert mine.ingress.listen == "127.0.0.1:4321" and mine.ingress.listen_port == 4321
    assert mine.ingress.workers == 2
    assert mine.ingress.max_connections == 51
    assert (mine.admission.max_inflight, mine.admission.queue_size, mine.admission.per_client_max_inflight) == (5, 0, 2)
    assert mine.engine.max_inflight_per_engine == 4
    assert mine.journal.path == str(tmp_path / "j.w1.jsonl")
    assert mine.admission.queue_timeout_s == config.admission.queue_timeout_s


def test_worker_config_shares_each_tenant_budget(tmp_path) -> None:
    config = make_config(tmp_path / "j.jsonl", decode=("http://127.0.0.1:9",), tenants={
        "default_requests_per_s": 3, "default_prompt_tokens_per_min": 600, "default_max_inflight": 5,
        "tenant": [{"name": "a", "requests_per_s": 1, "max_inflight": 0}, {"name": "b"}],
    })
    mine = worker_config(config, index=0, workers=2, port=4321).tenants
    assert mine is not None
    assert (mine.default_requests_per_s, mine.default_prompt_tokens_per_min, mine.default_max_inflight) == (1.5, 300, 3)
    assert (mine.budget("a").requests_per_s, mine.budget("a").max_inflight) == (0.5, 0)  # 0: still unlimited
    assert mine.budget("b") == mine.default_budget
    assert worker_config(make_config(tmp_path / "k", decode=("http://127.0.0.1:9",)), index=0, workers=2,
                         port=1).tenants is None


def test_worker_count(tmp_path) -> None:
    config = make_config(tmp_path / "j", decode=("http://127.0.0.1:9",), ingress={"workers": "auto"})
    assert resolve_workers(config) >= 1
    assert resolve_workers(config, 3) == 3
    with pytest.raises(ConfigError, match="ingress.workers"):
        resolve_workers(config, 0)


_SNAPSHOT = """# HELP narwhal_requests_total Completion requests.
# TYPE narwhal_requests_total counter
narwhal_requests_total{{route="/v1/completions",status="200"}} {n}
# HELP narwhal_ready 1 when /ready answers 200.
# TYPE narwhal_ready gauge
narwhal_ready {ready}
# HELP narwhal_engine_kv_connector NIXL connector version.
# TYPE narwhal_engine_kv_connector gauge
narwhal_engine_kv_connector{{engine="http://p"}} {kv}
# HELP narwhal_request_duration_seconds Whole-request duration.
# TYPE narwhal_request_duration_seconds histogram
narwhal_request_duration_seconds_bucket{{le="0.1",route="/v1/completions"}} {n}
narwhal_request_duration_seconds_bucket{{le="+Inf",route="/v1/completions"}} {n}
narwhal_request_duration_seconds_count{{route="/v1/completions"}} {n}
narwhal_request_duration_seconds_sum{{route="/v1/completions"}} 0.5
"""


def test_group_metrics_add_counters_and_histograms_and_take_the_minimum_of_ready() -> None:
    text = aggregate([_SNAPSHOT.format(n=3, ready=1, kv=1), _SNAPSHOT.format(n=4, ready=0, kv=2)]).decode()
    assert 'narwhal_requests_total{route="/v1/completions",status="200"} 7.0' in text
    assert 'narwhal_request_duration_seconds_bucket{le="+Inf",route="/v1/completions"} 7.0' in text
    assert 'narwhal_request_duration_seconds_sum{route="/v1/completions"} 1.0' in text
    assert "narwhal_ready 0.0" in text
    assert 'narwhal_engine_kv_connector{engine="http://p"} 2.0' in text
    assert "narwhal_workers_reporting 2.0" in text


def test_the_supervisor_imports_no_adapter() -> None:
    import subprocess
    import sys

    code = ("import sys, narwhal.cli; from narwhal_runtime.supervisor import Supervisor; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('trio', 'narwhal_trio', 'narwhal_asyncio', 'asyncio', 'uvloop')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
