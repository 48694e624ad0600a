"""Side by side in front of one simulated fleet: SGLang's own router and Narwhal (SGLang PD), vllm-router and Narwhal (vLLM push).

One command, bounded in time (a few minutes), 127.0.0.1 only::

    . .venv/bin/activate
    python benchmarks/sglang_bench.py                  # both scenarios, every target
    python benchmarks/sglang_bench.py --scenarios sglang --requests 100

Scenarios (each its own fleet of two simulated engines, ``narwhal_sim`` subprocesses at
``--speed``, docs/simulator.md):

* ``sglang``: an SGLang prefill engine and decode engine (``--protocol sglang``, the prefill's
  bootstrap server on a port of its own; docs/simulator.md, "SGLang PD"). Targets:
  ``sglang-router`` (PyPI, pinned in ``router_bench.PEER_PACKAGES``: ``launch --pd-disaggregation
  --prefill URL BOOTSTRAP_PORT --decode URL --policy round_robin``), ``narwhal-trio`` and
  ``narwhal-asyncio`` with ``engine.protocol = "sglang"`` and ``engine.bootstrap_port``. A
  Narwhal without the ``sglang`` protocol is skipped with the reason.
* ``push``: a vLLM prefill and decode engine in NIXL push mode (``--kv-transfer-mode push``;
  docs/simulator.md, "Push mode"). Targets: ``vllm-router`` (PyPI, ``--vllm-pd-disaggregation
  --policy round_robin``: it has no push mode of its own, but copies the prefill answer's
  ``kv_transfer_params`` into the decode request and sends both legs the same ``X-Request-Id``,
  which is what vLLM's push proxy does; benchmarks/README.md), ``narwhal-trio`` and
  ``narwhal-asyncio`` with ``engine.protocol = "vllm-nixl-push"``.

Every target gets the same load, one after another: a warm-up of ``--warmup`` requests, then
``narwhal bench`` replaying ``--requests`` streamed completions (``--prompt-tokens`` prompt
tokens each, all distinct, ``--output-tokens`` out) kept ``--concurrency`` at once. Per target:
requests answered / sent, the errors, TTFT p50/p90 and end-to-end p50 (narwhal bench), the
router's CPU time per request (utime + stime of its process and children from /proc, read just
before and after the measured replay, as router_bench.py does) and its RSS after the run; and
whether every request crossed both engines (the simulators' counters: SGLang rooms collected,
or KV pushes written, one per request, none leaked).

The peers come from PyPI into ``benchmarks/.peers-venv`` (router_bench.py's machinery and
pins). Results: a table on stdout and ``--out`` (JSON); logs in a fresh directory under /tmp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from router_bench import (  # noqa: E402
    MODEL, PEER_PACKAGES, Proc, ensure_peers, free_port, listening_addresses, log, narwhal_config, rss_kib,
    tree_cpu_seconds, wait_ready,
)

from narwhal_bench.stats import percentile, read_results  # noqa: E402
from narwhal_sim.testing import SimProcess  # noqa: E402

SCENARIOS = ("sglang", "push")
TARGETS = {"sglang": ("sglang-router", "narwhal-trio", "narwhal-asyncio"),
           "push": ("vllm-router", "narwhal-trio", "narwhal-asyncio")}  # fmt: skip
#: Narwhal's engine.protocol per scenario.
NARWHAL_PROTOCOL = {"sglang": "sglang", "push": "vllm-nixl-push"}
#: The decode side's SGLANG_DISAGGREGATION_WAITING_TIMEOUT in the bench (300 s in SGLang): a
#: request that lost its prefill fails in bounded time.
WAITING_TIMEOUT_S = 20.0


def narwhal_protocol_missing(name: str) -> str | None:
    """Why this tree's Narwhal cannot drive ``engine.protocol = name``, or ``None`` when it can."""
    from narwhal_core.protocols import engine_protocol

    try:
        engine_protocol(name)
    except ValueError:
        return f'this tree\'s Narwhal has no engine.protocol "{name}" (narwhal_core/protocols)'
    return None


