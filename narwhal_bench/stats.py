"""Results of a replay: per-request records, the summary, goodput, engines' prefix hit rate.

Pure: values in, values out (reading and writing result files is left to
the caller, except :func:`read_results`, which only parses lines).

Definitions (``docs/bench.md``):

* TTFT: from sending the request to the first streamed token (the first
  event carrying text); ITL: the gap between two consecutive tokens, pooled
  over all requests (tokens arriving in the same read have gaps of 0);
  TPOT of a request: (end-to-end − TTFT) / (output tokens − 1).
* A request is *good* when it succeeded, its TTFT is within the TTFT SLO and
  its TPOT within the ITL SLO (a missing SLO always holds). Goodput = good
  requests per second of the run; throughput = completed requests (and
  output tokens) per second of the run. The run lasts from the first send
  to the last answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import orjson

__all__ = [
    "RequestResult",
    "Summary",
    "percentile",
    "summarize",
    "format_summary",
    "parse_prometheus",
    "HitRate",
    "prefix_hit_rate",
    "read_results",
]


@attrs.define(kw_only=True)
class RequestResult:
    """What happened to one request (one JSON line of ``--output``)."""

    index: int
    #: Scheduled send time, seconds from the start of the run.
    scheduled_s: float
    #: Actual send time (later than scheduled when the concurrency cap held it back).
    sent_s: float = 0.0
    input_length: int = 0
    output_length: int = 0
    #: HTTP status (0: no answer at all).
    status: int = 0
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    #: Output tokens received.
    output_tokens: int = 0
    #: Gaps between consecutive tokens, seconds.
    itl_s: list[float] = attrs.field(factory=list)
    #: Cached prompt tokens the answer's usage reported, when it did.
    cached_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> bytes:
        return orjson.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RequestResult:
        fields = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


def read_results(lines: Iterable[bytes | str]) -> list[RequestResult]:
    """Parse ``--output`` JSON lines (blank lines skipped)."""
    out = []
    for line in lines:
        if line.strip():
            out.append(RequestResult.from_json(orjson.loads(line)))
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between order statistics; ``None`` if empty."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@attrs.frozen(kw_only=True)
class Summary:
    requests: int
    completed: int
    errors: int
    duration_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    tpot_p50_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    request_throughput: float
    output_throughput: float
    input_throughput: float
    good: int
    goodput: float
    slo_ttft_s: float | None
    slo_itl_s: float | None
    error_kinds: Mapping[str, int] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def is_good(result: RequestResult, slo_ttft_s: float | None, slo_itl_s: float | None) -> bool:
    if not result.ok or result.ttft_s is None:
        return False
    if slo_ttft_s is not None and result.ttft_s > slo_ttft_s:
        return False
    tpot = result.tpot_s
    return slo_itl_s is None or tpot is None or tpot <= slo_itl_s


def summarize(results: Sequence[RequestResult], *, slo_ttft_s: float | None = None,
              slo_itl_s: float | None = None, duration_s: float | None = None) -> Summary:  # fmt: skip
    """The summary of a run; ``duration_s`` defaults to first send to last answer."""
    done = [r for r in results if r.ok]
    if duration_s is None:
        ends = [r.sent_s + r.e2e_s for r in results if r.e2e_s is not None]
        starts = [r.sent_s for r in results]
        duration_s = (max(ends) - min(starts)) if ends and starts else 0.0
    per_s = (1.0 / duration_s) if duration_s > 0 else 0.0
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    itls = [gap for r in done for gap in r.itl_s]
    tpots = [t for r in done if (t := r.tpot_s) is not None]
    e2es = [r.e2e_s for r in done if r.e2e_s is not None]
    good = sum(1 for r in results if is_good(r, slo_ttft_s, slo_itl_s))
    kinds: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error or f"status {r.status}"
            key = key.split(":", 1)[0]
            kinds[key] = kinds.get(key, 0) + 1
    return Summary(
        requests=len(results),
        completed=len(done),
        errors=len(results) - len(done),
        duration_s=duration_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        ttft_mean_s=(sum(ttfts) / len(ttfts)) if ttfts else None,
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        tpot_p50_s=percentile(tpots, 50),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p99_s=percentile(e2es, 99),
        request_throughput=len(done) * per_s,
        output_throughput=sum(r.output_tokens for r in done) * per_s,
        input_throughput=sum(r.input_length for r in done) * per_s,
        good=good,
        goodput=good * per_s,
        slo_ttft_s=slo_ttft_s,
        slo_itl_s=slo_itl_s,
        error_kinds=kinds,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_summary(summary: Summary, *, hit_rate: HitRate | None = None, title: str | None = None) -> str:
    """The summary table, as plain text."""
    s = summary
    slo = []
    if s.slo_ttft_s is not None:
        slo.append(f"TTFT <= {s.slo_ttft_s * 1000:g} ms")
    if s.slo_itl_s is not None:
        slo.append(f"TPOT <= {s.slo_itl_s * 1000:g} ms")
    rows: list[tuple[str, str]] = [
        ("requests (completed / errors)", f"{s.requests} ({s.completed} / {s.errors})"),
        ("duration (s)", f"{s.duration_s:.2f}"),
        ("TTFT p50 / p90 / p99 (ms)", f"{_ms(s.ttft_p50_s)} / {_ms(s.ttft_p90_s)} / {_ms(s.ttft_p99_s)}"),
        ("TTFT mean (ms)", _ms(s.ttft_mean_s)),
        ("ITL p50 / p99 (ms)", f"{_ms(s.itl_p50_s)} / {_ms(s.itl_p99_s)}"),
        ("TPOT p50 (ms)", _ms(s.tpot_p50_s)),
        ("end-to-end p50 / p99 (ms)", f"{_ms(s.e2e_p50_s)} / {_ms(s.e2e_p99_s)}"),
        ("throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("output tokens/s", f"{s.output_throughput:.1f}"),
        ("input tokens/s", f"{s.input_throughput:.0f}"),
        (f"goodput (req/s{', ' + ' and '.join(slo) if slo else ', no SLO'})", f"{s.goodput:.2f} ({s.good} good)"),
    ]
    if s.error_kinds:
        rows.append(("errors by kind", ", ".join(f"{k}: {v}" for k, v in sorted(s.error_kinds.items()))))
    if hit_rate is not None:
        rows.append(("engines' prefix hit rate", hit_rate.describe()))
    width = max(len(k) for k, _ in rows)
    lines = [title] if title else []
    lines.append("-" * (width + 2 + max(len(v) for _, v in rows)))
    lines.extend(f"{k.ljust(width)}  {v}" for k, v in rows)
    return "\n".join(lines)


# --------------------------------------------------------------------------- engine metrics


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition to ``{name: value}``, samples of one name summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, rest = line.rpartition(" ")
        if not head:
            continue
        name = head.split("{", 1)[0].strip()
        try:
            value = float(rest)
        except ValueError:
            # A timestamp after the value: "name{...} value ts".
            parts = line.split()
            try:
                value = float(parts[-2])
            except (ValueError, IndexError):
                continue
            name = parts[0].split("{", 1)[0]
        out[name] = out.get(name, 0.0) + value
    return out


@attrs.frozen(kw_only=True)
class HitRate:
    """Prompt tokens served from the engines' prefix caches over prompt tokens queried."""

    hits: float
    queries: float
    per_engine: Mapping[str, float | None] = attrs.field(factory=dict)
    #: ``queries`` came from ``vllm:prefix_cache_queries_total`` (else: hits + computed prompt tokens).
    exact: bool = True

    @property
    def rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    def describe(self) -> str:
        rate = self.rate
        text = "-" if rate is None else f"{rate * 100:.1f} %"
        text += f" ({self.hits:.0f} of {self.queries:.0f} prompt tokens)"
        if not self.exact:
            text += " [queries estimated as hits + computed tokens]"
        return text


_HITS = "vllm:prefix_cache_hits_total"
_QUERIES = "vllm:prefix_cache_queries_total"
_COMPUTED = "vllm:prompt_tokens_total"


def prefix_hit_rate(before: Mapping[str, Mapping[str, float]],
                    after: Mapping[str, Mapping[str, float]]) -> HitRate:  # fmt: skip
    """Hit rate between two scrapes of each engine (``{url: parse_prometheus(...)}``)."""
    hits = queries = 0.0
    exact = True
    per: dict[str, float | None] = {}
    for url, now in after.items():
        then = before.get(url, {})
        h = now.get(_HITS, 0.0) - then.get(_HITS, 0.0)
        if _QUERIES in now:
            q = now[_QUERIES] - then.get(_QUERIES, 0.0)
        else:
            exact = False
            q = h + now.get(_COMPUTED, 0.0) - then.get(_COMPUTED, 0.0)
        hits += h
        queries += q
        per[url] = h / q if q > 0 else None
    return HitRate(hits=hits, queries=queries, per_engine=per, exact=exact)
