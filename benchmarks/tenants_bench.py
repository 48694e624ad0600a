"""Tenants: the TTFT of a tenant sending short chats while another floods long prompts, FIFO against fair admission.

Real processes on 127.0.0.1: ``--prefill`` + ``--decode`` simulated
engines (``python -m narwhal_sim`` at ``--speed``) behind ``narwhal serve``
(each runtime in turn), and ``narwhal bench`` driving both tenants, each
named by the trusted client header (``ingress.auth = "trusted_header"``,
``x-narwhal-client``):

* **short**: ``--short`` chats through the ``openai`` package
  (``narwhal bench --client openai``), streamed, ``--short-tokens``-token
  prompts, 16 output tokens, one every ``--short-every-s``;
* **flood**: ``--flood-concurrency`` requests always outstanding
  (``narwhal bench --concurrency``), prompts of ``--flood-min``..``--flood-max``
  tokens, ``--flood-output`` output tokens, none sharing a prefix.

Each cell (runtime x admission mode) starts a router, runs the short tenant
alone (*unloaded*), then starts the flood, waits until requests queue at the
router's admission, runs the same chats again (*under flood*; new prompt
text, so nothing is a prefix hit), and stops the flood. The admission
modes: ``fifo`` (no ``[tenants]``), ``fair`` (``[tenants]``, the two
tenants in one band at equal weights), ``band`` (the short tenant in a
higher band). ``admission.max_inflight`` (``--max-inflight``) is sized to
the prefill pool, so that requests wait at the router's admission, not in
the engines' queues (docs/operate.md, "Tenants"). The table (TTFT p50/p90
alone and under the flood, the ratio of the p90s) is printed and written
with the config to ``--out``/tenants.json.

    python benchmarks/tenants_bench.py [--speed 1] [--runtimes trio,asyncio] [--modes fifo,fair,band]

Bounded: every request has a time limit, the flood is stopped after each
cell, every process is started here and stopped here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from narwhal_bench.stats import parse_prometheus, percentile, read_results  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from trace_replay import wait_ready  # noqa: E402  (the router's /ready, polled)

MODES = ("fifo", "fair", "band")
TENANTS = {
    "fifo": "",
    "fair": '[tenants]\n\n[[tenants.tenant]]\nname = "short"\n\n[[tenants.tenant]]\nname = "flood"\n',
    "band": '[tenants]\nbands = ["interactive", "batch"]\ndefault_band = "batch"\n\n'
            '[[tenants.tenant]]\nname = "short"\nband = "interactive"\n\n'
            '[[tenants.tenant]]\nname = "flood"\n',
}  # fmt: skip


@attrs.frozen(kw_only=True)
class Spec:
    """The workload and the router's limits of one run."""

    short: int = 30
    short_tokens: int = 60
    short_output: int = 16
    short_every_s: float = 0.5
    flood_concurrency: int = 8
    flood_requests: int = 400
    flood_min: int = 8192
    flood_max: int = 16384
    flood_output: int = 4
    max_inflight: int = 2
    queue_timeout_s: float = 60.0
    timeout_s: float = 120.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_traces(directory: Path, spec: Spec) -> tuple[Path, Path]:
    """The short tenant's chats and the flood's long prompts as Mooncake lines (docs/bench.md, "Workloads")."""
    short = directory / "short.jsonl"
    short.write_text("".join(json.dumps({"timestamp": round(1000 * i * spec.short_every_s, 3),
                                         "input_length": spec.short_tokens, "output_length": spec.short_output,
                                         "hash_ids": [i]}) + "\n" for i in range(spec.short)))  # fmt: skip
    flood = directory / "flood.jsonl"
    lines = []
    span = spec.flood_max - spec.flood_min
    for i in range(spec.flood_requests):
        length = spec.flood_min + (i * 7919) % (span + 1)  # spread over the range, the same every run
        first = 1_000_000 + i * 64  # distinct blocks: no flood prompt is a prefix hit
        lines.append(json.dumps({"timestamp": 0, "input_length": length, "output_length": spec.flood_output,
                                 "hash_ids": list(range(first, first + math.ceil(length / 512)))}) + "\n")  # fmt: skip
    flood.write_text("".join(lines))
    return short, flood


def router_config(path: Path | None, *, port: int, prefill: Sequence[str], decode: Sequence[str], mode: str,
                  spec: Spec) -> str:  # fmt: skip
    quote = lambda urls: "[" + ", ".join(f'"{u}"' for u in urls) + "]"  # noqa: E731
    text = f"""[model]
name = "meta-llama/Llama-3.1-8B-Instruct"

[ingress]
listen = "127.0.0.1:{port}"
auth = "trusted_header"
trusted_proxies = ["127.0.0.1"]

[engine]
prefill = {quote(prefill)}
decode = {quote(decode)}

[admission]
max_inflight = {spec.max_inflight}
queue_timeout_s = {spec.queue_timeout_s}

[journal]
path = "{path.parent / 'journal.jsonl' if path else 'journal.jsonl'}"
fsync = "never"

{TENANTS[mode]}"""
    if path is not None:
        path.write_text(text)
    return text


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        return {k: v for k, v in parse_prometheus(answer.read().decode()).items()}