def write_trace(path: Path, *, requests: int, prompt_tokens: int, output_tokens: int, first_block: int) -> None:
    """``requests`` lines due at once (``--concurrency`` paces them), each prompt its own blocks (docs/bench.md)."""
    blocks = -(-prompt_tokens // 512)
    lines = []
    for i in range(requests):
        first = first_block + i * blocks
        lines.append(json.dumps({"timestamp": 0, "input_length": prompt_tokens, "output_length": output_tokens,
                                 "hash_ids": list(range(first, first + blocks))}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def bench_command(trace: Path, url: str, out: Path, *, concurrency: int, timeout_s: float) -> list[str]:
    """``narwhal bench`` replaying ``trace`` against ``url``: streamed completions, raw client."""
    return [sys.executable, "-m", "narwhal", "bench", "--trace", str(trace), "--base-url", url, "--model", MODEL,
            "--concurrency", str(concurrency), "--timeout", repr(timeout_s), "--no-progress", "--output", str(out)]


def summarise(results_path: Path, sent: int) -> dict[str, Any]:
    """Answered / sent, the errors, TTFT p50/p90 and end-to-end p50 (ms) of one replay."""
    results = read_results(results_path.read_bytes().splitlines()) if results_path.exists() else []
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]

    def ms(values: list[float], q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else round(1000 * value, 1)

    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[str(r.error)[:120]] = errors.get(str(r.error)[:120], 0) + 1
    return {"sent": sent, "answered": len(ok), "errors": sum(errors.values()) + sent - len(results),
            "error_kinds": errors, "ttft_p50_ms": ms(ttfts, 50), "ttft_p90_ms": ms(ttfts, 90),
            "e2e_p50_ms": ms(e2es, 50)}  # fmt: skip


# ---------------------------------------------------------------------------- fleets


class Fleet:
    """A scenario's two simulated engines, and what each target's requests did to them."""

    def __init__(self, scenario: str, speed: float) -> None:
        self.scenario = scenario
        if scenario == "sglang":
            self.prefill = SimProcess("prefill", speed=speed, protocol="sglang", model=MODEL, bootstrap_port=0)
            self.decode = SimProcess("decode", speed=speed, protocol="sglang", model=MODEL,
                                     waiting_timeout_s=WAITING_TIMEOUT_S)  # fmt: skip
        else:
            self.prefill = SimProcess("prefill", speed=speed, model=MODEL, kv_transfer_mode="push")
            self.decode = SimProcess("decode", speed=speed, model=MODEL, kv_transfer_mode="push")

    def __enter__(self) -> Fleet:
        self.prefill.start()
        self.decode.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.decode.stop()
        self.prefill.stop()

    @property
    def bootstrap_port(self) -> int | None:
        return self.prefill.startup.get("bootstrap_port") if self.scenario == "sglang" else None

    def counters(self) -> dict[str, int]:
        """The counters that say whether a request crossed both engines, and what it left behind."""
        p, d = self.prefill.stats(), self.decode.stats()
        if self.scenario == "sglang":
            return {"pd": p["rooms_collected"], "leaked": p["kv_leaked"] + p["rooms_timed_out"],
                    "decode_failed": d["decode_timed_out"] + d["decode_failed"]}  # fmt: skip
        return {"pd": p["kv_pushes"], "leaked": p["kv_expired"], "decode_failed": d["kv_push_registration_timeouts"]}

    def held(self) -> int:
        """What the prefill engine still holds for a decode side: rooms, or KV blocks' owners."""
        stats = self.prefill.stats()
        return int(stats["rooms_held"] if self.scenario == "sglang" else stats["kv_held"])


def start_target(name: str, fleet: Fleet, work: Path, peers_bin: Path | None, peers_error: str) -> tuple[Proc | None, str, str | None]:  # fmt: skip
    """The router process, its URL, or why it could not start."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    prefill, decode = fleet.prefill.url, fleet.decode.url
    if name.startswith("narwhal-"):
        protocol = NARWHAL_PROTOCOL[fleet.scenario]
        missing = narwhal_protocol_missing(protocol)
        if missing is not None:
            return None, url, f"skipped: {missing}"
        engine: dict[str, Any] = {"protocol": protocol}
        if fleet.bootstrap_port is not None:
            engine["bootstrap_port"] = fleet.bootstrap_port
        config = work / f"{fleet.scenario}-{name}.toml"
        narwhal_config(config, port, prefill, decode, work / f"{fleet.scenario}-{name}-journal.jsonl",
                       {"engine": engine, "journal": {"fsync": "never"}})  # fmt: skip
        cmd = [sys.executable, "-m", "narwhal.cli", "serve", "--config", str(config), "--runtime", name.split("-")[1]]
    else:
        if peers_bin is None:
            return None, url, peers_error or "peers not installed"
        prom = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        if name == "sglang-router":
            cmd = [str(peers_bin / "sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--pd-disaggregation", "--prefill", prefill, str(fleet.bootstrap_port), "--decode", decode,
                   "--policy", "round_robin", *prom]  # fmt: skip
        else:
            cmd = [str(peers_bin / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                   "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode, "--policy", "round_robin",
                   *prom]  # fmt: skip
    return Proc(f"{fleet.scenario}-{name}", cmd, None, work, env={**os.environ, "NO_COLOR": "1"}), url, None


class _Ready:
    """What router_bench's ``wait_ready`` reads of a target."""

    def __init__(self, proc: Proc, url: str) -> None:
        self.proc, self.url, self.error = proc, url, None


def run_target(name: str, fleet: Fleet, work: Path, args: argparse.Namespace, peers_bin: Path | None,
               peers_error: str, block_base: int) -> dict[str, Any]:  # fmt: skip
    """One target in front of the fleet: warm-up, the measured replay, the figures."""
    row: dict[str, Any] = {"scenario": fleet.scenario, "target": name}
    proc, url, error = start_target(name, fleet, work, peers_bin, peers_error)
    if proc is None:
        row["error"] = error
        log(f"{fleet.scenario} {name}: {error}")
        return row
    try:
        ready = _Ready(proc, url)
        wait_ready(ready, 60)  # type: ignore[arg-type]  # the fields it reads
        if ready.error is not None:
            row["error"] = ready.error
            return row
        outside = [a for a in listening_addresses(proc.pid) if not a.startswith("127.")]
        if outside:
            row["error"] = f"listens on {outside}"
            return row
        timeout = args.timeout_s
        if args.warmup:
            warm = work / f"{fleet.scenario}-{name}-warmup.jsonl"
            write_trace(warm, requests=args.warmup, prompt_tokens=args.prompt_tokens,
                        output_tokens=args.output_tokens, first_block=block_base)  # fmt: skip
            _run(bench_command(warm, url, work / f"{fleet.scenario}-{name}-warmup.out", concurrency=args.concurrency,
                               timeout_s=timeout), work / f"{fleet.scenario}-{name}-warmup.log", args)  # fmt: skip
        # The router's own CPU with no request in flight (health checks, metrics scrapes, timers),
        # which the replay's figure includes: shown beside it, and taken out of the net figure.
        idle0 = tree_cpu_seconds(proc.pid)
        time.sleep(args.idle_s)
        idle_rate = (tree_cpu_seconds(proc.pid) - idle0) / args.idle_s if args.idle_s > 0 else 0.0
        trace = work / f"{fleet.scenario}-{name}-trace.jsonl"
        write_trace(trace, requests=args.requests, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                    first_block=block_base + 100_000)  # fmt: skip
        out = work / f"{fleet.scenario}-{name}.out"
        before = fleet.counters()
        cpu0 = tree_cpu_seconds(proc.pid)
        started = time.monotonic()
        _run(bench_command(trace, url, out, concurrency=args.concurrency, timeout_s=timeout),
             work / f"{fleet.scenario}-{name}.log", args)  # fmt: skip
        wall = time.monotonic() - started
        cpu = tree_cpu_seconds(proc.pid) - cpu0
        row.update(summarise(out, args.requests))
        rss, hwm = rss_kib(proc.pid)
        _settle(fleet)
        after = fleet.counters()
        delta = {k: after[k] - before[k] for k in after}
        row.update(wall_s=round(wall, 2), router_cpu_s=round(cpu, 3),
                   cpu_us_per_req=round(1e6 * cpu / row["answered"], 1) if row["answered"] else None,
                   idle_cpu_pct=round(100 * idle_rate, 2),
                   net_cpu_us_per_req=(round(1e6 * max(0.0, cpu - idle_rate * wall) / row["answered"], 1)
                                       if row["answered"] else None),
                   rss_mib=round(rss / 1024, 1), rss_hwm_mib=round(hwm / 1024, 1),
                   pd_requests=delta["pd"], leaked=delta["leaked"], decode_failed=delta["decode_failed"],
                   held_after=fleet.held())  # fmt: skip
        log(f"{fleet.scenario} {name}: {row['answered']}/{row['sent']} answered, TTFT p50 {row['ttft_p50_ms']} ms, "
            f"{row['cpu_us_per_req']} us CPU/request")
        return row
    except (subprocess.SubprocessError, OSError, RuntimeError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return row
    finally:
        proc.stop()


def _settle(fleet: Fleet, timeout: float = 10.0) -> None:
    """Wait (bounded) until the prefill engine holds nothing for a decode side: the counters are final."""
    deadline = time.monotonic() + timeout
    while fleet.held() and time.monotonic() < deadline:
        time.sleep(0.05)


def _run(cmd: list[str], log_path: Path, args: argparse.Namespace) -> None:
    bound = args.timeout_s + 60 + (args.requests + args.warmup) * args.timeout_s / max(1, args.concurrency)
    with open(log_path, "wb") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=min(bound, 600))
    if code:
        raise RuntimeError(f"narwhal bench exited {code}: {log_path.read_text(errors='replace')[-300:]}")


# ---------------------------------------------------------------------------- report


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as a Markdown table (benchmarks/README.md)."""

    def cell(value: Any) -> str:
        return "—" if value is None else str(value)

    lines = ["| scenario | target | answered / sent | errors | TTFT p50 ms | TTFT p90 ms | e2e p50 ms "
             "| router CPU µs/req (net of idle) | idle CPU % | RSS MiB | PD legs / leaked |", "|" + "---|" * 11]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['scenario']} | {r['target']} | {r['error']} |" + " |" * 8)
            continue
        lines.append(f"| {r['scenario']} | {r['target']} | {r['answered']} / {r['sent']} | {r['errors']} "
                     f"| {cell(r['ttft_p50_ms'])} | {cell(r['ttft_p90_ms'])} | {cell(r['e2e_p50_ms'])} "
                     f"| {cell(r['cpu_us_per_req'])} ({cell(r['net_cpu_us_per_req'])}) | {cell(r['idle_cpu_pct'])} "
                     f"| {cell(r['rss_mib'])} | {r['pd_requests']} / {r['leaked']} |")
    return "\n".join(lines)


def ratios(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each Narwhal row's CPU per request and TTFT p50 over the scenario's peer router, in this run."""
    out: dict[str, dict[str, float]] = {}
    for scenario in SCENARIOS:
        peer = next((r for r in rows if r["scenario"] == scenario and not r["target"].startswith("narwhal")
                     and r.get("cpu_us_per_req")), None)  # fmt: skip
        if peer is None:
            continue
        for r in rows:
            if r["scenario"] == scenario and r["target"].startswith("narwhal") and r.get("cpu_us_per_req"):
                out[f"{scenario}/{r['target']}"] = {
                    "cpu_per_req_vs_peer": round(r["cpu_us_per_req"] / peer["cpu_us_per_req"], 2),
                    "net_cpu_per_req_vs_peer": (round(r["net_cpu_us_per_req"] / peer["net_cpu_us_per_req"], 2)
                                                if peer.get("net_cpu_us_per_req") else None),
                    "ttft_p50_vs_peer": round(r["ttft_p50_ms"] / peer["ttft_p50_ms"], 2),
                }
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--targets", nargs="+", default=None, help="only these targets (names as in the table)")
    p.add_argument("--requests", type=int, default=300, help="measured requests per target (default 300)")
    p.add_argument("--warmup", type=int, default=30, help="warm-up requests per target (default 30)")
    p.add_argument("--concurrency", type=int, default=8, help="requests kept outstanding (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt tokens per request (default 512)")
    p.add_argument("--output-tokens", type=int, default=16, help="output tokens per request (default 16)")
    p.add_argument("--speed", type=float, default=1.0, help="the simulators' --speed (default 1: modelled time)")
    p.add_argument("--idle-s", type=float, default=2.0,
                   help="seconds the router's idle CPU is read over, before the replay (default 2)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="a request's timeout in narwhal bench")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.warmup < 0:
        p.error("--requests and --concurrency must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="sglang-bench-"))
    wanted = [t for s in args.scenarios for t in TARGETS[s]]
    need_peers = any(not t.startswith("narwhal") for t in wanted if args.targets is None or t in args.targets)
    peers_bin, peers_error = ensure_peers(work) if need_peers else (None, "")
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for n, scenario in enumerate(args.scenarios):
            with Fleet(scenario, args.speed) as fleet:
                for i, name in enumerate(TARGETS[scenario]):
                    if args.targets is not None and name not in args.targets:
                        continue
                    rows.append(run_target(name, fleet, work, args, peers_bin, peers_error,
                                           block_base=10_000_000 * (n * 10 + i + 1)))  # fmt: skip
    finally:
        Proc.stop_all()
    report = {
        "command": "python benchmarks/sglang_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "load": {k: getattr(args, k) for k in ("requests", "warmup", "concurrency", "prompt_tokens",
                                               "output_tokens", "speed")},  # fmt: skip
        "peers": list(PEER_PACKAGES[:2]),
        "seconds": round(time.monotonic() - started, 1),
        "rows": rows,
        "ratios": ratios(rows),
        "work": str(work),
    }
    print(table(rows))
    print(json.dumps(report["ratios"]))
    print(f"logs and configs: {work}", file=sys.stderr)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all("error" not in r or r["error"].startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
