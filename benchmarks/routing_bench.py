"""Routing side by side: Narwhal's policies, vLLM Router's PD policies and a plain pool, on one simulated fleet.

One command, bounded in time and count, every listener on 127.0.0.1::

    python benchmarks/routing_bench.py            # the whole matrix (~15 min for the 8 targets that run today)
    python benchmarks/routing_bench.py --quick    # 2 targets, the knee rate, 36 requests (~20 s)

What it starts:

* **the fleet**: ``--prefill`` (4) + ``--decode`` (2) ``narwhal sim`` processes
  with the simulator's Llama-3.1-8B / H100 model (docs/simulator.md: a token
  budget per step shared by prefill and decode, one KV block pool holding
  the prefix cache and the running requests), ``--num-gpu-blocks`` KV blocks
  each (at the knee rate the trace window's prompts hold about twice the
  prefill pool's capacity: the caches evict), prefix caching on, all at
  ``--speed S``;
* **one target at a time**, started afresh for each run (no state carried
  from one run to the next): ``narwhal serve`` with each entry of
  :data:`NARWHAL_CONFIGS` (a ``[routing]`` table; an entry the router
  refuses is reported as refused and skipped), ``vllm-router
  --vllm-pd-disaggregation`` with each policy of :data:`VLLM_PD_POLICIES`,
  and the baseline ``vllm-router`` without PD over all six engines
  (``--worker-urls``, round robin): one pool where every engine runs whole
  requests. The peers come from PyPI into ``benchmarks/.peers-venv``
  (``router_bench.ensure_peers``, the same pinned versions);
* **the load**: ``narwhal bench`` (docs/bench.md) replaying a window of the
  shared Mooncake trace (``--trace``, from request ``--trace-offset``),
  or the built-in session generator (``--workloads sessions``), at each
  arrival rate of ``--rates`` (multiples of the trace's own rate).

**Time.** Engines run S times faster than the modelled GPU and arrivals come
S times faster (``--time-scale 1/S``), so the load is that of the modelled
fleet and every latency is the modelled one divided by S. Every figure this
script prints is in **simulated time**: wall-clock latencies multiplied by
S, goodput per simulated second. The SLO (``--slo-ttft-ms``,
``--slo-itl-ms``) is in simulated time (divided by S for ``narwhal bench``);
the ITL SLO holds for a request's mean gap between tokens (TPOT), as
``narwhal bench`` defines goodput.

Between runs every engine's prefix cache is emptied (vLLM's ``POST
/reset_prefix_cache``) and its counters zeroed (``POST /sim/reset``), and
the script waits until nothing runs or is held. Per run it reports TTFT
p50/p90/p99, ITL p99, goodput, the prefix hit rate against its bound
(``routing_bound.prefix_bound``: one LRU cache of the prefill engines'
total capacity seeing the same requests in order), requests per engine and
each engine's share of computed prompt tokens against the mean.

Writes ``routing.json`` (every figure), ``routing_summary.json`` (the same
without the per-request TTFTs), ``routing.md`` (the tables) and
``ttft_cdf.png`` (TTFT CDF per target at the knee rate) to ``--out`` (default
a new directory under /tmp), with each run's per-request results and logs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from router_bench import Proc, ensure_peers, free_port, http, listening_addresses, log, tree_cpu_seconds  # noqa: E402
from routing_bound import prefix_bound, share_of_mean  # noqa: E402
from routing_report import markdown, plot, verdict  # noqa: E402

from narwhal_bench.stats import read_results, summarize  # noqa: E402
from narwhal_bench.trace import SessionWorkload, generate_sessions, limit, load_mooncake, scale_arrivals  # noqa: E402
from narwhal_sim.testing import SimProcess  # noqa: E402

TRACE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: The simulator's KV block size (tokens), the prefix cache's unit.
BLOCK_TOKENS = 16
#: The simulator's default ``--max-model-len``: a longer prompt is refused before any cache lookup,
#: so it is left out of the bound as the engines leave it out of their counters.
MAX_MODEL_LEN = 131072

#: Narwhal's configurations: name -> extra config sections. ``narwhal`` is the
#: shipped default (``prefix``, ``mode = "always"``: docs/configure.md, "Why these defaults"); the
#: others set ``[routing]`` (docs/configure.md), and a router that does not
#: know a key refuses to start: that run is reported as refused.
NARWHAL_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "narwhal": {},
    "narwhal-round_robin": {"routing": {"policy": "round_robin", "mode": "always"}},
    "narwhal-least_loaded": {"routing": {"policy": "least_loaded", "mode": "always"}},
    "narwhal-prefix": {"routing": {"policy": "prefix", "mode": "always"}},
    "narwhal-prefix-auto": {"routing": {"policy": "prefix", "mode": "auto"}},
    "narwhal-least_loaded-auto": {"routing": {"policy": "least_loaded", "mode": "auto"}},
    "narwhal-prefix-never": {"routing": {"policy": "prefix", "mode": "never"}},
}
#: Configurations that depend on the fleet (a tokenizer path, KV event endpoints): name -> sections of the
#: fleet; the KV-event comparison (``kv_routing_bench.py``) registers its own here.
NARWHAL_FLEET_CONFIGS: dict[str, Callable[[Fleet], dict[str, dict[str, Any]]]] = {}
#: Extra ``vllm-router`` arguments for a ``vllm-pd-<policy>`` target that depend on the fleet (KV event sources).
VLLM_FLEET_ARGS: dict[str, Callable[[Fleet], list[str]]] = {}
#: vLLM Router's policies for prefill and decode choice in PD mode (``--policy``
#: sets both). ``kv_aware`` is left out: it needs the engines' KV events.
VLLM_PD_POLICIES = ("round_robin", "random", "power_of_two", "cache_aware", "consistent_hash",
                    "sticky_least_loaded")  # fmt: skip
BASELINE = "pool-round_robin"
ALL_TARGETS = (*NARWHAL_CONFIGS, *(f"vllm-pd-{p}" for p in VLLM_PD_POLICIES), BASELINE)
QUICK_TARGETS = ("narwhal", "vllm-pd-round_robin")
RATE_NAMES = ("light", "knee", "past")
#: The ``sessions`` workload: 60 chat sessions of 5 turns that resend a
#: growing history (user messages of ~4k tokens, answers of ~200), four
#: shared system prompts of 2k; ~14,000 prompt tokens a request on average,
#: 300 requests, a working set of ~0.7x the prefill pool's KV. Keeping a
#: session on the engine that holds its history is what pays here.
SESSIONS = SessionWorkload(sessions=60, turns=5, system_prompts=4, system_tokens=2048, user_tokens=4096,
                           output_tokens=192, session_rate=0.5, think_s=8.0, seed=0)  # fmt: skip


# ---------------------------------------------------------------------------- the fleet


class Fleet:
    """The simulated engines, and what a run needs from them: reset, idle, counters."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engines: list[SimProcess] = []

    def engine_options(self, role: str, index: int) -> dict[str, Any]:
        """``SimProcess`` keyword arguments of the ``index``-th engine of ``role`` (a subclass adds its own)."""
        return {"num_gpu_blocks": self.args.num_gpu_blocks, "record_limit": 16, "kv_pull_grace_ms": 0,
                "max_body_bytes": 8 << 20}  # fmt: skip

    def start(self) -> None:
        a = self.args
        for role, count in (("prefill", a.prefill), ("decode", a.decode)):
            for i in range(count):
                engine = SimProcess(role, speed=a.speed, lease_s=30.0 / a.speed, seed=i, **self.engine_options(role, i))
                self.engines.append(engine)
                engine.start()
        bad = [addr for e in self.engines for addr in listening_addresses(e.pid or 0) if not addr.startswith("127.")]
        if bad:
            raise SystemExit(f"routing_bench: an engine listens on {bad}")

    def urls(self, role: str | None = None) -> list[str]:
        return [e.url for e in self.engines if role is None or e.role == role]

    def stop(self) -> None:
        for engine in self.engines:
            try:
                engine.stop(5)
            except Exception:  # noqa: BLE001 - cleanup goes on
                engine.kill()

    def reset(self, timeout: float) -> str | None:
        """Wait until idle, then empty every prefix cache and zero the counters; why not, or None."""
        deadline = time.monotonic() + timeout
        while True:
            busy = {e.url: s for e in self.engines
                    if (s := e.stats())["running"] or s["waiting"] or s["kv_held"]}  # fmt: skip
            if not busy:
                break
            if time.monotonic() > deadline:
                return f"engines still busy after {timeout:.0f} s: {sorted(busy)}"
            time.sleep(0.2)
        for engine in self.engines:
            http("POST", engine.url + "/reset_prefix_cache", b"")
            engine.reset()
        return None

    def stats(self) -> dict[str, dict[str, Any]]:
        return {e.url: e.stats() for e in self.engines}


