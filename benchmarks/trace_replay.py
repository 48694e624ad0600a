"""Replay a Mooncake trace through `narwhal serve` + `narwhal sim` processes, and through the virtual fleet.

The real run: ``--prefill`` + ``--decode`` simulated engines (``python -m
narwhal_sim`` processes at ``--speed S``) behind ``narwhal serve``, the
trace replayed by ``narwhal bench`` at ``--time-scale 1/S``: the engines run
S times faster than the modelled H100 and the requests arrive S times
faster, so load and queueing are those of the trace at its own pace, and
every latency is the modelled one divided by S. The router's time limits
are divided by S too (the config is written into the output directory).

The virtual run: the same trace, the same router config, in virtual time
(``narwhal bench --virtual``) with engine step times divided by S — the
same experiment without sockets. Both runs' per-request results, summaries
and one plot (TTFT CDF and goodput side by side) land in ``--out``.

    python benchmarks/trace_replay.py [--speed 4] [--max-requests N] [--out benchmarks/results]

Bounded: the replay lasts the trace's span / S plus the slowest answer
(every request has a time limit); only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from narwhal_sim.testing import SimProcess  # noqa: E402

TRACE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"
#: The engine step times of narwhal sim's defaults (docs/simulator.md), divided by the speed for the virtual run.
STEP_TIMES = {"step_base_ms": 7.0, "prefill_per_token_ms": 0.08, "decode_per_seq_ms": 0.05,
              "kv_transfer_base_ms": 2.0, "kv_transfer_per_block_ms": 0.05}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def router_config(path: Path, prefill: list[str], decode: list[str], port: int, scale: float) -> None:
    """Default limits, every time limit multiplied by ``scale`` (1/speed)."""
    quote = lambda urls: "[" + ", ".join(f'"{u}"' for u in urls) + "]"  # noqa: E731
    path.write_text(f"""
[model]
name = "meta-llama/Llama-3.1-8B-Instruct"

[ingress]
listen = "127.0.0.1:{port}"
max_body_bytes = 4194304

[engine]
prefill = {quote(prefill)}
decode = {quote(decode)}
prefill_timeout_s = {60.0 * scale}
decode_timeout_s = {600.0 * scale}
stream_idle_timeout_s = {60.0 * scale}

[admission]
queue_timeout_s = {10.0 * scale}
request_timeout_s = {900.0 * scale}

[journal]
path = "{path.parent / 'journal.jsonl'}"
fsync = "never"
""")


def wait_ready(url: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"router at {url} not ready after {timeout} s")


def bench(args: list[str], log: Path) -> None:
    cmd = [sys.executable, "-m", "narwhal", "bench", *args]
    print("+", " ".join(cmd), file=sys.stderr)
    with open(log, "w") as out:
        code = subprocess.call(cmd, stdout=out, cwd=ROOT)
    print(log.read_text())
    if code:
        raise SystemExit(f"narwhal bench exited {code}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--speed", type=float, default=4.0, help="engine speed S; the trace is replayed at 1/S")
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--trace-seconds", type=float, default=None, help="replay only the trace's first SECONDS")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT SLO in modelled (H100) ms")
    p.add_argument("--slo-itl-ms", type=float, default=50.0, help="TPOT SLO in modelled (H100) ms")
    p.add_argument("--runtime", default="trio", choices=("trio", "asyncio"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--skip-real", action="store_true", help="only the virtual run")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    s = args.speed
    name = f"{args.prefill}P{args.decode}D"
    common = ["--trace", args.trace, "--time-scale", repr(1 / s),
              "--slo-ttft-ms", repr(args.slo_ttft_ms / s), "--slo-itl-ms", repr(args.slo_itl_ms / s)]  # fmt: skip
    if args.max_requests:
        common += ["--max-requests", str(args.max_requests)]
    if args.trace_seconds:
        common += ["--duration", repr(args.trace_seconds / s)]
    config = out / f"router_{name}.toml"
    engines: list[SimProcess] = []
    if not args.skip_real:
        router = None
        try:
            for role, count in (("prefill", args.prefill), ("decode", args.decode)):
                for _ in range(count):
                    engines.append(SimProcess(role, speed=s, lease_s=30.0 / s, kv_pull_grace_ms=2.0).start())
            prefill = [e.url for e in engines if e.role == "prefill"]
            decode = [e.url for e in engines if e.role == "decode"]
            port = free_port()
            router_config(config, prefill, decode, port, 1 / s)
            env = dict(os.environ)
            router = subprocess.Popen([sys.executable, "-m", "narwhal", "serve", "--config", str(config),
                                       "--runtime", args.runtime], cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(out / "router.log", "w"))  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            wait_ready(url)
            bench([*common, "--base-url", url, "--engine-metrics", *prefill, "--label", f"real {name}",
                   "--output", str(out / f"real_{name}.jsonl"), "--summary-json", str(out / f"real_{name}.json")],
                  out / f"real_{name}.txt")  # fmt: skip
        finally:
            if router is not None:
                router.terminate()
                try:
                    router.wait(20)
                except subprocess.TimeoutExpired:
                    router.kill()
            for engine in engines:
                engine.stop()
    else:
        router_config(config, [f"http://127.0.0.1:{8100 + i}" for i in range(args.prefill)],
                      [f"http://127.0.0.1:{8200 + i}" for i in range(args.decode)], 8000, 1 / s)  # fmt: skip
    options: list[str] = []
    for key, value in STEP_TIMES.items():
        options += ["--engine-option", f"{key}={value / s!r}"]
    options += ["--engine-option", f"kv_lease_s={30.0 / s!r}"]
    bench([*common, "--virtual", "--fleet", name, "--router-config", str(config), *options,
           "--label", f"virtual {name}", "--output", str(out / f"virtual_{name}.jsonl"),
           "--summary-json", str(out / f"virtual_{name}.json")], out / f"virtual_{name}.txt")  # fmt: skip
    runs = [str(out / f"{kind}_{name}.jsonl") for kind in ("real", "virtual")
            if (out / f"{kind}_{name}.jsonl").exists()]  # fmt: skip
    bench(["--plot", str(out / f"trace_{name}.png"), "--results", *runs,
           "--slo-ttft-ms", repr(args.slo_ttft_ms / s), "--slo-itl-ms", repr(args.slo_itl_ms / s)],
          out / f"plot_{name}.txt")  # fmt: skip
    print(json.dumps({"out": str(out), "speed": s}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