def bench_command(trace: Path, url: str, tenant: str, out: Path, *, seed: int, spec: Spec,
                  flood: bool) -> list[str]:  # fmt: skip
    cmd = [sys.executable, "-m", "narwhal", "bench", "--trace", str(trace), "--base-url", url, "--seed", str(seed),
           "--header", f"x-narwhal-client:{tenant}", "--timeout", repr(spec.timeout_s), "--no-progress",
           "--output", str(out)]  # fmt: skip
    if flood:
        return [*cmd, "--concurrency", str(spec.flood_concurrency)]
    return [*cmd, "--client", "openai", "--endpoint", "/v1/chat/completions"]


class Sampler:
    """Router admission and engine queue gauges, sampled every 50 ms while the short tenant runs under the flood."""

    def __init__(self, router_url: str, prefill: Sequence[Any]) -> None:
        self.router_url = router_url
        self.prefill = prefill
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                m = metrics(self.router_url)
                waiting = sum(e.stats()["waiting"] for e in self.prefill)
            except OSError:
                continue
            self.samples.append((m.get("narwhal_queued_requests", 0.0), m.get("narwhal_inflight_requests", 0.0),
                                 float(waiting)))  # fmt: skip

    def means(self) -> dict[str, float | None]:
        def mean(i: int) -> float | None:
            return round(statistics.fmean(s[i] for s in self.samples), 2) if self.samples else None

        return {"router_queued_mean": mean(0), "router_inflight_mean": mean(1), "engine_waiting_mean": mean(2)}


def _ttft(path: Path) -> dict[str, Any]:
    results = read_results(path.read_bytes().splitlines())
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    p50, p90 = percentile(ttfts, 50), percentile(ttfts, 90)
    return {"requests": len(results), "ok": sum(r.ok for r in results),
            "errors": sorted({r.error for r in results if r.error}),
            "ttft_p50_ms": None if p50 is None else round(1000 * p50, 1),
            "ttft_p90_ms": None if p90 is None else round(1000 * p90, 1)}  # fmt: skip


def _run(cmd: list[str], log: Path, timeout: float) -> None:
    with open(log, "w") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout)
    if code:
        raise SystemExit(f"{' '.join(cmd[:4])} exited {code}: {log.read_text()[-2000:]}")


