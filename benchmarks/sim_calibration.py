"""Does the simulator's latency model behave as documented? (docs/simulator.md, "Latency model")

Starts one ``mixed`` engine as a subprocess (default flags, ``--speed 1``
unless told otherwise) and measures, over real sockets:

1. time to first token against prompt length — expected
   ``(prefill_base_ms + prefill_per_token_ms × uncached tokens) / speed``,
   and again for the same prompt, which now hits the prefix cache;
2. inter-token latency against the running batch — expected
   ``(decode_step_ms + decode_per_seq_ms × (batch − 1)) / speed``.

Prints measured against modelled values. Not run in CI.

    python benchmarks/sim_calibration.py [--speed 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import orjson

from narwhal_sim.model import CHARS_PER_TOKEN, LatencyModel
from narwhal_sim.testing import SimProcess

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


async def ttft_table(port: int, model: LatencyModel, speed: float, repeats: int) -> None:
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
        expected = model.prefill_s(tokens) / speed * 1000
        expected_cached = model.prefill_s(tokens - hit) / speed * 1000
        print(f"{tokens:>14}{expected:>10.1f}{statistics.median(fresh) * 1000:>10.1f}"
              f"{expected_cached:>14.1f}{statistics.median(cached) * 1000:>14.1f}")  # fmt: skip


async def itl_table(port: int, model: LatencyModel, speed: float, tokens: int) -> None:
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
        expected = model.itl_s(batch) / speed * 1000
        print(f"{batch:>8}{expected:>10.2f}{statistics.median(gaps) * 1000:>10.2f}"
              f"{gaps[int(len(gaps) * 0.9)] * 1000:>8.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per stream in the ITL runs")
    args = parser.parse_args()
    model = LatencyModel()
    with SimProcess("mixed", speed=args.speed, max_num_seqs=256) as sim:
        print(f"engine {sim.url}: speed {args.speed}, defaults {model}")
        asyncio.run(ttft_table(sim.port, model, args.speed, args.repeats))
        asyncio.run(itl_table(sim.port, model, args.speed, args.tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
