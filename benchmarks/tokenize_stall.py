"""How long the router's event loop stalls while a 48 KB prompt is tokenized: on the loop, or off it.

    python benchmarks/tokenize_stall.py [--requests 20] [--runtime trio asyncio] [--json]

``routing.policy = "kv"`` tokenizes each prompt as the engine does
(``tokenize_bench.py`` measures what that costs). A prompt larger than
``routing.tokenize_inline_max_bytes`` is tokenized in a worker thread
(docs/routing.md, "Tokenizing off the event loop"). This measures what a
client of the router sees meanwhile, black-box, on a ``narwhal serve``
process: one connection asks ``GET /health`` back to back while another
posts 48 KB completions one after another; the longest ``/health`` answer
while a large request is in flight is the loop's stall (the router's own
CPU for a request aside). Two settings, same process layout: the bound at
10^9 bytes (every prompt on the loop, as before) and at its default, 1024
(48 KB off the loop). The engines are two instant simulators (processes);
the tokenizer is ``tokenize_bench.py``'s 32k byte-level BPE.

In process, without sockets, it also times the loop's own share: the
router's ``receive`` of a 48 KB request, and of its ``PromptTokenized``.

And it times one thread against two tokenizing 16 prompts of 48 KB in this
process, and the longest pause of the main thread meanwhile: whether a pool
of two would pay on this 2-core machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tokenize_bench import build_bpe, held_out_text  # noqa: E402

from narwhal_core import (  # noqa: E402
    ClientConnected, ClientData, ControlDone, PromptTokenized, RidSource, Router, StartControl, StartLeg,
    TokenizePrompt,
)
from narwhal_core.auth import Authenticator  # noqa: E402
from narwhal_core.config import config_from_dict  # noqa: E402
from narwhal_runtime.tokenizer import load_tokenizer  # noqa: E402
from narwhal_sim.testing import SimProcess  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default model
SETTINGS = {"inline": 10**9, "off_loop": 1024}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_text(journal: Path, port: int, tokenizer: Path, prefill: str, decode: str, bound: int) -> str:
    return "\n".join([
        "[model]", f'name = "{MODEL}"', f'tokenizer = "{tokenizer}"',
        "[ingress]", f'listen = "127.0.0.1:{port}"',
        "[engine]", f'prefill = ["{prefill}"]', f'decode = ["{decode}"]', 'kv_events = "tcp://{host}:5557"',
        "[routing]", 'policy = "kv"', f"tokenize_inline_max_bytes = {bound}",
        "[journal]", f'path = "{journal}"', 'fsync = "never"', "",
    ])  # fmt: skip


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"narwhal exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("narwhal not ready")


def post(conn: http.client.HTTPConnection, body: bytes) -> float:
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise SystemExit(f"completion answered {response.status}: {data[:300]!r}")
    return time.perf_counter() - started


def measure(port: int, requests: int) -> dict[str, Any]:
    """/health latencies while 48 KB completions run one after another (and, before them, with none)."""
    health: list[tuple[float, float]] = []
    stop = threading.Event()

    def probe() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while not stop.is_set():
            started = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            health.append((started, time.perf_counter() - started))

    text = held_out_text(48 * 1024)
    bodies = [json.dumps({"model": MODEL, "prompt": f"{i} {text}"[: 48 * 1024], "max_tokens": 2}).encode()
              for i in range(requests + 3)]  # fmt: skip
    big = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for body in bodies[:3]:
        post(big, body)  # warm-up
    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(1.0)
    quiet_until = time.perf_counter()
    windows, latencies = [], []
    for body in bodies[3:]:
        started = time.perf_counter()
        latencies.append(post(big, body))
        windows.append((started, time.perf_counter()))
        time.sleep(0.05)
    stop.set()
    prober.join()
    quiet = [lat for at, lat in health if at < quiet_until]
    busy = [lat for at, lat in health if any(s <= at + lat and at <= e for s, e in windows)]
    # Per large request, the longest /health answer that overlapped it: its stall (a loaded machine's
    # own pauses land on some requests, not on most of them: the median over requests is the steady figure).
    stalls = sorted(max((lat for at, lat in health if s <= at + lat and at <= e), default=0.0) for s, e in windows)
    ms = 1000.0
    return {
        "health_quiet_max_ms": max(quiet) * ms, "health_quiet_median_ms": statistics.median(quiet) * ms,
        "health_busy_max_ms": max(busy) * ms, "health_busy_p90_ms": sorted(busy)[int(0.9 * (len(busy) - 1))] * ms,
        "health_busy_median_ms": statistics.median(busy) * ms, "health_busy_count": len(busy),
        "stall_median_ms": statistics.median(stalls) * ms, "stall_p90_ms": stalls[int(0.9 * (len(stalls) - 1))] * ms,
        "completion_median_ms": statistics.median(latencies) * ms, "completion_max_ms": max(latencies) * ms,
    }  # fmt: skip


def run_router(runtime: str, bound: int, work: Path, tokenizer: Path, engines: list[SimProcess],
               requests: int) -> dict[str, Any]:  # fmt: skip
    port = free_port()
    cfg = work / f"{runtime}-{bound}.toml"
    cfg.write_text(config_text(work / f"{runtime}-{bound}.jsonl", port, tokenizer, engines[0].url, engines[1].url,
                               bound))  # fmt: skip
    with open(work / f"{runtime}-{bound}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "narwhal", "serve", "--config", str(cfg), "--runtime", runtime],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
        try:
            wait_ready(port, proc)
            return measure(port, requests)
        finally:
            proc.terminate()
            proc.wait(15)


def bare_router(tokenizer: Any, folder: Path, bound: int) -> Router:
    """A router with policy ``kv``, its engines' first probes answered (no sockets)."""
    config = config_from_dict({
        "model": {"name": MODEL, "tokenizer": str(folder)}, "ingress": {"listen": "127.0.0.1:0"},
        "engine": {"prefill": ["http://10.0.0.1:8000"], "decode": ["http://10.0.0.2:8000"],
                   "kv_events": "tcp://{host}:5557"},
        "routing": {"policy": "kv", "tokenize_inline_max_bytes": bound}, "journal": {"path": "-"},
    }, env={})  # fmt: skip
    router = Router(config, rid_source=RidSource("b"), authenticator=Authenticator.from_config(config.ingress, None),
                    tokenizer=tokenizer)  # fmt: skip
    while (cmd := router.next_output()) is not None:
        if isinstance(cmd, StartControl):
            router.receive(ControlDone(cmd.key, 200), now=0.0)
    return router


