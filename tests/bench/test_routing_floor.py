"""The TTFT floor and goodput ceiling of the routing benchmark's workloads (benchmarks/routing_floor.py).

The floor is each request alone on an idle engine that never evicts: the
same requests replayed closer together, on the same engine, can only take
as long or longer, and no more of them can meet the SLO.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "routing_floor.py"
_spec = importlib.util.spec_from_file_location("routing_floor", _PATH)
assert _spec is not None and _spec.loader is not None
routing_floor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(routing_floor)


def settings(spread: float) -> argparse.Namespace:
    return argparse.Namespace(
        trace=routing_floor.TRACE, trace_offset=3000, duration=12.0, max_requests=16, spread=spread,
        slo_ttft_ms=2000.0, slo_itl_ms=100.0,
    )  # fmt: skip


def test_the_floor_is_no_slower_than_the_same_requests_in_a_crowd(tmp_path: Path) -> None:
    window = routing_floor.trace_window(settings(1000.0), tmp_path)
    alone = routing_floor.floor("trace", 0.5, window, settings(1000.0), tmp_path)
    crowd = routing_floor.floor("trace", 0.5, window, settings(1.0 / 40), tmp_path)  # the same requests, 40x closer
    assert alone["requests"] == crowd["requests"] == 16
    assert crowd["ttft_p90_ms"] > alone["ttft_p90_ms"] > 0
    assert crowd["ttft_p50_ms"] > alone["ttft_p50_ms"]
    assert crowd["good"] <= alone["good"]


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
    ]}))
    code = routing_floor.main(["--rates", "0.5", "--session-rates", "", "--duration", "12", "--max-requests", "24",
                               "--against", str(results), "--json"])  # fmt: skip
    assert code == 0
    (row,) = json.loads(capsys.readouterr().out)
    (slow,) = row["against"]  # only the run of the same workload and rate, and not the broken one
    assert slow["target"] == "slow"
    assert slow["best_p90_ratio"] == 3000.0 / 40_000.0
    assert slow["best_goodput_ratio"] == 20 / 2
