"""``narwhal serve --workers 1`` against ``--workers 2`` in the same run: req/s and CPU per request.

    . .venv/bin/activate
    python benchmarks/workers_bench.py              # 3 rounds x 5 s windows per group (~1 min)
    python benchmarks/workers_bench.py --quick      # 1 round x 2 s windows

It reuses ``router_bench.py``'s machinery (the instant engines, the config,
``wrk`` with its Lua script, the ``/proc`` CPU readings) and starts, all on
127.0.0.1 and none pinned (the point is to let two workers use two cores):

* the two instant engines (``benchmarks/instant_engine.py``);
* two Narwhal groups side by side, ``--workers 1`` and ``--workers 2``
  (trio runtime by default), both idle but for their health probes while
  the other is measured;
* ``wrk`` (one thread) at concurrency ``--concurrency`` (32), the
  non-streaming PD completion of ``router_bench.py``'s ``pd-c32``.

The windows alternate between the groups (1, 2, 2, 1, ...) after a warm-up
window each. Per group: requests/s, p50/p99 latency, the router's CPU per
request (utime + stime of the supervisor and every worker, from
``/proc/<pid>/stat``), the load's CPU per request (wrk and both engines),
the cores the router used, and how busy the whole machine was. Medians over
the rounds.

What a 2-core machine can and cannot show: the load generator and the
engines run on the same two cores as the router, and at concurrency 32
they take a large share of them. ``--workers 2`` can only turn the spare
CPU into throughput; when the router is not the only thing keeping the
cores busy, req/s grows by much less than 2x (or not at all, once the
machine is saturated), and the figure to read is CPU per request (what a
second worker costs: supervisor, a second router's probes, cross-core
scheduling) and whether the router's share of the cores went up. Scaling
with the number of workers needs more cores than workers plus load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_bench as rb  # noqa: E402 - the shared machinery, next to this file

__all__ = ["main"]


def _group_pids(proc: rb.Proc, workers: int, timeout: float = 30.0) -> list[int]:
    """The supervisor's and its workers' pids, from the group's ``listening`` line (one process: itself)."""
    if workers == 1:
        return [proc.pid]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "listening" and "pids" in event:
                return [proc.pid, *event["pids"]]
        time.sleep(0.1)
    raise SystemExit(f"workers_bench: no listening line from the {workers}-worker group: {proc.tail()}")


def _start_group(workers: int, runtime: str, work: Path, engines: dict[str, dict[str, Any]]) -> tuple[rb.Target, list[int]]:  # fmt: skip
    name = f"narwhal-w{workers}"
    port = rb.free_port()
    config = work / f"{name}.toml"
    rb.narwhal_config(config, port, engines["prefill"]["url"], engines["decode"]["url"], work / f"{name}.jsonl")
    env = {**os.environ, "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "narwhal.cli", "serve", "--config", str(config), "--runtime", runtime,
           "--workers", str(workers)]  # fmt: skip
    target = rb.Target(name)
    target.url = f"http://127.0.0.1:{port}"
    target.proc = rb.Proc(name, cmd, None, work, env=env)
    rb.wait_ready(target, 60.0)
    if target.error is not None:
        raise SystemExit(f"workers_bench: {name}: {target.error}")
    return target, _group_pids(target.proc, workers)


def _window(url: str, pids: list[int], engine_pids: list[int], body: Path, concurrency: int,
            seconds: float) -> dict[str, float]:  # fmt: skip
    cores = list(range(os.cpu_count() or 1))
    router0 = sum(rb.cpu_seconds(p) for p in pids)
    engines0 = sum(rb.cpu_seconds(p) for p in engine_pids)
    busy0 = rb.core_busy(cores)  # type: ignore[arg-type]
    start = time.monotonic()
    result = rb.run_wrk(url, body, concurrency, seconds, None)
    wall = time.monotonic() - start
    busy1 = rb.core_busy(cores)  # type: ignore[arg-type]
    router = sum(rb.cpu_seconds(p) for p in pids) - router0
    load = sum(rb.cpu_seconds(p) for p in engine_pids) - engines0 + result["wrk_cpu_s"]
    n = result["requests"]
    return {
        "rps": n / (result["duration_us"] / 1e6) if result["duration_us"] else 0.0,
        "p50_us": result["latency_us"]["p50"],
        "p99_us": result["latency_us"]["p99"],
        "router_us_per_req": 1e6 * router / n if n else float("nan"),
        "load_us_per_req": 1e6 * load / n if n else float("nan"),
        "router_cores": router / wall,
        "machine_busy_pct": 100.0 * sum(busy1[c] - busy0[c] for c in cores) / (wall * len(cores)),
        "errors": float(sum(result["errors"].values())),
    }


def _table(results: dict[int, list[dict[str, float]]], args: argparse.Namespace) -> list[str]:
    lines = [
        f"workers_bench: {args.runtime}, wrk -t1 c={args.concurrency}, {args.rounds} round(s) x {args.duration:.0f} s, "
        f"{os.cpu_count()} cores shared by load, engines and router (none pinned)",
        "",
        "| workers | req/s | p50 ms | p99 ms | router CPU µs/req | load CPU µs/req | router cores | machine busy | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workers, runs in results.items():
        m = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        lines.append(
            f"| {workers} | {m['rps']:.0f} | {m['p50_us'] / 1e3:.2f} | {m['p99_us'] / 1e3:.2f} | "
            f"{m['router_us_per_req']:.0f} | {m['load_us_per_req']:.0f} | {m['router_cores']:.2f} | "
            f"{m['machine_busy_pct']:.0f} % | {sum(r['errors'] for r in runs):.0f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runtime", choices=("trio", "asyncio"), default="trio")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per window")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s windows")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.warmup = 1, 2.0, 1.0
    work = Path(tempfile.mkdtemp(prefix="workers-bench-"))
    stream, _, max_tokens, _ = rb.SCENARIOS["pd-c32"]
    body = work / "body.json"
    body.write_text(json.dumps({"model": rb.MODEL, "prompt": rb.PROMPT, "max_tokens": max_tokens,
                                "temperature": 0.7, "top_p": 0.95, "user": "bench"}))  # fmt: skip
    try:
        engines: dict[str, dict[str, Any]] = {}
        engine_pids = []
        for role in ("prefill", "decode"):
            proc, engines[role] = rb.start_engine("instant", role, None, work)
            engine_pids.append(proc.pid)
        groups = {n: _start_group(n, args.runtime, work, engines) for n in (1, 2)}
        for target, _ in groups.values():
            rb.run_wrk(target.url, body, args.concurrency, args.warmup, None)
        results: dict[int, list[dict[str, float]]] = {1: [], 2: []}
        for round_ in range(args.rounds):
            for n in ((1, 2) if round_ % 2 == 0 else (2, 1)):
                target, pids = groups[n]
                results[n].append(_window(target.url, pids, engine_pids, body, args.concurrency, args.duration))
                rb.log(f"round {round_ + 1}, workers {n}: {results[n][-1]['rps']:.0f} req/s")
        print("\n".join(_table(results, args)))
        (work / "results.json").write_text(json.dumps(results, indent=1))
        rb.log(f"work directory {work}")
    finally:
        rb.Proc.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
