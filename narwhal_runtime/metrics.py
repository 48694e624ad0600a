"""``/metrics``: the router's counters in the Prometheus text format.

The core keeps plain counters (:class:`narwhal_core.stats.Stats`) and live
gauges (:meth:`narwhal_core.Router.statistics`); this module turns them into
metric families with ``prometheus_client`` at scrape time, so the request
path never touches a metrics library.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from narwhal_core import Router
    from narwhal_core.engine_metrics import EngineLoad
    from narwhal_core.router import RouterStatistics
    from narwhal_core.stats import Histogram, Stats

__all__ = ["render", "render_router"]


def _counter(name: str, doc: str, labels: list[str], counts: Mapping[Any, int]) -> CounterMetricFamily:
    """A counter family from ``counts``: a label value (one label) or a tuple of them -> count, in label order."""
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, n in sorted(counts.items()):
        family.add_metric(list(key) if isinstance(key, tuple) else [key], n)
    return family


def _histogram(
    name: str, doc: str, label: str | list[str], table: Mapping[Any, Histogram]
) -> HistogramMetricFamily:
    """A histogram family from ``table``: a label value (one label) or a tuple of them -> histogram."""
    family = HistogramMetricFamily(name, doc, labels=[label] if isinstance(label, str) else label)
    for key, h in sorted(table.items()):
        cumulative = list(accumulate(h.counts))
        buckets = [(repr(b), c) for b, c in zip(h.bounds, cumulative)]
        buckets.append(("+Inf", cumulative[-1]))
        family.add_metric(list(key) if isinstance(key, tuple) else [key], buckets, h.total)
    return family


def _tenants(stats: Stats) -> Iterator[Metric]:
    """With ``[tenants]``: admission's figures per tenant and band (docs/operate.md, "Tenants")."""
    if not (stats.tenant_admitted or stats.tenant_queued or stats.tenant_rejected):
        return
    labels = ["tenant", "band"]
    yield _counter("narwhal_tenant_admitted", "Requests admitted, by tenant and band.", labels, stats.tenant_admitted)
    yield _counter("narwhal_tenant_queued", "Requests that waited for admission, by tenant and band.", labels,
                   stats.tenant_queued)
    yield _histogram("narwhal_tenant_queue_wait_seconds", "Time a queued request waited, by tenant and band.",
                     labels, stats.tenant_wait_seconds)
    yield _counter("narwhal_tenant_rejected", "Requests admission refused, by tenant, band and reason.",
                   [*labels, "reason"], stats.tenant_rejected)
    yield _counter("narwhal_tenant_prompt_tokens_admitted",
                   "Estimated prompt tokens of the requests admitted, by tenant and band.", labels,
                   stats.tenant_prompt_tokens)


class _RouterCollector:
    def __init__(self, stats: Stats, live: RouterStatistics) -> None:
        self._stats = stats
        self._live = live

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        live = self._live
        requests = CounterMetricFamily(
            "narwhal_requests", "Completion requests by route, terminal and status.",
            labels=["route", "terminal", "status"],
        )
        for (route, terminal, status), n in sorted(stats.requests.items()):
            requests.add_metric([route, terminal, status], n)
        yield requests
        yield _histogram("narwhal_request_duration_seconds", "Whole-request duration.", "route", stats.request_seconds)
        yield _histogram("narwhal_leg_duration_seconds", "Engine leg duration.", "phase", stats.leg_seconds)
        yield _histogram("narwhal_time_to_first_byte_seconds", "Time to the first answer byte.", "route", stats.ttft_seconds)
        yield _counter("narwhal_legs", "Engine legs by phase and outcome.", ["phase", "outcome"], stats.legs)
        yield _counter("narwhal_retries", "Retried legs by phase.", ["phase"], stats.retries)
        yield _counter("narwhal_kv_outcomes", "KV outcomes of prefill legs.", ["outcome", "method"], stats.kv)
        yield _counter("narwhal_journal_records", "Journal records written.", ["kind"], stats.journal_records)
        yield from _tenants(stats)
        yield GaugeMetricFamily("narwhal_inflight_requests", "Requests holding an admission slot.", value=live.inflight)
        yield GaugeMetricFamily("narwhal_queued_requests", "Requests waiting for admission.", value=live.queued)
        yield GaugeMetricFamily("narwhal_open_connections", "Open client connections.", value=live.connections)
        yield GaugeMetricFamily(
            "narwhal_buffered_request_bytes", "Bytes of unfinished requests held (ingress.max_buffered_bytes).",
            value=live.buffered_bytes,
        )
        yield GaugeMetricFamily("narwhal_ready", "1 when /ready answers 200.", value=int(live.ready))
        healthy = GaugeMetricFamily("narwhal_engine_healthy", "1 when the engine is in rotation.", labels=["engine", "phase"])
        outstanding = GaugeMetricFamily("narwhal_engine_outstanding_legs", "Legs running per engine.", labels=["engine", "phase"])
        for (url, phase), ok in sorted(live.engine_healthy.items()):
            healthy.add_metric([url, phase], int(ok))
            outstanding.add_metric([url, phase], live.engine_outstanding[(url, phase)])
        yield healthy
        yield outstanding
        yield from _engine_reports(live.engine_reports)
        yield from _kv_families(stats, live)
        yield _counter(
            "narwhal_no_prefill_engine",
            'Requests answered 503 no_prefill_engine because routing.disaggregation = "required" and no prefill '
            "engine could take their prefill leg, by reason: none_in_fleet or none_healthy.",
            ["reason"], stats.prefill_refusals,
        )