def loop_share(tokenizer: Any, folder: Path, bound: int, runs: int = 15) -> dict[str, float]:
    """Milliseconds of ``Router.receive`` for a 48 KB completion (to its first leg), in one or two pieces."""
    body = json.dumps({"model": MODEL, "prompt": held_out_text(48 * 1024), "max_tokens": 2}).encode()
    raw = (b"POST /v1/completions HTTP/1.1\r\nhost: n\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n" % len(body)) + body  # fmt: skip
    admitted, tokenized = [], []
    for i in range(runs):
        router = bare_router(tokenizer, folder, bound)
        while router.next_output() is not None:
            pass
        router.receive(ClientConnected(i, "127.0.0.1", 1000), now=0.0)
        started = time.perf_counter()
        router.receive(ClientData(i, raw), now=0.0)
        admitted.append(time.perf_counter() - started)
        out = list(iter(router.next_output, None))
        asked = [c for c in out if isinstance(c, TokenizePrompt)]
        if asked:
            ids = tuple(tokenizer.prompt_token_ids(asked[0].body, asked[0].chat))  # (the worker thread's part)
            started = time.perf_counter()
            router.receive(PromptTokenized(asked[0].key, ids, None), now=0.0)
            tokenized.append(time.perf_counter() - started)
            out = list(iter(router.next_output, None))
        assert any(isinstance(c, StartLeg) for c in out), "no leg started"
    ms = 1000.0
    return {"admit_min_ms": min(admitted) * ms, "admit_median_ms": statistics.median(admitted) * ms,
            "tokenized_min_ms": min(tokenized) * ms if tokenized else 0.0,
            "tokenized_median_ms": statistics.median(tokenized) * ms if tokenized else 0.0}  # fmt: skip


