"""Counters and histograms the router keeps for ``/metrics``.

Plain integers and lists, updated from terminal records as they are made,
so the hot path pays a few additions; rendering to the Prometheus text
format happens at scrape time, outside the core.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from typing import Final

import attrs

from .journal import TerminalRecord

__all__ = ["Histogram", "Stats", "LATENCY_BUCKETS"]

#: Bucket upper bounds in seconds, from 1 ms to 10 min.
LATENCY_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)


@attrs.define
class Histogram:
    """Cumulative-at-render histogram: per-bucket counts, a sum and a count."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    #: Observations per bucket; the last slot counts those above every bound.
    counts: list[int] = attrs.field(factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        """Count one observation (seconds)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1


@attrs.define
class Stats:
    """What ``/metrics`` reports beyond the live gauges."""

    #: Completion requests by (route, terminal, status).
    requests: Counter[tuple[str, str, str]] = attrs.field(factory=Counter)
    #: Whole-request durations by route.
    request_seconds: dict[str, Histogram] = attrs.field(factory=dict)
    #: Leg durations by phase.
    leg_seconds: dict[str, Histogram] = attrs.field(factory=dict)
    #: Legs by (phase, outcome).
    legs: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    #: Time to the first answer byte, by route.
    ttft_seconds: dict[str, Histogram] = attrs.field(factory=dict)
    #: Retried legs by phase.
    retries: Counter[str] = attrs.field(factory=Counter)
    #: KV outcomes by (outcome, method).
    kv: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    #: Journal records written, by kind (progress, terminal).
    journal_records: Counter[str] = attrs.field(factory=Counter)
    #: NIXL connector version each prefill engine's answers show, by engine URL: 1 (no
    #: ``remote_request_id``: blocks freed only when the legs' request IDs match) or 2.
    kv_connector: dict[str, int] = attrs.field(factory=dict)
    #: Prefill answers refused for their KV ``transfer_mode`` (vLLM's push), by (engine URL, mode).
    kv_modes_refused: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    #: Requests answered 503 ``no_prefill_engine`` (``routing.disaggregation = "required"``), by reason:
    #: ``none_in_fleet`` or ``none_healthy``.
    prefill_refusals: Counter[str] = attrs.field(factory=Counter)
    #: With ``[tenants]`` (docs/operate.md, "Tenants"), by (tenant, band): requests admitted, requests
    #: queued, the estimated prompt tokens admitted, and the seconds each waited in the queue.
    tenant_admitted: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    tenant_queued: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    tenant_prompt_tokens: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    tenant_wait_seconds: dict[tuple[str, str], Histogram] = attrs.field(factory=dict)
    #: Requests admission refused, by (tenant, band, reason): client_limit, queue_full, queue_timeout.
    tenant_rejected: Counter[tuple[str, str, str]] = attrs.field(factory=Counter)

    def observe(self, record: TerminalRecord) -> None:
        """Account for one terminal record."""
        self.observe_request(record.route, record.terminal, record.status, record.duration_ms, record.ttft_ms)
        for leg in record.legs:
            kv = leg.kv
            self.observe_leg(
                leg.phase, leg.outcome, leg.attempt, leg.duration_ms,
                None if kv is None else (kv.outcome, kv.method),
            )

    def observe_request(
        self, route: str, terminal: str, status: int | None, duration_ms: float, ttft_ms: float | None
    ) -> None:
        """Account for a terminal record's request fields (its legs: :meth:`observe_leg`)."""
        self.requests[(route, terminal, str(status))] += 1
        hists = self.request_seconds
        (hists.get(route) or _new(hists, route)).observe(duration_ms / 1000.0)
        if ttft_ms is not None:
            hists = self.ttft_seconds
            (hists.get(route) or _new(hists, route)).observe(ttft_ms / 1000.0)

    def observe_leg(
        self, phase: str, outcome: str, attempt: int, duration_ms: float, kv: tuple[str, str] | None
    ) -> None:
        """Account for one leg of a terminal record (``kv``: its KV outcome and method)."""
        hists = self.leg_seconds
        (hists.get(phase) or _new(hists, phase)).observe(duration_ms / 1000.0)
        self.legs[(phase, outcome)] += 1
        if attempt > 1:
            self.retries[phase] += 1
        if kv is not None:
            self.kv[kv] += 1


def _new(table: dict[str, Histogram], key: str) -> Histogram:
    h = table[key] = Histogram()
    return h