# ---------------------------------------------------------------------------- targets


def narwhal_config(path: Path, fleet: Fleet, port: int, speed: float, extra: dict[str, dict[str, Any]]) -> None:
    """The shipped defaults, every time limit divided by the speed, plus ``extra`` sections."""
    s = 1.0 / speed
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": MODEL},
        "ingress": {"listen": f"127.0.0.1:{port}", "max_body_bytes": 8 << 20},
        "engine": {"prefill": fleet.urls("prefill"), "decode": fleet.urls("decode"), "prefill_timeout_s": 60.0 * s,
                   "decode_timeout_s": 600.0 * s, "stream_idle_timeout_s": 60.0 * s},
        "admission": {"queue_timeout_s": 10.0 * s, "request_timeout_s": 900.0 * s},
        "journal": {"path": str(path.with_suffix(".journal.jsonl")), "fsync": "never"},
    }  # fmt: skip
    for section, keys in extra.items():
        sections.setdefault(section, {}).update(keys)
    lines = []
    for section, keys in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in keys.items())
        lines.append("")
    path.write_text("\n".join(lines))


def target_command(name: str, fleet: Fleet, port: int, work: Path, args: argparse.Namespace,
                   peers_bin: Path | None) -> list[str]:  # fmt: skip
    """The command line of target ``name`` listening on 127.0.0.1:``port``."""
    if is_narwhal(name):
        cfg = work / f"{name}.toml"
        narwhal_config(cfg, fleet, port, args.speed, narwhal_sections(name, fleet))
        return [sys.executable, "-m", "narwhal", "serve", "--config", str(cfg), "--runtime", args.runtime]
    assert peers_bin is not None
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(free_port()), "--log-level", "warning",
              "--request-timeout-secs", str(max(30, int(900 / args.speed)))]  # fmt: skip
    exe = str(peers_bin / "vllm-router")
    if name == BASELINE:
        return [exe, *common, "--worker-urls", *fleet.urls(), "--policy", "round_robin"]
    policy = name.removeprefix("vllm-pd-")
    cmd = [exe, *common, "--vllm-pd-disaggregation", "--policy", policy]
    for url in fleet.urls("prefill"):
        cmd += ["--prefill", url]
    for url in fleet.urls("decode"):
        cmd += ["--decode", url]
    return cmd + (VLLM_FLEET_ARGS[name](fleet) if name in VLLM_FLEET_ARGS else [])


