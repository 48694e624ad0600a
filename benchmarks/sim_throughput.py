"""How many requests per second one simulated engine serves on one core at ``--speed 0``.

The simulator must not be the bottleneck of the router's benchmarks (the
router's CPU per request: benchmarks/README.md). This starts ``python -m narwhal_sim`` pinned
to one core (``taskset``-style, via ``sched_setaffinity``), drives it from a
lean closed-loop client pinned to another core over keep-alive connections,
and reports requests/s and the engine's CPU time per request (from
``/proc/<pid>/stat``, 10 ms ticks), which is the figure that does not depend on the client.

Scenarios:

* ``health``      ``GET /health``
* ``completion``  ``POST /v1/completions``, 16 tokens, non-streaming (mixed engine)
* ``distinct``    the same with a different prompt of the same length each time
                  (its block hashes are computed, it never hits the prefix cache)
* ``stream``      the same, streamed (16 SSE events + ``[DONE]``)
* ``chat``        ``POST /v1/chat/completions``, 16 tokens
* ``prefill``     a prefill leg (``do_remote_decode``; holds KV until the lease)
* ``pd``          prefill leg, then decode leg with its ``kv_transfer_params``
                  (the decode engine pulls KV from the prefill engine): both
                  engines on the same core, so each pair costs 3 requests there

Usage::

    python benchmarks/sim_throughput.py [--seconds 5] [--connections 32] [--engine-core 1] [--client-core 0]

Not run in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httptools
import orjson

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "Narwhals are medium-sized toothed whales that live year-round in the Arctic. " * 3  # ~60 tokens


class Connection(asyncio.Protocol):
    """A keep-alive client connection: one request at a time, httptools parsing."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.waiter is not None
        self.waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("engine closed the connection"))

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        self.body = []
        self.waiter = self.loop.create_future()
        assert self.transport is not None
        self.transport.write(data)
        return self.waiter


def post(path: str, payload: dict[str, Any], rid: str = "bench") -> bytes:
    body = orjson.dumps(payload)
    return (
        b"POST %s HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\nX-Request-Id: %s\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), rid.encode(), len(body), body)
    )


def start_engine(role: str, core: int | None, extra: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    cmd = [sys.executable, "-m", "narwhal_sim", "--role", role, "--listen", "127.0.0.1:0", "--speed", "0",
           "--log", "none", *extra]  # fmt: skip
    preexec: Callable[[], None] | None = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, preexec_fn=preexec)
    assert proc.stdout is not None
    line = json.loads(proc.stdout.readline())
    return proc, int(line["port"])


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(
    ports: dict[str, int], pids: list[int], scenario: str, connections: int, seconds: float
) -> tuple[int, float, float, float]:
    """Run ``connections`` closed-loop workers for ``seconds`` after a warm-up.

    Returns (operations completed, wall seconds, engine CPU seconds, client CPU seconds) of the window.
    """
    loop = asyncio.get_running_loop()
    done = 0
    stop = False

    async def open_conn(port: int) -> Connection:
        _, conn = await loop.create_connection(lambda: Connection(loop), "127.0.0.1", port)
        return conn

    async def worker(index: int) -> None:
        nonlocal done
        if scenario == "pd":
            p = await open_conn(ports["prefill"])
            d = await open_conn(ports["decode"])
            seq = 0
            while not stop:
                seq += 1
                status, body = await p.request(post("/v1/completions", {
                    "model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}, f"w{index}-{seq}-p"))  # fmt: skip
                assert status == 200, body
                kv = orjson.loads(body)["kv_transfer_params"]
                status, body = await d.request(post("/v1/completions", {
                    "model": MODEL, "prompt": PROMPT, "max_tokens": 16, "kv_transfer_params": kv},
                    f"w{index}-{seq}-d"))  # fmt: skip
                assert status == 200, body
                done += 1
            return
        conn = await open_conn(ports["engine"])
        if scenario == "health":
            data = b"GET /health HTTP/1.1\r\nHost: sim\r\n\r\n"
        elif scenario == "chat":
            data = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                                                 "max_tokens": 16})  # fmt: skip
        elif scenario == "prefill":
            data = post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                            "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
        else:
            data = post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 16,
                                            "stream": scenario == "stream"})  # fmt: skip
        seq = 0
        while not stop:
            if scenario == "distinct":
                # A new prompt each time (same length): no remembered hashes, no prefix hits.
                seq += 1
                prompt = f"{index}-{seq}|" + PROMPT[len(f"{index}-{seq}|"):]
                data = post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 16})
            status, body = await conn.request(data)
            assert status == 200, body
            done += 1

    tasks = [loop.create_task(worker(i)) for i in range(connections)]
    await asyncio.sleep(0.5)  # warm up
    engine_before, client_before = sum(map(cpu_seconds, pids)), time.process_time()
    start_done, started = done, time.perf_counter()
    await asyncio.sleep(seconds)
    count, elapsed = done - start_done, time.perf_counter() - started
    engine_cpu = sum(map(cpu_seconds, pids)) - engine_before
    client_cpu = time.process_time() - client_before
    stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    return count, elapsed, engine_cpu, client_cpu