def _wait_queued(url: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while metrics(url).get("narwhal_queued_requests", 0.0) < 1:
        if time.monotonic() > end:
            raise SystemExit("the flood never filled the router's admission: nothing queued")
        time.sleep(0.05)


def _tenant_waits(url: str) -> dict[str, float | None]:
    """The mean admission wait of each tenant (docs/operate.md, "Tenants": narwhal_tenant_queue_wait_seconds)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        lines = answer.read().decode().splitlines()
    out: dict[str, float | None] = {}
    for tenant in ("short", "flood"):
        sums = {"_sum": 0.0, "_count": 0.0}
        for line in lines:
            for suffix in sums:
                if line.startswith("narwhal_tenant_queue_wait_seconds" + suffix + "{") and f'tenant="{tenant}"' in line:
                    sums[suffix] += float(line.rpartition(" ")[2])
        count = sums["_count"]
        out[f"{tenant}_queue_wait_mean_ms"] = round(1000 * sums["_sum"] / count, 1) if count else None
    return out


def run_cell(runtime: str, mode: str, *, prefill: Sequence[Any], decode: Sequence[Any], spec: Spec,
             work: Path, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """One router (``runtime``, admission ``mode``): the short tenant alone, then under the flood."""
    cell = work / f"{runtime}_{mode}"
    cell.mkdir(parents=True, exist_ok=True)
    short, flood = write_traces(cell, spec)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router_config(cell / "router.toml", port=port, prefill=[e.url for e in prefill], decode=[e.url for e in decode],
                  mode=mode, spec=spec)  # fmt: skip
    router = subprocess.Popen([sys.executable, "-m", "narwhal", "serve", "--config", str(cell / "router.toml"),
                               "--runtime", runtime], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=open(cell / "router.log", "w"))  # fmt: skip
    flooder: subprocess.Popen[bytes] | None = None
    limit = spec.timeout_s + spec.short * spec.short_every_s + 30
    try:
        wait_ready(url)
        _run(bench_command(short, url, "short", cell / "unloaded.jsonl", seed=seed, spec=spec, flood=False),
             cell / "unloaded.txt", limit)  # fmt: skip
        before = sum(e.stats()["completions_ok"] for e in prefill)
        flooder = subprocess.Popen(bench_command(flood, url, "flood", cell / "flood.jsonl", seed=seed + 1, spec=spec,
                                                 flood=True), cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)  # fmt: skip
        _wait_queued(url, 30.0)
        with Sampler(url, prefill) as sampler:
            started = time.monotonic()
            _run(bench_command(short, url, "short", cell / "loaded.jsonl", seed=seed + 2, spec=spec, flood=False),
                 cell / "loaded.txt", limit)  # fmt: skip
            seconds = time.monotonic() - started
        waits = _tenant_waits(url) if mode != "fifo" else {}
        flood_done = sum(e.stats()["completions_ok"] for e in prefill) - before - spec.short
    finally:
        if flooder is not None and flooder.poll() is None:
            flooder.send_signal(signal.SIGINT)
            try:
                flooder.wait(20)
            except subprocess.TimeoutExpired:
                flooder.kill()
        router.terminate()
        try:
            router.wait(30)
        except subprocess.TimeoutExpired:
            router.kill()
    for engine in (*prefill, *decode):  # the flood's aborted legs are gone before the next cell starts
        engine.wait_for(lambda s: s["running"] == 0 and s["waiting"] == 0, timeout=60)
    alone, loaded = _ttft(cell / "unloaded.jsonl"), _ttft(cell / "loaded.jsonl")
    ratio = (loaded["ttft_p90_ms"] / alone["ttft_p90_ms"]) if alone["ttft_p90_ms"] and loaded["ttft_p90_ms"] else None
    return {"runtime": runtime, "admission": mode, "unloaded": alone, "flood": loaded,
            "p90_ratio": None if ratio is None else round(ratio, 2),
            "flood_requests_done": flood_done, "flood_seconds": round(seconds, 1),
            **sampler.means(), **waits}  # fmt: skip


def table(cells: Sequence[dict[str, Any]]) -> str:
    head = ("runtime", "admission", "alone p50", "alone p90", "flood p50", "flood p90", "p90 ratio", "errors",
            "short wait", "router queued", "engine waiting")  # fmt: skip
    rows = [head]
    for c in cells:
        errors = len(c["unloaded"]["errors"]) + (c["flood"]["requests"] - c["flood"]["ok"])
        rows.append((c["runtime"], c["admission"], *(str(c[p][k]) for p in ("unloaded", "flood")
                     for k in ("ttft_p50_ms", "ttft_p90_ms")), f"{c['p90_ratio']}x", str(errors),
                     str(c.get("short_queue_wait_mean_ms", "-")), str(c["router_queued_mean"]),
                     str(c["engine_waiting_mean"])))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)


def start_engines(args: argparse.Namespace, options: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    from narwhal_sim.testing import SimProcess

    prefill = [SimProcess("prefill", speed=args.speed, **options).start() for _ in range(args.prefill)]
    decode = [SimProcess("decode", speed=args.speed, **options).start() for _ in range(args.decode)]
    return prefill, decode


def main(argv: Sequence[str] | None = None, *, engines: Callable[..., tuple[list[Any], list[Any]]] = start_engines
         ) -> int:  # fmt: skip
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Spec()
    p.add_argument("--speed", type=float, default=1.0, help="engine speed (1: the modelled H100 in real time)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--runtimes", default="trio,asyncio")
    p.add_argument("--modes", default=",".join(MODES))
    for field in attrs.fields(Spec):
        p.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--work", default=None, help="keep each cell's configs, logs and per-request results here "
                   "(default: a temporary directory)")  # fmt: skip
    args = p.parse_args(argv)
    spec = Spec(**{f.name: getattr(args, f.name) for f in attrs.fields(Spec)})
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        p.error(f"--modes: each of {', '.join(MODES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefill, decode = engines(args, {"log": "none"})
    cells = []
    wall = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="tenants_bench_") as temporary:
            work = args.work or temporary
            for n, (runtime, mode) in enumerate((r, m) for r in args.runtimes.split(",") for m in modes):
                cells.append(run_cell(runtime, mode, prefill=prefill, decode=decode, spec=spec, work=Path(work),
                                      seed=10 * n))  # fmt: skip
                print(table(cells[-1:]).splitlines()[-1], file=sys.stderr)
    finally:
        for engine in (*prefill, *decode):
            engine.stop()
    report = {"spec": attrs.asdict(spec), "speed": args.speed, "fleet": f"{args.prefill}P{args.decode}D",
              "router_config": router_config(None, port=8000,
                                             prefill=["http://PREFILL"], decode=["http://DECODE"], mode="fair",
                                             spec=spec),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_avg": os.getloadavg()},
              "wall_seconds": round(time.monotonic() - wall, 1), "cells": cells}  # fmt: skip
    (out / "tenants.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(cells))
    print(f"written to {out / 'tenants.json'} ({report['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