def is_narwhal(name: str) -> bool:
    return name in NARWHAL_CONFIGS or name in NARWHAL_FLEET_CONFIGS


def narwhal_sections(name: str, fleet: Fleet) -> dict[str, dict[str, Any]]:
    """The extra config sections of Narwhal target ``name`` on ``fleet``."""
    return NARWHAL_FLEET_CONFIGS[name](fleet) if name in NARWHAL_FLEET_CONFIGS else NARWHAL_CONFIGS[name]


def start_target(name: str, fleet: Fleet, work: Path, args: argparse.Namespace,
                 peers: tuple[Path | None, str]) -> tuple[Proc | None, str, str | None]:  # fmt: skip
    """(process, URL, why it could not start or None): it answered one completion and listens on loopback only."""
    if not is_narwhal(name) and peers[0] is None:
        return None, "", peers[1] or "peers not installed"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, NO_COLOR="1")
    proc = Proc(name, target_command(name, fleet, port, work, args, peers[0]), None, work, env=env)
    body = json.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 2}).encode()
    deadline, last = time.monotonic() + args.start_timeout, ""
    while time.monotonic() < deadline:
        if not proc.alive():
            return proc, url, f"refused to start (exit {proc.popen.returncode}): {proc.tail(2)}"
        try:
            status, data = http("POST", url + "/v1/completions", body, timeout=5)
            if status == 200:
                break
            last = f"answered {status}: {data[:160]!r}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.25)
    else:
        return proc, url, f"not ready in {args.start_timeout:.0f} s ({last})"
    bad = [a for a in listening_addresses(proc.pid) if not a.startswith("127.")]
    if bad:
        return proc, url, f"listens on non-loopback {bad}: stopped"
    return proc, url, None


