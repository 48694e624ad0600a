"""Does the simulator's latency model behave as documented? (docs/simulator.md, "Latency model")

Starts one ``mixed`` engine as a subprocess (default flags, ``--speed 1``
unless told otherwise) and measures, over real sockets:

1. time to first token against prompt length, alone — expected: one step per
   ``max_num_batched_tokens`` chunk, ``Σ (step_base_ms + prefill_per_token_ms × chunk)``,
   divided by the speed; and again for the same prompt, which now hits the prefix cache;
2. inter-token latency against the running batch — expected
   ``(step_base_ms + decode_per_seq_ms × batch) / speed``;
3. time to first token against offered prefill load (prompt tokens per second
   of modelled time, Poisson arrivals of 2,048-token prompts): the engine's
   prefill throughput is the knee. Each point is also replayed through the pure
   engine core in virtual time (:mod:`narwhal_sim.engine`) with the same
   arrivals: the "model" columns; "measured" is the real engine over HTTP.

Prints measured against modelled values. Not run in CI.

    python benchmarks/sim_calibration.py [--speed 1] [--repeats 3] [--load-speed 4] [--load-seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import Any

import orjson

from narwhal_sim.engine import EngineCore, EngineRequest, StepConfig, Tokens
from narwhal_sim.testing import SimProcess
from narwhal_sim.tokens import CHARS_PER_TOKEN

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


async def stream_times(port: int, body: dict[str, Any]) -> list[float]:
    """Arrival time (perf_counter) of each streamed token event, after the request was sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = orjson.dumps(body)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    sent = time.perf_counter()
    await writer.drain()
    times = [sent]
    while True:
        line = await reader.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            if line.startswith(b"data: [DONE]"):
                break
            times.append(time.perf_counter())
    writer.close()
    return times


def lone_ttft_s(model: StepConfig, tokens: int) -> float:
    """Modelled time to first token of a prompt alone on the engine: one step per budget-sized chunk."""
    total, left = 0.0, tokens
    while left > 0:
        chunk = min(left, model.max_num_batched_tokens)
        total += model.step_s(chunk, 0)
        left -= chunk
    return total


async def ttft_table(port: int, model: StepConfig, speed: float, repeats: int) -> None:
    print("\nTime to first token against prompt length (ms)")
    print(f"{'prompt tokens':>14}{'model':>10}{'measured':>10}{'cached model':>14}{'cached meas.':>14}")
    for tokens in (16, 256, 1024, 4096, 16384, 32768):
        fresh, cached = [], []
        for r in range(repeats):
            # A unique first block per repeat: the first request misses the prefix cache.
            prompt = f"{tokens}-{r}-{time.time_ns()}|".ljust(CHARS_PER_TOKEN * tokens, "p")
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": True}
            t = await stream_times(port, body)
            fresh.append(t[1] - t[0])
            t = await stream_times(port, body)
            cached.append(t[1] - t[0])
        hit = (tokens - 1) // 16 * 16
        expected = lone_ttft_s(model, tokens) / speed * 1000
        expected_cached = lone_ttft_s(model, tokens - hit) / speed * 1000
        print(f"{tokens:>14}{expected:>10.1f}{statistics.median(fresh) * 1000:>10.1f}"
              f"{expected_cached:>14.1f}{statistics.median(cached) * 1000:>14.1f}")  # fmt: skip