def run_scenario(scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    # Short prompts hold 4 blocks; enough blocks that leases never throttle the run.
    extra = ["--num-gpu-blocks", "200000", "--kv-lease-s", "3", "--loop", args.loop]
    procs: list[subprocess.Popen[bytes]] = []
    ports: dict[str, int] = {}
    try:
        if scenario == "pd":
            for role in ("prefill", "decode"):
                proc, ports[role] = start_engine(role, args.engine_core, extra)
                procs.append(proc)
        else:
            role = "prefill" if scenario == "prefill" else "mixed"
            proc, ports["engine"] = start_engine(role, args.engine_core, extra)
            procs.append(proc)
        pids = [p.pid for p in procs]
        count, elapsed, engine_cpu, client_cpu = asyncio.run(
            drive(ports, pids, scenario, args.connections, args.seconds)
        )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    engine_requests = count * 3 if scenario == "pd" else count
    return {
        "scenario": scenario,
        "ops_per_s": count / elapsed,
        "engine_requests_per_s": engine_requests / elapsed,
        "engine_cpu_pct": 100 * engine_cpu / elapsed,
        "engine_us_per_request": 1e6 * engine_cpu / max(engine_requests, 1),
        "client_cpu_pct": 100 * client_cpu / elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--engine-core", type=int, default=1, help="core the engine(s) run on (-1: unpinned)")
    parser.add_argument("--client-core", type=int, default=0, help="core the load generator runs on (-1: unpinned)")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto", help="engine event loop")
    parser.add_argument("scenarios", nargs="*",
                        default=["health", "completion", "distinct", "stream", "chat", "prefill", "pd"])
    args = parser.parse_args()
    if args.engine_core < 0:
        args.engine_core = None
    if args.client_core >= 0:
        os.sched_setaffinity(0, {args.client_core})
    try:
        import uvloop

        uvloop.install()
        client_loop = "uvloop"
    except ImportError:
        client_loop = "asyncio"
    print(f"engine on core {args.engine_core}, client on core {args.client_core} ({client_loop}), "
          f"{args.connections} connections, {args.seconds:.0f} s per scenario, engine loop {args.loop}")  # fmt: skip
    print(f"{'scenario':<12}{'ops/s':>10}{'engine req/s':>14}{'engine CPU':>12}{'µs CPU/req':>12}{'client CPU':>12}")
    for scenario in args.scenarios:
        r = run_scenario(scenario, args)
        print(f"{r['scenario']:<12}{r['ops_per_s']:>10.0f}{r['engine_requests_per_s']:>14.0f}"
              f"{r['engine_cpu_pct']:>11.0f}%{r['engine_us_per_request']:>12.1f}{r['client_cpu_pct']:>11.0f}%")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