def engine_names(fleet: Fleet) -> dict[str, str]:
    """URL -> ``P0``, ``P1``, ... ``D0``, ``D1``: short names for the tables."""
    names: dict[str, str] = {}
    for role in ("prefill", "decode"):
        for i, url in enumerate(fleet.urls(role)):
            names[url] = f"{role[0].upper()}{i}"
    return names


def prompt_pool(name: str, fleet: Fleet) -> list[str]:
    """The engines that compute prompts under target ``name``: the prefill pool, or every engine when
    the target may run whole requests on decode engines (the plain pool, a mode other than ``always``)."""
    mode = narwhal_sections(name, fleet).get("routing", {}).get("mode", "always") if is_narwhal(name) else "always"
    return fleet.urls() if name == BASELINE or mode != "always" else fleet.urls("prefill")


# ---------------------------------------------------------------------------- workloads


def trace_window(args: argparse.Namespace, work: Path) -> Path:
    """The trace from request ``--trace-offset`` on, sorted by arrival, as a file of its own."""
    lines = [line for line in Path(args.trace).read_text().splitlines() if line.strip()]
    lines.sort(key=lambda line: json.loads(line)["timestamp"])
    path = work / f"trace_from_{args.trace_offset}.jsonl"
    path.write_text("\n".join(lines[args.trace_offset :]) + "\n")
    return path


def workload_args(workload: str, window: Path, rate: float, args: argparse.Namespace) -> list[str]:
    """``narwhal bench`` workload flags: arrivals S times faster, at ``rate`` times the workload's own rate."""
    if workload == "trace":
        source = ["--trace", str(window)]
    else:
        source = ["--generate"]
        for field in ("sessions", "turns", "system_prompts", "system_tokens", "user_tokens", "output_tokens",
                      "session_rate", "think_s", "seed"):  # fmt: skip
            source += ["--" + field.replace("_", "-"), str(getattr(SESSIONS, field))]
    return [*source, "--time-scale", repr(1.0 / args.speed), "--request-rate-scale", repr(rate),
            "--duration", repr(args.duration / args.speed), "--max-requests", str(args.max_requests)]  # fmt: skip


def workload_requests(workload: str, window: Path, rate: float, args: argparse.Namespace) -> list[Any]:
    """The very requests ``narwhal bench`` sends with :func:`workload_args` (same functions, same order)."""
    base = load_mooncake(str(window)) if workload == "trace" else generate_sessions(SESSIONS)
    scaled = scale_arrivals(base, time_scale=1.0 / args.speed, rate_scale=rate)
    return limit(scaled, max_requests=args.max_requests, duration_s=args.duration / args.speed)


# ---------------------------------------------------------------------------- one run


