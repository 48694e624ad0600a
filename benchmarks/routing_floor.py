"""What no router can beat on the routing benchmark's workloads: the TTFT floor and the goodput ceiling.

    python benchmarks/routing_floor.py                         # trace 0.5x, 0.75x; sessions 1.5x, 2.25x (~1 min)
    python benchmarks/routing_floor.py --against results/routing_4P2D_misscost.json

A request's time to first token is at least what it takes **alone on an idle
fleet, with every block any earlier request computed still cached**: no
queue to wait in, and no cache can hold more than everything computed
before. This script measures that in the virtual fleet (docs/bench.md, "The
virtual fleet"; the simulator's engine model, nothing sleeps): each
workload of ``routing_bench.py`` (the same trace window, the same session
generator, the same requests at each rate), its arrivals spread
``--spread`` times further apart so that no two requests ever overlap, on
one prefill and one decode engine whose KV pool never fills. The TTFT
percentiles of that run are floors for any placement on any fleet of these
engines: a prompt's prefill runs on one engine, at that engine's speed.
Its count of requests within the SLO is a ceiling on any run's count of
good requests (goodput is that count over the run's duration, which the
same requests at the same rate make nearly equal between routers: the
ceiling on a goodput ratio is the ceiling count over the other's count).

With ``--pool-blocks N`` the engine's pool holds N blocks, least recently
used out once it is full: with N the prefill KV of a whole fleet, a
reference for a given KV pressure (no queue, the fleet's KV as one LRU
cache), not a floor (a cache can keep more than LRU does).

With ``--against FILE`` (a ``routing_bench.py`` or ``kv_routing_bench.py``
results JSON), each row also gives, per target in that file at the same
workload and rate: the best TTFT p90 ratio any router could reach against
it (floor / its p90) and the best goodput ratio (ceiling / its goodput).
A target ratio below the first, or above the second, cannot be met.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from routing_bench import SESSIONS, TRACE, trace_window, workload_requests  # noqa: E402

#: The engine's block size (docs/simulator.md, "The KV block pool").
BLOCK_TOKENS = 16


def workload_flags(workload: str, window: Path) -> list[str]:
    if workload == "trace":
        return ["--trace", str(window)]
    flags = ["--generate"]
    for field in ("sessions", "turns", "system_prompts", "system_tokens", "user_tokens", "output_tokens",
                  "session_rate", "think_s", "seed"):  # fmt: skip
        flags += ["--" + field.replace("_", "-"), str(getattr(SESSIONS, field))]
    return flags


def floor(workload: str, rate: float, window: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The lone, unbounded replay of ``workload`` at ``rate`` (the same requests as a real run at that rate)."""
    config = work / "router.toml"
    config.write_text('[model]\nname = "meta-llama/Llama-3.1-8B-Instruct"\n'
                      '[engine]\nprefill = ["http://127.0.0.1:1"]\ndecode = ["http://127.0.0.1:2"]\n')  # fmt: skip
    summary = work / f"{workload}-{rate}.json"
    # A pool holding every block the requests compute, and then some: nothing is ever evicted.
    requests = workload_requests(workload, window, rate, argparse.Namespace(
        speed=1.0, duration=args.duration, max_requests=args.max_requests))
    blocks = sum(r.input_length + r.output_length for r in requests) // BLOCK_TOKENS + 64 * len(requests) + 1024
    if args.pool_blocks:
        blocks = args.pool_blocks  # the fleet's prefill KV as one pool: least recently used out once it is full
    cmd = [sys.executable, "-m", "narwhal", "bench", *workload_flags(workload, window),
           "--request-rate-scale", repr(rate / args.spread), "--duration", repr(args.duration * args.spread),
           "--max-requests", str(args.max_requests), "--virtual", "--fleet", "1P1D",
           "--engine-option", f"num_gpu_blocks={blocks}", "--router-config", str(config),
           "--slo-ttft-ms", repr(args.slo_ttft_ms), "--slo-itl-ms", repr(args.slo_itl_ms),
           "--no-progress", "--summary-json", str(summary)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"routing_floor: narwhal bench failed: {done.stdout[-500:]}{done.stderr[-500:]}")
    s = json.loads(summary.read_text())
    return {
        "workload": workload, "rate": rate, "requests": s["requests"], "completed": s["completed"],
        "ttft_p50_ms": 1000 * s["ttft_p50_s"], "ttft_p90_ms": 1000 * s["ttft_p90_s"],
        "ttft_p99_ms": 1000 * s["ttft_p99_s"], "good": s["good"],
    }  # fmt: skip