def _kv_families(stats: Stats, live: RouterStatistics) -> Iterator[Metric]:
    """The prefill engines' KV handoff: connector version, refused transfer modes, KV-event streams."""
    connector = GaugeMetricFamily(
        "narwhal_engine_kv_connector",
        "NIXL connector version a prefill engine's answers show: 1 (no remote_request_id, vLLM before 0.14: "
        "decode requests carrying its KV are sent the prefill leg's X-Request-Id) or 2.",
        labels=["engine"],
    )
    for url, version in sorted(stats.kv_connector.items()):
        connector.add_metric([url], version)
    yield connector
    yield _counter(
        "narwhal_engine_kv_transfer_mode_refused",
        "Prefill answers refused for a KV transfer_mode Narwhal does not drive (vLLM's push), by engine "
        "and mode: each request failed 502 unsupported_kv_transfer_mode, its KV held until the engine's lease.",
        ["engine", "mode"], stats.kv_modes_refused,
    )
    kv_live = GaugeMetricFamily(
        "narwhal_engine_kv_events_live",
        "1 while a prefill engine is weighed from its own KV events (routing.policy = \"kv\"); 0 while it "
        "falls back to the approximate prefix index (its stream not heard from yet, lost or silent).",
        labels=["engine"],
    )
    for url, trusted in sorted(live.kv_events_live.items()):
        kv_live.add_metric([url], int(trusted))
    yield kv_live


def _engine_reports(reports: Mapping[tuple[str, str], tuple[EngineLoad, float]]) -> Iterator[Metric]:
    """What each engine's own /metrics said last (``routing.metrics_interval_s``), and how old that is."""
    labels = ["engine", "phase"]
    waiting = GaugeMetricFamily("narwhal_engine_reported_waiting", "Requests waiting, as the engine reported.", labels=labels)
    running = GaugeMetricFamily("narwhal_engine_reported_running", "Requests running, as the engine reported.", labels=labels)
    usage = GaugeMetricFamily("narwhal_engine_reported_kv_usage", "KV cache in use (0 to 1), as the engine reported.",
                              labels=labels)
    capacity = GaugeMetricFamily("narwhal_engine_reported_kv_capacity_tokens",
                                 "Tokens of KV cache the engine holds, as it reported (vllm:cache_config_info).",
                                 labels=labels)
    age = GaugeMetricFamily("narwhal_engine_report_age_seconds", "Seconds since the engine's figures arrived.",
                            labels=labels)
    for key, (load, seconds) in sorted(reports.items()):
        figures = ((waiting, load.waiting), (running, load.running), (usage, load.kv_usage),
                   (capacity, load.kv_capacity_tokens))
        for family, value in figures:
            if value is not None:
                family.add_metric(list(key), value)
        age.add_metric(list(key), seconds)
    yield from (waiting, running, usage, capacity, age)


def render(stats: Stats, live: RouterStatistics) -> bytes:
    """The Prometheus text exposition of a router's counters ``stats`` and its live gauges ``live``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RouterCollector(stats, live))
    return generate_latest(registry)


def render_router(router: Router) -> bytes:
    """:func:`render` of ``router``'s figures now."""
    return render(router.stats, router.statistics())