def run_one(name: str, workload: str, rate_name: str, rate: float, fleet: Fleet, window: Path, work: Path,
            args: argparse.Namespace, peers: tuple[Path | None, str]) -> dict[str, Any]:  # fmt: skip
    """Start the target, replay, read the engines' counters; the run's figures (or why there are none)."""
    tag = f"{name}.{workload}.{rate_name}"
    row: dict[str, Any] = {"target": name, "workload": workload, "rate": rate_name, "rate_scale": rate}
    proc, url, error = start_target(name, fleet, work, args, peers)
    try:
        if error is None:
            error = fleet.reset(timeout=max(10.0, 60.0 / args.speed))
        if error is not None:
            row["error"] = error
            log(f"{tag}: {error}")
            return row
        cpu_start = tree_cpu_seconds(proc.pid) if proc is not None else 0.0
        out = work / f"{tag}.jsonl"
        slo = ["--slo-ttft-ms", repr(args.slo_ttft_ms / args.speed), "--slo-itl-ms", repr(args.slo_itl_ms / args.speed)]
        cmd = [sys.executable, "-m", "narwhal", "bench", *workload_args(workload, window, rate, args),
               "--base-url", url, "--timeout", repr(args.request_timeout / args.speed), *slo,
               "--no-progress", "--label", tag, "--output", str(out)]  # fmt: skip
        limit_s = args.duration / args.speed + args.request_timeout / args.speed + 60
        started = time.monotonic()
        with open(work / f"{tag}.bench.txt", "wb") as text:
            code = subprocess.run(cmd, stdout=text, stderr=subprocess.STDOUT, timeout=limit_s, cwd=REPO).returncode
        row["wall_s"] = round(time.monotonic() - started, 1)
        if code != 0 or not out.exists():
            row["error"] = f"narwhal bench exited {code}: {(work / f'{tag}.bench.txt').read_text()[-300:]}"
            return row
        stats = fleet.stats()
        if proc is not None and proc.alive():
            row["router_cpu_s"] = round(tree_cpu_seconds(proc.pid) - cpu_start, 2)
        row.update(figures(name, out, stats, fleet, workload_requests(workload, window, rate, args), args))
        if proc is not None and not proc.alive():
            row["error"] = f"exited during the run: {proc.tail(2)}"
        log(f"{tag}: {brief(row)}")
        return row
    except subprocess.TimeoutExpired:
        row["error"] = "narwhal bench did not finish in time"
        return row
    finally:
        if proc is not None:
            proc.stop()


