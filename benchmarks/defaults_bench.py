"""Which ``[routing]`` defaults win: the routing bench's workloads through the virtual fleet.

    python benchmarks/defaults_bench.py                    # 3 configurations x (3 trace + 3 session rates), ~3 min
    python benchmarks/defaults_bench.py --configs least_loaded/always,prefix/always --json out.json
    python benchmarks/defaults_bench.py --configs least_loaded/always,prefix/always --windows 8   # means of 8 windows

Each configuration (``policy/mode``) replays the workloads of
``routing_bench.py`` — the shared Mooncake trace from its request 3,000 on
at 0.2x, 0.5x and 0.75x its rate (light, knee, past the knee), and the
multi-turn session generator at 0.75x, 1.5x and 2.25x — through Narwhal's
router core in front of the simulator's engine cores on one virtual clock
(docs/bench.md, "The virtual fleet"): 4 prefill and 2 decode engines of
28,000 blocks of 16 tokens, the first 120 s of arrivals (at most 400
requests). Nothing sleeps and nothing depends on how busy the machine is:
the same command gives the same figures.

Per row: TTFT p50 / p90, goodput (requests within TTFT <= 2 s and a mean
gap <= 100 ms, per second of the run), the prefix hit rate (prompt tokens
the engines computing prompts found cached) and the largest **prefill
share**: an engine's computed prompt tokens over the mean of the engines
that compute prompts (the prefill pool under ``mode = "always"``, every
engine otherwise), as ``routing_bench.py`` counts it, and what that
busiest engine computed (millions of prompt tokens): a policy that hits
its caches more computes less in all, so its share of a smaller mean can
be higher while its busiest engine does less.

One window's figures swing with small changes of routing (a tie broken
the other way puts a prefix on another engine, and the run goes on from
there): ``--windows N`` replays N windows per workload and rate — the
trace from request ``--trace-offset`` - 200 i on, the sessions with seed i,
for i = 0 .. N-1 — and prints each configuration's mean over them, and in
how many windows each figure is worse than the first configuration's.

The virtual engines serve no ``/metrics``, so each configuration sets
``routing.kv_capacity_tokens = 448000``: what ``narwhal serve`` learns from
such engines' ``vllm:cache_config_info`` (28,000 x 16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import attrs  # noqa: E402
from routing_bench import SESSIONS, TRACE  # noqa: E402
from routing_bound import share_of_mean  # noqa: E402

from narwhal_bench.client import Target  # noqa: E402
from narwhal_bench.stats import summarize  # noqa: E402
from narwhal_bench.trace import PromptSynth, generate_sessions, limit, parse_mooncake_lines, scale_arrivals  # noqa: E402
from narwhal_bench.virtual import VirtualFleet  # noqa: E402
from narwhal_core.config import parse_config  # noqa: E402

CONFIGS = ("least_loaded/always", "prefix/always", "prefix/auto")
TRACE_RATES = (("light", 0.2), ("knee", 0.5), ("past", 0.75))
SESSION_RATES = (("light", 0.75), ("knee", 1.5), ("past", 2.25))
BLOCKS = 28_000


def workload(name: str, rate: float, args: argparse.Namespace, window: int = 0) -> list[Any]:
    """The requests ``routing_bench.py`` sends for ``name`` at ``rate``, in unscaled (simulated) time.

    ``window`` i > 0: the trace from 200 i requests earlier, the sessions of seed i.
    """
    if name == "trace":
        lines = [line for line in Path(args.trace).read_text().splitlines() if line.strip()]
        lines.sort(key=lambda line: json.loads(line)["timestamp"])
        base = parse_mooncake_lines(lines[max(0, args.trace_offset - 200 * window) :], source=args.trace)
    else:
        base = generate_sessions(attrs.evolve(SESSIONS, seed=SESSIONS.seed + window))
    scaled = scale_arrivals(base, time_scale=1.0, rate_scale=rate)
    return limit(scaled, max_requests=args.max_requests, duration_s=args.duration)


def run(config: str, requests: list[Any]) -> dict[str, Any]:
    """One replay of ``requests`` under ``policy/mode``; its figures."""
    policy, mode = config.split("/")
    router = parse_config(
        '[model]\nname = "meta-llama/Llama-3.1-8B-Instruct"\n[ingress]\nlisten = "127.0.0.1:0"\n'
        '[engine]\nprefill = ["http://p:1"]\ndecode = ["http://d:1"]\n[journal]\npath = "-"\n'
        f'[routing]\npolicy = "{policy}"\nmode = "{mode}"\nkv_capacity_tokens = {BLOCKS * 16}\n',
        env={},
    )
    fleet = VirtualFleet(fleet="4P2D", engine_options=[f"num_gpu_blocks={BLOCKS}"], config=router)
    wall = time.perf_counter()
    outcome = fleet.run(requests, Target(base_url="http://virtual"), synth=PromptSynth(seed=0))
    wall = time.perf_counter() - wall
    summary = summarize(outcome.results, slo_ttft_s=2.0, slo_itl_s=0.1)
    metrics = {url: node.core.metrics() for url, node in fleet.engines.items()}
    pool = [url for url, node in fleet.engines.items() if mode != "always" or node.role == "prefill"]
    computed = {url: metrics[url].prompt_tokens_computed for url in pool}
    shares = share_of_mean(computed)
    queried = sum(metrics[url].prefix_cache_queries for url in pool if fleet.engines[url].role == "prefill")
    hits = sum(metrics[url].prefix_cache_hits for url in pool if fleet.engines[url].role == "prefill")
    ms = lambda v: None if v is None else round(v * 1000)  # noqa: E731
    return {
        "config": config, "requests": summary.requests, "completed": summary.completed,
        "ttft_p50_ms": ms(summary.ttft_p50_s), "ttft_p90_ms": ms(summary.ttft_p90_s),
        "goodput": round(summary.goodput, 3),
        "prefill_hit_rate": round(hits / queried, 3) if queried else None,
        "max_share": round(max((v for v in shares.values() if v is not None), default=0.0), 2),
        "busiest_computed_tokens": max(computed.values(), default=0),
        "wall_s": round(wall, 1),
    }  # fmt: skip


def _row(row: dict[str, Any]) -> str:
    hit = "-" if row["prefill_hit_rate"] is None else f"{100 * row['prefill_hit_rate']:.1f} %"
    return (f"| {row['workload']} | {row['rate']} | {row['config']} | {row['completed']} / {row['requests']} "
            f"| {row['ttft_p50_ms']} / {row['ttft_p90_ms']} | {row['goodput']:.3f} | {hit} "
            f"| {row['max_share']:.2f} | {row['busiest_computed_tokens'] / 1e6:.2f} |")  # fmt: skip


def _mean_row(cell: list[dict[str, Any]], config: str, first: str) -> str:
    """One configuration's mean over a cell's windows, and in how many windows it is worse than ``first``."""
    mine = [r for r in cell if r["config"] == config]
    theirs = {r["window"]: r for r in cell if r["config"] == first}
    mean = lambda key: statistics.fmean(r[key] or 0 for r in mine)  # noqa: E731
    worse = [
        sum(1 for r in mine if (r[key] or 0) * sign > (theirs[r["window"]][key] or 0) * sign)
        for key, sign in (("ttft_p50_ms", 1), ("ttft_p90_ms", 1), ("goodput", -1), ("max_share", 1))
    ]
    row = mine[0]
    return (f"| {row['workload']} | {row['rate']} | {config} | {len(mine)} "
            f"| {mean('ttft_p50_ms'):.0f} / {mean('ttft_p90_ms'):.0f} | {mean('goodput'):.3f} "
            f"| {100 * mean('prefill_hit_rate'):.1f} % | {mean('max_share'):.3f} "
            f"| {mean('busiest_computed_tokens') / 1e6:.2f} | {' / '.join(map(str, worse))} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated policy/mode")
    p.add_argument("--workloads", default="trace,sessions")
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--trace-offset", type=int, default=3000)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run")
    p.add_argument("--max-requests", type=int, default=400)
    p.add_argument("--windows", type=int, default=1, help="windows per workload and rate (means printed)")
    p.add_argument("--json", default=None, help="write every row here")
    args = p.parse_args()
    rows = []
    if args.windows > 1:
        print("| workload | rate | policy / mode | windows | TTFT p50 / p90 (ms) | goodput (req/s) "
              "| prefill hit rate | max prefill share | busiest engine (M tokens) "
              "| windows worse than the first (p50 / p90 / goodput / share) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("| workload | rate | policy / mode | ok / sent | TTFT p50 / p90 (ms) | goodput (req/s) "
              "| prefill hit rate | max prefill share | busiest engine (M tokens) |")
        print("|---|---|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        for rate_name, rate in TRACE_RATES if name == "trace" else SESSION_RATES:
            cell = []
            for window in range(args.windows):
                requests = workload(name, rate, args, window)
                for config in args.configs.split(","):
                    row = {"workload": name, "rate": f"{rate_name} ({rate}x)", "window": window,
                           **run(config, requests)}  # fmt: skip
                    rows.append(row)
                    cell.append(row)
                    if args.windows == 1:
                        print(_row(row), flush=True)
            if args.windows > 1:
                for config in args.configs.split(","):
                    print(_mean_row(cell, config, args.configs.split(",")[0]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
