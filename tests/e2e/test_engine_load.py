"""The load engines report, on real sockets: Narwhal scrapes each simulated engine's ``/metrics``.

The simulator serves vLLM's load gauges and ``vllm:cache_config_info``
(docs/simulator.md); Narwhal's own ``/metrics`` then shows each engine's
figures and their age (docs/operate.md, "Engine load"), on both runtimes.
(That a failed scrape is no verdict on the engine's health: tests/core/test_load.py.)
"""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from narwhal_sim.testing import SimThread

from ..harness import RouterThread, make_config
from ..helpers import poll


def gauges(router: RouterThread) -> dict[tuple[str, str, str], float]:
    """Narwhal's engine gauges: (name, engine, phase) -> value."""
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    return {
        (sample.name, sample.labels.get("engine", ""), sample.labels.get("phase", "")): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
        if sample.name.startswith("narwhal_engine_")
    }


def test_every_engine_reports_its_load_and_narwhal_shows_it(tmp_path: Path, runtime: str) -> None:
    with SimThread(role="prefill", speed=0, num_gpu_blocks=512) as prefill, \
            SimThread(role="decode", speed=0) as decode, \
            RouterThread(make_config(tmp_path / "journal.jsonl", prefill=(prefill.url,), decode=(decode.url,),
                                     routing={"metrics_interval_s": 0.05}), runtime) as router:  # fmt: skip
        seen = poll(lambda: (g := gauges(router)).get(("narwhal_engine_reported_kv_usage", decode.url, "decode"))
                    is not None and ("narwhal_engine_reported_kv_usage", prefill.url, "prefill") in g and g,
                    what="both engines' figures")
        for url, phase in ((prefill.url, "prefill"), (decode.url, "decode")):
            assert seen[("narwhal_engine_reported_waiting", url, phase)] == 0
            assert 0 <= seen[("narwhal_engine_reported_kv_usage", url, phase)] <= 1
            assert 0 <= seen[("narwhal_engine_report_age_seconds", url, phase)] < 5
        # The prefill engine's KV capacity: num_gpu_blocks x block_size (16).
        assert seen[("narwhal_engine_reported_kv_capacity_tokens", prefill.url, "prefill")] == 512 * 16
        # Scraped again and again: the figures stay young.
        poll(lambda: gauges(router)[("narwhal_engine_report_age_seconds", prefill.url, "prefill")] < 0.5,
             what="a fresh scrape")