async def itl_table(port: int, model: StepConfig, speed: float, tokens: int) -> None:
    print("\nInter-token latency against running batch (ms, median over steady-state tokens)")
    print(f"{'batch':>8}{'model':>10}{'measured':>10}{'p90':>8}")
    for batch in (1, 8, 32, 64, 128, 256):
        body = {"model": MODEL, "prompt": "itl", "max_tokens": tokens, "stream": True}
        runs = await asyncio.gather(*(stream_times(port, body) for _ in range(batch)))
        gaps: list[float] = []
        for times in runs:
            steady = times[1 + tokens // 4 : 1 + tokens - tokens // 4]  # while every stream is running
            gaps += [b - a for a, b in zip(steady, steady[1:], strict=False)]
        gaps.sort()
        expected = model.step_s(0, batch) / speed * 1000
        print(f"{batch:>8}{expected:>10.2f}{statistics.median(gaps) * 1000:>10.2f}"
              f"{gaps[int(len(gaps) * 0.9)] * 1000:>8.2f}")  # fmt: skip


LOAD_PROMPT_TOKENS = 2048


def arrivals(rate_per_s: float, seconds: float, seed: int) -> list[float]:
    """Poisson arrival times (modelled seconds) at ``rate_per_s`` over ``seconds``."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= seconds:
            return out
        out.append(t)


def virtual_ttfts(model: StepConfig, times: list[float]) -> list[float]:
    """TTFT of each arrival, replayed through the pure engine core in virtual time."""
    core = EngineCore(model)
    first: dict[str, float] = {}
    pending = [(t, f"v{i}") for i, t in enumerate(times)]
    pending.reverse()
    while pending or not core.idle:
        next_step = core.next_event_time()
        if pending and (next_step is None or pending[-1][0] <= next_step):
            t, rid = pending.pop()
            core.add_request(EngineRequest(request_id=rid, prompt_tokens=LOAD_PROMPT_TOKENS, max_tokens=1), now=t)
            outputs = core.advance(now=t)
        else:
            assert next_step is not None
            outputs = core.advance(now=next_step)
        for out in outputs:
            if isinstance(out, Tokens) and out.request_id not in first:
                first[out.request_id] = out.at
    return [first[f"v{i}"] - t for i, t in enumerate(times)]


async def one_prefill(port: int, prompt: str) -> float:
    """Seconds until the whole one-token answer arrived (its TTFT)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})
    started = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
    await reader.read()
    writer.close()
    return time.perf_counter() - started


async def measured_ttfts(port: int, times: list[float], speed: float, tag: str) -> list[float]:
    start = time.perf_counter() + 0.05

    async def fire(i: int, at: float) -> float:
        await asyncio.sleep(max(start + at / speed - time.perf_counter(), 0))
        # A unique first block per request: no prefix-cache hits.
        prompt = f"{tag}-{i}|".ljust(CHARS_PER_TOKEN * LOAD_PROMPT_TOKENS, "q")
        return await one_prefill(port, prompt) * speed

    return list(await asyncio.gather(*(fire(i, at) for i, at in enumerate(times))))


def load_table(port: int, model: StepConfig, speed: float, seconds: float) -> None:
    capacity = model.max_num_batched_tokens / model.step_s(model.max_num_batched_tokens, 0)
    print(f"\nTime to first token against offered prefill load ({LOAD_PROMPT_TOKENS}-token prompts, Poisson, "
          f"{seconds:.0f} s modelled per point at speed {speed}; capacity {capacity:,.0f} prompt tokens/s)")  # fmt: skip
    print(f"{'offered tok/s':>14}{'load':>6}{'model p50':>11}{'model p90':>11}{'meas. p50':>11}{'meas. p90':>11}  (ms)")
    for share in (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25):
        offered = share * capacity
        times = arrivals(offered / LOAD_PROMPT_TOKENS, seconds, seed=int(share * 100))
        model_t = sorted(virtual_ttfts(model, times))
        real_t = sorted(asyncio.run(measured_ttfts(port, times, speed, f"load{share}-{time.time_ns()}")))

        def pct(xs: list[float], q: float) -> float:
            return xs[min(int(len(xs) * q), len(xs) - 1)] * 1000

        print(f"{offered:>14,.0f}{share:>6.2f}{pct(model_t, 0.5):>11.0f}{pct(model_t, 0.9):>11.0f}"
              f"{pct(real_t, 0.5):>11.0f}{pct(real_t, 0.9):>11.0f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per stream in the ITL runs")
    parser.add_argument("--load-speed", type=float, default=4.0, help="speed of the engine in the load runs")
    parser.add_argument("--load-seconds", type=float, default=20.0, help="modelled seconds per load point")
    parser.add_argument("--only", choices=("ttft", "itl", "load"), action="append", help="run only these tables")
    args = parser.parse_args()
    model = StepConfig()
    tables = set(args.only or ("ttft", "itl", "load"))
    if tables & {"ttft", "itl"}:
        with SimProcess("mixed", speed=args.speed, max_num_seqs=256) as sim:
            print(f"engine {sim.url}: speed {args.speed}, defaults {model}")
            if "ttft" in tables:
                asyncio.run(ttft_table(sim.port, model, args.speed, args.repeats))
            if "itl" in tables:
                asyncio.run(itl_table(sim.port, model, args.speed, args.tokens))
    if "load" in tables:
        with SimProcess("prefill", speed=args.load_speed, max_num_seqs=256) as sim:
            load_table(sim.port, model, args.load_speed, args.load_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