def against(path: Path, pressure: str | None = None) -> list[dict[str, Any]]:
    """The measured runs of a routing_bench / kv_routing_bench results file: target, workload, rate, p90, goodput.

    ``pressure``: only the runs at that KV pressure (``kv_routing_bench.py``'s ``high`` or ``low``).
    """
    runs = [r for r in json.loads(path.read_text())["runs"] if pressure is None or r.get("pressure") == pressure]
    return [
        {"target": r["target"] + (f" ({r['pressure']} pressure)" if r.get("pressure") else ""),
         "workload": r["workload"], "rate_scale": r["rate_scale"], "ttft_p90_ms": r["ttft_ms"]["p90"],
         "good": r["good"]}
        for r in runs if not r.get("error") and r.get("ttft_ms")
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="routing_floor.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--rates", default="0.5,0.75", help="trace rates, multiples of the window's own rate")
    p.add_argument("--session-rates", default="1.5,2.25", help="sessions rates")
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--trace-offset", type=int, default=3000)
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals of the real run")
    p.add_argument("--max-requests", type=int, default=400)
    p.add_argument("--spread", type=float, default=1000.0, help="arrivals this many times further apart")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=100.0)
    p.add_argument("--pool-blocks", type=int, default=0,
                   help="the engine's KV pool in blocks (0: never full); the prefill pool of a whole fleet makes a "
                        "reference for a given KV pressure, not a floor")  # fmt: skip
    p.add_argument("--pressure", default=None, help="with --against: only that file's runs at this KV pressure")
    p.add_argument("--against", type=Path, default=None, help="a results JSON whose targets to set beside the floor")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="routing_floor-"))
    window = trace_window(args, work)
    plan = [("trace", float(r)) for r in args.rates.split(",") if r]
    plan += [("sessions", float(r)) for r in args.session_rates.split(",") if r]
    rows = [floor(workload, rate, window, args, work) for workload, rate in plan]
    measured = against(args.against, args.pressure) if args.against else []
    for row in rows:
        row["against"] = [
            {"target": m["target"], "ttft_p90_ms": m["ttft_p90_ms"], "good": m["good"],
             "best_p90_ratio": row["ttft_p90_ms"] / m["ttft_p90_ms"] if m["ttft_p90_ms"] else None,
             "best_goodput_ratio": row["good"] / m["good"] if m["good"] else None}
            for m in measured
            if m.get("workload") == row["workload"] and abs(float(m.get("rate_scale", -1)) - row["rate"]) < 1e-9
        ]  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    pool = f"a KV pool of {args.pool_blocks} blocks" if args.pool_blocks else "nothing evicted"
    print(f"Alone on an idle 1P1D fleet, {pool}, arrivals {args.spread:g}x apart; SLO TTFT <= "
          f"{args.slo_ttft_ms:g} ms and ITL <= {args.slo_itl_ms:g} ms")  # fmt: skip
    print(f"{'workload':<9} {'rate':>5} {'done':>9} {'TTFT p50 / p90 / p99 floor (ms)':>32}  {'good (ceiling)':>14}")
    for row in rows:
        print(f"{row['workload']:<9} {row['rate']:>5g} {row['completed']:>4}/{row['requests']:<4} "
              f"{row['ttft_p50_ms']:>10.0f} / {row['ttft_p90_ms']:>6.0f} / {row['ttft_p99_ms']:>6.0f} "
              f"{row['good']:>14}")  # fmt: skip
        for a in row["against"]:
            p90 = f"{a['best_p90_ratio']:.2f}x" if a["best_p90_ratio"] is not None else "-"
            good = f"{a['best_goodput_ratio']:.2f}x" if a["best_goodput_ratio"] is not None else "-"
            print(f"    against {a['target']:<28} (p90 {a['ttft_p90_ms']:.0f} ms, {a['good']} good): "
                  f"best TTFT p90 ratio {p90}, best goodput ratio {good}")  # fmt: skip
    print(f"Work directory: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