def pool(tokenizer: Any, threads: int, prompts: int = 16) -> dict[str, float]:
    """Seconds to tokenize ``prompts`` 48 KB prompts with ``threads`` threads, and the main thread's longest pause."""
    bodies = [{"model": MODEL, "prompt": f"{i} " + held_out_text(48 * 1024)} for i in range(prompts)]
    tokenizer.prompt_token_ids(bodies[0], False)
    longest = 0.0
    if threads == 0:  # the machine's own noise: the same loop, nothing tokenized, for a second
        started = last = time.perf_counter()
        while (now := time.perf_counter()) < started + 1.0:
            longest, last = max(longest, now - last), now
        return {"seconds": 0.0, "main_thread_longest_pause_ms": longest * 1000}
    with ThreadPoolExecutor(threads) as executor:
        started = last = time.perf_counter()
        futures = [executor.submit(tokenizer.prompt_token_ids, b, False) for b in bodies]
        while not all(f.done() for f in futures):
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        took = time.perf_counter() - started
    return {"seconds": took, "main_thread_longest_pause_ms": longest * 1000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="48 KB completions per setting")
    parser.add_argument("--runtime", nargs="+", default=["trio", "asyncio"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_bpe(work / "bpe", 32000, 8.0)
        tok = load_tokenizer(str(work / "bpe"))
        pools = {n: pool(tok, n) for n in (0, 1, 2)}
        shares = {name: loop_share(tok, work / "bpe", bound) for name, bound in SETTINGS.items()}
        engines = [SimProcess("prefill", speed=0), SimProcess("decode", speed=0)]
        for engine in engines:
            engine.start()
        try:
            for runtime in args.runtime:
                for name, bound in SETTINGS.items():
                    rows.append({"runtime": runtime, "setting": name, "bound": bound,
                                 **run_router(runtime, bound, work, work / "bpe", engines, args.requests)})  # fmt: skip
        finally:
            for engine in engines:
                engine.stop(5)
    load = os.getloadavg()[0]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        print(json.dumps({"pool": pools, "loop_share": shares, "load": load}))
        return 0
    print(f"load average {load:.2f} on {os.cpu_count()} cores; {args.requests} completions of 48 KB per setting")
    print("| runtime | 48 KB tokenized | stall per request: median / p90 / max ms | /health during them: median ms "
          "| /health quiet: median / max ms | completion median / max ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['runtime']} | {r['setting'].replace('_', ' ')} | {r['stall_median_ms']:.1f} / "
              f"{r['stall_p90_ms']:.1f} / {r['health_busy_max_ms']:.1f} | {r['health_busy_median_ms']:.2f} | "
              f"{r['health_quiet_median_ms']:.2f} / {r['health_quiet_max_ms']:.1f} | "
              f"{r['completion_median_ms']:.1f} / {r['completion_max_ms']:.1f} |")
    for name, share in shares.items():
        print(f"Router.receive, 48 KB, tokenized {name.replace('_', ' ')}: admission {share['admit_min_ms']:.2f} ms "
              f"(median {share['admit_median_ms']:.2f})" + (f", PromptTokenized {share['tokenized_min_ms']:.2f} ms "
              f"(median {share['tokenized_median_ms']:.2f})" if share["tokenized_median_ms"] else ""))
    for n, p in pools.items():
        what = f"16 prompts of 48 KB in {p['seconds'] * 1000:.0f} ms" if n else "nothing tokenized, 1 s"
        print(f"{n} thread(s): {what}; main thread's longest pause {p['main_thread_longest_pause_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
