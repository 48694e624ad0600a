"""``/metrics`` for a group of workers (``ingress.workers`` > 1; docs/operate.md, "Workers").

The scheme, chosen for having no moving part besides files: the supervisor
makes a private directory and hands it to every worker. Each worker writes
its own exposition (:func:`narwhal_runtime.metrics.render`) there as
``w<K>.prom`` -- replaced atomically, at most once per
:data:`SNAPSHOT_INTERVAL_S` at the end of an event batch, and at once when
it answers ``/metrics``. The worker a scrape lands on answers with every
snapshot in the directory (its own fresh one included) added up: counters,
histograms and most gauges are summed; ``narwhal_ready``,
``narwhal_engine_healthy`` and ``narwhal_engine_kv_events_live`` take the
minimum (1 only when every worker says so); ``narwhal_engine_kv_connector``
the maximum. A gauge ``narwhal_workers_reporting`` counts the snapshots
added up.

A sibling's figures are as of its last snapshot: under traffic at most
:data:`SNAPSHOT_INTERVAL_S` old; an idle worker still ends an event batch
with every health probe, so at most ``health.probe_interval_s`` behind.
A restarted worker starts its counters from 0 (Prometheus' ``rate`` treats
that as a counter reset).

The group is per process and set once, before the router is built
(:func:`join_group`, by the worker's start-up), like :mod:`.log`'s stream.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from .metrics import render, render_router

if TYPE_CHECKING:
    from narwhal_core import Router
    from narwhal_core.router import RouterStatistics
    from narwhal_core.stats import Stats

__all__ = ["GroupMetrics", "join_group", "current_group", "aggregate", "SNAPSHOT_INTERVAL_S"]

#: Longest time between two snapshots of a busy worker.
SNAPSHOT_INTERVAL_S = 1.0
_MINIMUM = frozenset({"narwhal_ready", "narwhal_engine_healthy", "narwhal_engine_kv_events_live"})
_MAXIMUM = frozenset({"narwhal_engine_kv_connector"})

_group: GroupMetrics | None = None


def join_group(directory: str, index: int) -> GroupMetrics:
    """This process is worker ``index`` of a group whose snapshots live in ``directory``."""
    global _group
    _group = GroupMetrics(Path(directory), index)
    return _group


def current_group() -> GroupMetrics | None:
    """The group this process is a worker of, or ``None`` (a single process)."""
    return _group


class GroupMetrics:
    """One worker's side of the group's ``/metrics``: its snapshots, and the sum on a scrape."""

    def __init__(self, directory: Path, index: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.index = index
        self._clock = clock
        self._next = 0.0

    def tick(self, router: Router) -> None:
        """End of an event batch: write a snapshot when the last one is :data:`SNAPSHOT_INTERVAL_S` old."""
        now = self._clock()
        if now >= self._next:
            self._write(render_router(router), now)

    def render(self, stats: Stats, live: RouterStatistics) -> bytes:
        """The group's exposition: this worker's fresh figures plus its siblings' last snapshots."""
        own = render(stats, live)
        self._write(own, self._clock())
        texts = [own.decode("utf-8")]
        for path in sorted(self.directory.glob("w*.prom")):
            if path.name != f"w{self.index}.prom":
                try:
                    texts.append(path.read_text(encoding="utf-8"))
                except OSError:
                    continue  # being replaced, or the group is stopping
        return aggregate(texts)

    def _write(self, text: bytes, now: float) -> None:
        self._next = now + SNAPSHOT_INTERVAL_S
        final = self.directory / f"w{self.index}.prom"
        temporary = final.with_suffix(".tmp")
        try:
            temporary.write_bytes(text)
            os.replace(temporary, final)
        except OSError:
            pass  # the directory went with the supervisor: the scrape still gets this worker's figures


def aggregate(texts: list[str]) -> bytes:
    """The expositions ``texts`` (one per worker) added up, family by family (see the module's docstring)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            table = values[family.name]
            combine = min if family.name in _MINIMUM else max if family.name in _MAXIMUM else _add
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                table[key] = combine(table[key], sample.value) if key in table else sample.value
    reporting = Metric("narwhal_workers_reporting", "Workers whose snapshot this answer adds up.", "gauge")
    reporting.add_sample("narwhal_workers_reporting", {}, float(len(texts)))
    families[reporting.name] = reporting
    for name, table in values.items():
        for (sample_name, labels), value in table.items():
            families[name].add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


def _add(a: float, b: float) -> float:
    return a + b


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