def figures(name: str, out: Path, stats: dict[str, dict[str, Any]], fleet: Fleet, requests: list[Any],
            args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Latency, goodput (simulated time), hit rate and its bound, and the work per engine."""
    s = args.speed
    with open(out, "rb") as f:
        results = read_results(f)
    summary = summarize(results, slo_ttft_s=args.slo_ttft_ms / 1000 / s, slo_itl_s=args.slo_itl_ms / 1000 / s)
    sim_ms = lambda v: None if v is None else round(v * s * 1000, 1)  # noqa: E731
    pool = prompt_pool(name, fleet)
    computed = {u: stats[u]["prompt_tokens"] for u in pool}
    hits = sum(stats[u]["cached_tokens"] for u in pool)
    queries = hits + sum(computed.values())
    prefill = fleet.urls("prefill")
    vllm_hits = sum(stats[u]["prefix_cache_hits"] for u in prefill)
    vllm_queries = sum(stats[u]["prefix_cache_queries"] for u in prefill)
    bound = cached_bound(requests, args.num_gpu_blocks * len(prefill))
    pool_bound = cached_bound(requests, args.num_gpu_blocks * len(pool))
    shares = share_of_mean(computed)
    names = engine_names(fleet)
    return {
        "requests": summary.requests, "completed": summary.completed, "errors": summary.errors,
        "error_kinds": dict(summary.error_kinds),
        "ttft_ms": {"p50": sim_ms(summary.ttft_p50_s), "p90": sim_ms(summary.ttft_p90_s),
                    "p99": sim_ms(summary.ttft_p99_s)},
        "itl_p99_ms": sim_ms(summary.itl_p99_s), "tpot_p50_ms": sim_ms(summary.tpot_p50_s),
        "goodput": round(summary.goodput / s, 4), "good": summary.good,
        "throughput": round(summary.request_throughput / s, 4),
        "hit_rate": hits / queries if queries else None, "hit_tokens": hits, "queried_tokens": queries,
        "vllm_prefix_cache_hit_rate": vllm_hits / vllm_queries if vllm_queries else None,
        "bound": bound.to_json(), "pool_bound": pool_bound.to_json(),
        "hit_over_bound": (hits / queries) / bound.rate if queries and bound.rate else None,
        "requests_per_engine": {names[u]: stats[u]["completions"] for u in fleet.urls()},
        "prompt_tokens_per_engine": {names[u]: computed[u] for u in pool},
        "prompt_share_of_mean": {names[u]: (round(v, 3) if v is not None else None) for u, v in shares.items()},
        "max_share": max((v for v in shares.values() if v is not None), default=None),
        "ttft_s_sim": sorted(round(r.ttft_s * s, 4) for r in results if r.ok and r.ttft_s is not None),
    }  # fmt: skip


_BOUNDS: dict[tuple[tuple[tuple[int, tuple[int, ...]], ...], int], Any] = {}


def cached_bound(requests: list[Any], capacity: int) -> Any:
    """:func:`prefix_bound` of the ``requests`` an engine accepts (the same for every target at one
    rate: computed once)."""
    served = tuple((r.input_length, r.hash_ids) for r in requests if r.input_length < MAX_MODEL_LEN)
    key = (served, capacity)
    if key not in _BOUNDS:
        _BOUNDS[key] = prefix_bound(served, capacity, block_tokens=BLOCK_TOKENS)
    return _BOUNDS[key]


def brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return "ERROR " + row["error"]
    t = row["ttft_ms"]
    hit = row["hit_rate"]
    return (f"{row['completed']}/{row['requests']} ok, TTFT p50/p90/p99 {t['p50']}/{t['p90']}/{t['p99']} ms, "
            f"ITL p99 {row['itl_p99_ms']} ms, goodput {row['goodput']:.3f}/s, hit "
            f"{'-' if hit is None else f'{hit:.1%}'} (bound {row['bound']['rate'] or 0:.1%}), "
            f"max share {row['max_share'] or 0:.2f}, router CPU {row.get('router_cpu_s', '-')} s, "
            f"wall {row['wall_s']} s")  # fmt: skip


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="routing_bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="2 targets, the knee rate only, a 20 s window")
    p.add_argument("--targets", default=",".join(ALL_TARGETS), help="comma-separated, from: " + ", ".join(ALL_TARGETS))
    p.add_argument("--workloads", default="trace", help="comma-separated: trace, sessions (the built-in generator)")
    p.add_argument("--rates", default="0.2,0.5,0.75",
                   help="light,knee,past arrival rates, as multiples of the trace window's own rate")
    p.add_argument("--session-rates", default="0.75,1.5,2.25", help="the same for the sessions workload")
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--trace-offset", type=int, default=3000,
                   help="replay the trace from this request on (its prefix reuse grows with its history)")
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals per run")
    p.add_argument("--max-requests", type=int, default=400, help="requests per run at most")
    p.add_argument("--speed", type=float, default=4.0, help="engines and arrivals this many times the modelled pace")
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--num-gpu-blocks", type=int, default=28000, help="KV blocks of 16 tokens per engine")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT SLO, simulated ms")
    p.add_argument("--slo-itl-ms", type=float, default=100.0, help="ITL SLO (a request's mean gap), simulated ms")
    p.add_argument("--request-timeout", type=float, default=300.0, help="one request's limit, simulated s")
    p.add_argument("--runtime", default="trio", choices=("trio", "asyncio"), help="Narwhal's runtime")
    p.add_argument("--start-timeout", type=float, default=30.0, help="wall seconds a target may take to start")
    p.add_argument("--time-limit", type=float, default=3600.0, help="wall seconds before everything is stopped")
    p.add_argument("--out", default=None, help="output directory (default: a new one under /tmp)")
    args = p.parse_args(argv)
    if args.quick:
        args.targets = ",".join(QUICK_TARGETS) if args.targets == ",".join(ALL_TARGETS) else args.targets
        args.rates = "knee=" + args.rates.split(",")[1] if "=" not in args.rates else args.rates
        args.duration = min(args.duration, 20.0)
        args.max_requests = min(args.max_requests, 40)
    return args


def rate_table(text: str) -> list[tuple[str, float]]:
    """``0.2,0.5,0.75`` (light, knee, past) or ``name=0.5,...``."""
    out = []
    for i, part in enumerate(p for p in text.split(",") if p):
        name, _, value = part.rpartition("=")
        out.append((name or (RATE_NAMES[i] if i < len(RATE_NAMES) else f"rate{i}"), float(value)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.loadavg_start = os.getloadavg()
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown:
        print(f"routing_bench: unknown targets {unknown}; known: {', '.join(ALL_TARGETS)}", file=sys.stderr)
        return 2
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="routing_bench-"))
    work.mkdir(parents=True, exist_ok=True)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGALRM, stop)
    signal.alarm(int(args.time_limit))
    fleet = Fleet(args)
    rows: list[dict[str, Any]] = []
    try:
        peers = ensure_peers(work) if any(not t.startswith("narwhal") for t in targets) else (None, "not asked for")
        window = trace_window(args, work)
        fleet.start()
        log(f"fleet: {args.prefill}P{args.decode}D at speed {args.speed:g}, {args.num_gpu_blocks} blocks each; "
            f"work directory {work}")  # fmt: skip
        for workload in (w for w in args.workloads.split(",") if w):
            rates = rate_table(args.rates if workload == "trace" else args.session_rates)
            if args.quick and workload != "trace":
                rates = rates[1:2]
            for rate_name, rate in rates:
                for name in targets:
                    rows.append(run_one(name, workload, rate_name, rate, fleet, window, work, args, peers))
    except KeyboardInterrupt as exc:
        log(f"stopped ({str(exc) or 'Ctrl-C'}): reporting the runs done")
    finally:
        signal.alarm(0)
        Proc.stop_all()
        fleet.stop()
    return report(rows, args, work)


def code_commit() -> str:
    """The commit the targets ran from, ``+dirty`` when the tree had changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def report(rows: list[dict[str, Any]], args: argparse.Namespace, work: Path) -> int:
    for r in rows:
        r["slo_ttft_s"] = args.slo_ttft_ms / 1000
    table = markdown(rows)
    machine = {"cpus": os.cpu_count(), "loadavg_start": args.loadavg_start, "loadavg_end": os.getloadavg(),
               "commit": code_commit()}  # fmt: skip
    settings = {k: v for k, v in vars(args).items() if k != "loadavg_start"}
    doc = {"settings": settings, "machine": machine, "runs": rows}
    (work / "routing.json").write_text(json.dumps(doc, indent=1) + "\n")
    brief_rows = [{k: v for k, v in r.items() if k != "ttft_s_sim"} for r in rows]  # the CDFs are in the plot
    (work / "routing_summary.json").write_text(json.dumps({**doc, "runs": brief_rows}, indent=1) + "\n")
    knees = {}
    for workload in (w for w in args.workloads.split(",") if w):
        rates = rate_table(args.rates if workload == "trace" else args.session_rates)
        knees[workload] = rates[1 if len(rates) > 1 else 0][0]
    knee = knees.get("trace", "knee")
    note = plot(rows, work / "ttft_cdf.png", knee)
    text = (f"Code {machine['commit']}; load average {args.loadavg_start[0]:.1f} at the start, "
            f"{machine['loadavg_end'][0]:.1f} at the end, {machine['cpus']} CPUs.\n"
            f"Simulated time (speed {args.speed:g}: wall seconds x {args.speed:g}); SLO TTFT <= "
            f"{args.slo_ttft_ms:g} ms and TPOT <= {args.slo_itl_ms:g} ms; bound: one LRU cache of "
            f"{args.prefill} x {args.num_gpu_blocks} blocks of {BLOCK_TOKENS} tokens.\n\n{table}\n\n"
            + "\n\n".join(verdict(rows, k, w) for w, k in knees.items()) + "\n")
    (work / "routing.md").write_text(text)
    print(text)
    print(note, file=sys.stderr)
    print(f"results in {work}", file=sys.stderr)
    return 0 if rows and all("error" not in r or "refused" in r["error"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
