"""The TTFT floor and goodput ceiling of the routing benchmark's workloads (benchmarks/routing_floor.py).

The floor is each request alone on an idle engine that never evicts: the
same requests replayed closer together, on the same engine, can only take
as long or longer, and no more of them can meet the SLO.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import load_benchmark

routing_floor = load_benchmark("routing_floor")


def settings(spread: float, pool_blocks: int = 0) -> argparse.Namespace:
    return argparse.Namespace(
        trace=routing_floor.TRACE, trace_offset=3000, duration=12.0, max_requests=16, spread=spread,
        slo_ttft_ms=2000.0, slo_itl_ms=100.0, pool_blocks=pool_blocks,
    )  # fmt: skip


def test_the_floor_is_no_slower_than_the_same_requests_in_a_crowd(tmp_path: Path) -> None:
    window = routing_floor.trace_window(settings(1000.0), tmp_path)
    alone = routing_floor.floor("trace", 0.5, window, settings(1000.0), tmp_path)
    crowd = routing_floor.floor("trace", 0.5, window, settings(1.0 / 40), tmp_path)  # the same requests, 40x closer
    assert alone["requests"] == crowd["requests"] == 16
    assert crowd["ttft_p90_ms"] > alone["ttft_p90_ms"] > 0
    assert crowd["ttft_p50_ms"] > alone["ttft_p50_ms"]
    assert crowd["good"] <= alone["good"]


def test_a_bounded_pool_evicts_what_later_requests_would_have_hit(tmp_path: Path) -> None:
    # 16 requests of 25k blocks in all, the longest 3.5k: a 4,000-block pool cannot keep what they share.
    window = routing_floor.trace_window(settings(1000.0), tmp_path)
    unbounded = routing_floor.floor("trace", 0.5, window, settings(1000.0), tmp_path)
    bounded = routing_floor.floor("trace", 0.5, window, settings(1000.0, pool_blocks=4000), tmp_path)
    assert bounded["completed"] == unbounded["completed"] == 16
    assert bounded["ttft_p50_ms"] > unbounded["ttft_p50_ms"]
    assert bounded["ttft_p90_ms"] >= unbounded["ttft_p90_ms"]


def test_set_beside_a_results_file_it_gives_the_best_ratios_any_router_could_reach(
    tmp_path: Path, capsys, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # (The replay itself is the test above; here it is stood in for, to check the report alone.)
    floors = [{"workload": "trace", "rate": 0.5, "requests": 24, "completed": 24, "ttft_p50_ms": 500.0,
               "ttft_p90_ms": 3000.0, "ttft_p99_ms": 5000.0, "good": 20}]
    monkeypatch.setattr(routing_floor, "floor", lambda workload, rate, *_: dict(floors[0]))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"runs": [
        {"target": "slow", "workload": "trace", "rate_scale": 0.5, "ttft_ms": {"p90": 40_000.0}, "good": 2},
        {"target": "other-rate", "workload": "trace", "rate_scale": 0.75, "ttft_ms": {"p90": 1.0}, "good": 1},
        {"target": "broken", "workload": "trace", "rate_scale": 0.5, "error": "did not start"},
        {"target": "slow", "pressure": "low", "workload": "trace", "rate_scale": 0.5, "ttft_ms": {"p90": 9.0},
         "good": 1},
    ]}))
    flags = ["--rates", "0.5", "--session-rates", "", "--duration", "12", "--max-requests", "24",
             "--against", str(results), "--json"]  # fmt: skip
    assert routing_floor.main(flags) == 0
    (row,) = json.loads(capsys.readouterr().out)
    # Only the runs of the same workload and rate, and not the broken one.
    slow, slow_low = row["against"]
    assert (slow["target"], slow_low["target"]) == ("slow", "slow (low pressure)")
    assert slow["best_p90_ratio"] == 3000.0 / 40_000.0
    assert slow["best_goodput_ratio"] == 20 / 2
    assert routing_floor.main([*flags, "--pressure", "low"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert [a["target"] for a in row["against"]] == ["slow (low pressure)"]
