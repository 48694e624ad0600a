"""The tenants benchmark's machinery, cheaply: a router process, two tenants, every request answered, every field.

``benchmarks/tenants_bench.py`` with a handful of short requests on one
runtime (simulated engines in this process, the router and both tenants'
``narwhal bench`` as processes, as the benchmark runs them). No timing
figure is asserted: the targets live in benchmarks/README.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from narwhal_sim.testing import SimThread

from . import load_benchmark

pytestmark = pytest.mark.timeout(60)

tenants_bench = load_benchmark("tenants_bench")


def test_a_small_run_answers_every_request_and_reports_each_field(tmp_path: Path) -> None:
    engines: list[SimThread] = []

    def start(args: Any, options: dict[str, Any]) -> tuple[list[SimThread], list[SimThread]]:
        engines.extend([SimThread("prefill", speed=10).start(), SimThread("decode", speed=10).start()])
        return engines[:1], engines[1:]

    rc = tenants_bench.main(["--runtimes", "trio", "--modes", "fair", "--short", "3", "--short-every-s", "0.02",
                             "--flood-concurrency", "3", "--flood-requests", "300", "--flood-min", "1024",
                             "--flood-max", "2048", "--max-inflight", "1", "--timeout-s", "20",
                             "--out", str(tmp_path)], engines=start)  # fmt: skip
    assert rc == 0
    report = json.loads((tmp_path / "tenants.json").read_text())
    assert report["spec"]["max_inflight"] == 1 and report["fleet"] == "2P1D"
    assert "[tenants]" in report["router_config"] and 'auth = "trusted_header"' in report["router_config"]
    (cell,) = report["cells"]
    assert (cell["runtime"], cell["admission"]) == ("trio", "fair")
    for phase in ("unloaded", "flood"):
        assert cell[phase]["requests"] == cell[phase]["ok"] == 3 and cell[phase]["errors"] == [], cell
        assert cell[phase]["ttft_p50_ms"] > 0 and cell[phase]["ttft_p90_ms"] >= cell[phase]["ttft_p50_ms"]
    assert cell["p90_ratio"] > 0
    assert cell["router_inflight_mean"] is not None and cell["engine_waiting_mean"] is not None
    # The flood really went through admission: its requests waited in the router's queue and were answered.
    assert cell["flood_queue_wait_mean_ms"] is not None and cell["flood_requests_done"] > 0
    assert cell["short_queue_wait_mean_ms"] is None or cell["short_queue_wait_mean_ms"] >= 0
