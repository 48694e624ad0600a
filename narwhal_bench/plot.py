"""``--plot FILE.png``: TTFT CDFs and goodput of one or several result files side by side.

matplotlib is an optional extra (``pip install 'narwhal[bench]'``), imported
only here and only when a plot is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

from narwhal_bench.stats import RequestResult, summarize

__all__ = ["PlotError", "plot_runs"]


class PlotError(RuntimeError):
    """The plot cannot be drawn (matplotlib missing)."""


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(
            "--plot needs matplotlib: pip install 'narwhal[bench]' (or pip install matplotlib)"
        ) from None
    return plt


def plot_runs(runs: Sequence[tuple[str, Sequence[RequestResult]]], path: str, *,
              slo_ttft_s: float | None = None, slo_itl_s: float | None = None,
              title: str | None = None) -> None:  # fmt: skip
    """Left: each run's TTFT CDF (completed requests). Right: goodput and throughput per run."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels, goodputs, throughputs = [], [], []
    for label, results in runs:
        ttfts = sorted(r.ttft_s for r in results if r.ok and r.ttft_s is not None)
        if ttfts:
            n = len(ttfts)
            left.step(ttfts, [(i + 1) / n for i in range(n)], where="post", label=label)
        summary = summarize(results, slo_ttft_s=slo_ttft_s, slo_itl_s=slo_itl_s)
        labels.append(label)
        goodputs.append(summary.goodput)
        throughputs.append(summary.request_throughput)
    left.set_xlabel("TTFT (s)")
    left.set_ylabel("fraction of requests")
    left.set_title("TTFT CDF")
    left.grid(True, alpha=0.3)
    if slo_ttft_s is not None:
        left.axvline(slo_ttft_s, color="grey", linestyle="--", label=f"TTFT SLO {slo_ttft_s:g} s")
    left.legend(loc="lower right", fontsize="small")
    positions = range(len(labels))
    width = 0.38
    right.bar([p - width / 2 for p in positions], throughputs, width, label="throughput (req/s)", color="#9ab")
    right.bar([p + width / 2 for p in positions], goodputs, width, label="goodput (req/s)", color="#27a")
    right.set_xticks(list(positions), labels, rotation=15, fontsize="small")
    slo = []
    if slo_ttft_s is not None:
        slo.append(f"TTFT ≤ {slo_ttft_s:g} s")
    if slo_itl_s is not None:
        slo.append(f"TPOT ≤ {slo_itl_s * 1000:g} ms")
    right.set_title("goodput" + (f" ({', '.join(slo)})" if slo else " (no SLO)"))
    right.legend(fontsize="small")
    right.grid(True, axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
