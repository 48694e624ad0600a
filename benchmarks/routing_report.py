"""The routing benchmark's report: the markdown table, the targets at the knee, the TTFT CDF plot.

Pure but for the plot file: rows in (the dicts ``routing_bench.py`` builds per
run, every figure in simulated time), text out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["markdown", "verdict", "plot", "cpu_per_request"]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f} %"


def _n(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: one line per target and rate; refused or failed runs say why."""
    head = ("| workload | rate | target | ok / sent | TTFT p50 / p90 / p99 (ms) | ITL p99 (ms) | goodput (req/s) "
            "| prefix hit rate | bound | hit / bound | requests per engine | max prompt share | router CPU / req (ms) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        where = f"| {r['workload']} | {r['rate']} ({r['rate_scale']:g}x) | {r['target']} |"
        if "error" in r:
            out.append(f"{where} {r['error'][:120].replace('|', '/')} |" + " |" * 9)
            continue
        t = r["ttft_ms"]
        per = " ".join(f"{k}:{v}" for k, v in r["requests_per_engine"].items())
        out.append(f"{where} {r['completed']} / {r['requests']} | {_n(t['p50'])} / {_n(t['p90'])} / {_n(t['p99'])} "
                   f"| {_n(r['itl_p99_ms'], '.1f')} | {r['goodput']:.3f} ({r['good']}) | {_pct(r['hit_rate'])} "
                   f"| {_pct(r['bound']['rate'])} | {_n(r['hit_over_bound'], '.2f')} | {per} "
                   f"| {_n(r['max_share'], '.2f')} | {_n(cpu_per_request(r), '.2f')} |")  # fmt: skip
    return "\n".join(out)


def verdict(rows: list[dict[str, Any]], rate_name: str, workload: str = "trace") -> str:
    """The targets at the knee: Narwhal's best configuration against vLLM Router's best PD policy
    (best: the highest goodput; ``kv_aware`` is not among them), the hit rate against its bound, the
    largest prompt share."""
    done = [r for r in rows if r["rate"] == rate_name and r["workload"] == workload and "error" not in r]
    best = {}
    for side in ("narwhal", "vllm-pd-"):
        mine = [r for r in done if r["target"].startswith(side)]
        if mine:
            best[side] = max(mine, key=lambda r: (r["goodput"], -(r["ttft_ms"]["p90"] or 1e12)))
    if len(best) < 2:
        return f"{workload}: targets not measured (need a Narwhal and a vLLM Router run at the knee)"
    n, v = best["narwhal"], best["vllm-pd-"]
    p90 = (n["ttft_ms"]["p90"] or 0) / (v["ttft_ms"]["p90"] or float("inf"))
    good = n["goodput"] / v["goodput"] if v["goodput"] else float("inf")
    lines = [f"{workload}, targets at the knee, {n['target']} against {v['target']}:",
             f"  TTFT p90 {_n(n['ttft_ms']['p90'])} / {_n(v['ttft_ms']['p90'])} ms = {p90:.2f}x (target <= 0.5x): "
             f"{'MET' if p90 <= 0.5 else 'NOT MET'}",
             f"  goodput {n['goodput']:.3f} / {v['goodput']:.3f} req/s = {good:.2f}x (target >= 1.3x): "
             f"{'MET' if good >= 1.3 else 'NOT MET'}"]  # fmt: skip
    for r in (n, v):
        ratio, share = r["hit_over_bound"], r["max_share"]
        lines.append(f"  {r['target']}: hit rate {_pct(r['hit_rate'])} = {_n(ratio, '.2f')} of the bound "
                     f"{_pct(r['bound']['rate'])} (target >= 0.85: {'MET' if (ratio or 0) >= 0.85 else 'NOT MET'}), "
                     f"largest prompt share {_n(share, '.2f')} (target <= 1.5: "
                     f"{'MET' if share is not None and share <= 1.5 else 'NOT MET'})")  # fmt: skip
    return "\n".join(lines)


def cpu_per_request(row: dict[str, Any]) -> float | None:
    """The router process's CPU (wall-clock ms, not scaled) per request sent, during the replay."""
    cpu = row.get("router_cpu_s")
    return cpu * 1000 / row["requests"] if cpu is not None and row.get("requests") else None


def plot(rows: list[dict[str, Any]], path: Path, rate_name: str) -> str:
    """TTFT CDF per target at one rate (the trace workload); what was written, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed"
    chosen = [r for r in rows if r["rate"] == rate_name and r["workload"] == "trace" and r.get("ttft_s_sim")]
    if not chosen:
        return "no plot: no run at the knee rate"
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in chosen:
        xs = r["ttft_s_sim"]
        ys = [(i + 1) / r["requests"] for i in range(len(xs))]  # failed requests never reach 1
        ax.step(xs, ys, where="post", label=r["target"], linestyle="-" if r["target"].startswith("narwhal") else "--")
    ax.axvline(chosen[0].get("slo_ttft_s", 2.0), color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT, simulated seconds (log)")
    ax.set_ylabel("fraction of requests sent")
    ax.set_title(f"TTFT CDF at the knee ({chosen[0]['rate_scale']:g}x the trace's rate)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"
