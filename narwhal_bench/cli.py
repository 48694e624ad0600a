"""``narwhal bench``: replay a trace (or generated sessions) and report TTFT, ITL and goodput.

See docs/bench.md. Three ways to run it:

* against any OpenAI-compatible endpoint: ``--base-url http://HOST:PORT``;
* in virtual time, the router core in front of modelled engines, no sockets:
  ``--virtual --fleet 4P2D``;
* plotting earlier runs only: ``--plot FILE.png --results A.jsonl [B.jsonl ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from narwhal_bench.stats import RequestResult, format_summary, prefix_hit_rate, read_results, summarize
from narwhal_bench.trace import (
    PromptSynth,
    SessionWorkload,
    TraceError,
    TraceRequest,
    generate_sessions,
    limit,
    load_mooncake,
    scale_arrivals,
)

__all__ = ["main", "build_parser", "workload"]

API_KEY_ENV = "NARWHAL_BENCH_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="narwhal bench",
        description="Replay a Mooncake-format trace or generated chat sessions against an OpenAI-compatible "
        "endpoint (or a virtual fleet) and report TTFT, ITL, throughput and goodput. See docs/bench.md.",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--trace", metavar="FILE", help="Mooncake-format JSON lines (timestamp ms, input_length, "
                   "output_length, hash_ids of 512-token blocks)")  # fmt: skip
    w.add_argument("--generate", action="store_true", help="use the built-in session generator instead")
    d = SessionWorkload()
    w.add_argument("--sessions", type=int, default=d.sessions, help="generator: sessions")
    w.add_argument("--turns", type=int, default=d.turns, help="generator: turns per session")
    w.add_argument("--system-prompts", type=int, default=d.system_prompts, help="generator: shared system prompts")
    w.add_argument("--system-tokens", type=int, default=d.system_tokens, help="generator: system prompt tokens")
    w.add_argument("--user-tokens", type=int, default=d.user_tokens, help="generator: mean user message tokens")
    w.add_argument("--output-tokens", type=int, default=d.output_tokens, help="generator: mean output tokens")
    w.add_argument("--session-rate", type=float, default=d.session_rate,
                   help="generator: new sessions per second (Poisson)")  # fmt: skip
    w.add_argument("--think-s", type=float, default=d.think_s, help="generator: mean seconds between turns")
    w.add_argument("--seed", type=int, default=0, help="generator and prompt text seed (default 0)")
    w.add_argument("--token-ids", action="store_true", help="send prompts as token ids instead of text")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times (0.25 replays 4x faster; default 1)")  # fmt: skip
    w.add_argument("--request-rate-scale", type=float, default=1.0,
                   help="divide arrival times (2 doubles the request rate; default 1)")  # fmt: skip
    w.add_argument("--max-requests", type=int, default=None, help="send at most this many requests")
    w.add_argument("--duration", type=float, default=None,
                   help="send only requests arriving in the first SECONDS (after scaling)")  # fmt: skip

    t = p.add_argument_group("target")
    t.add_argument("--base-url", help="the endpoint, http://HOST:PORT (the router or one engine)")
    t.add_argument("--endpoint", default="/v1/completions", help="route (default /v1/completions; "
                   "/v1/chat/completions sends the prompt as one user message)")  # fmt: skip
    t.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct", help="model name sent")
    t.add_argument("--api-key", default=None, help=f"bearer credential (default: ${API_KEY_ENV})")
    t.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                   help="an extra request header, e.g. x-narwhal-client:tenant-a (the client a trusted proxy "
                   "names); repeatable")  # fmt: skip
    t.add_argument("--client", choices=("raw", "openai"), default="raw",
                   help="raw: the lean socket client (default); openai: each request through the openai "
                   "package's AsyncOpenAI, as an application sends it")  # fmt: skip
    t.add_argument("--no-stream", action="store_true", help="ask for whole answers (TTFT = end-to-end)")
    t.add_argument("--concurrency", type=int, default=0, help="most requests outstanding at once (0: no cap)")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    t.add_argument("--engine-metrics", nargs="+", metavar="URL", default=(),
                   help="engine base URLs whose /metrics are scraped before and after (prefix hit rate)")  # fmt: skip

    v = p.add_argument_group("virtual fleet")
    v.add_argument("--virtual", action="store_true", help="replay in virtual time: router core + modelled engines")
    v.add_argument("--fleet", default="4P2D", help="engines: e.g. 4P2D (4 prefill, 2 decode) or 2M (mixed)")
    v.add_argument("--engine-option", action="append", default=[], metavar="NAME=VALUE",
                   help="engine model setting (a narwhal sim flag name without dashes, e.g. "
                   "prefill_per_token_ms=0.1); repeatable")  # fmt: skip
    v.add_argument("--router-config", metavar="FILE", help="router TOML config for the virtual fleet "
                   "(its engine lists are replaced by the fleet's)")  # fmt: skip
    v.add_argument("--virtual-relay", choices=("run", "token"), default="run",
                   help="run: a run of identical decode steps reaches the router in one read, each token "
                   "timed at its own step (fast; default); token: one read per token")  # fmt: skip

    o = p.add_argument_group("output")
    o.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput, milliseconds")
    o.add_argument("--slo-itl-ms", type=float, default=None,
                   help="ITL SLO for goodput (a request's mean inter-token time), milliseconds")  # fmt: skip
    o.add_argument("--output", metavar="FILE", help="per-request results as JSON lines")
    o.add_argument("--summary-json", metavar="FILE", help="the summary as JSON")
    o.add_argument("--label", default=None, help="this run's name in the table and plot")
    o.add_argument("--plot", metavar="FILE.png", help="draw TTFT CDF and goodput (needs matplotlib)")
    o.add_argument("--results", nargs="+", metavar="FILE", default=(),
                   help="earlier --output files to plot beside this run (or alone)")  # fmt: skip
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def workload(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace and args.generate:
        raise TraceError("give --trace FILE or --generate, not both")
    if args.trace:
        requests = load_mooncake(args.trace)
    else:
        spec = SessionWorkload(
            sessions=args.sessions, turns=args.turns, system_prompts=args.system_prompts,
            system_tokens=args.system_tokens, user_tokens=args.user_tokens, output_tokens=args.output_tokens,
            session_rate=args.session_rate, think_s=args.think_s, seed=args.seed,
        )  # fmt: skip
        requests = generate_sessions(spec)
    requests = scale_arrivals(requests, time_scale=args.time_scale, rate_scale=args.request_rate_scale)
    return limit(requests, max_requests=args.max_requests, duration_s=args.duration)


def parse_header(text: str) -> tuple[str, str]:
    """``NAME:VALUE`` as a header (name, value); ValueError when it cannot be sent as one."""
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not name or not all(c.isalnum() or c in "!#$%&'*+-.^_`|~" for c in name) or not name.isascii():
        raise ValueError(f"--header wants NAME:VALUE with a header name before the colon, got {text!r}")
    if not value.isascii() or not value.isprintable():
        raise ValueError(f"--header {name}: the value must be printable ASCII")
    return name, value


def _label_of(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    slo_ttft = args.slo_ttft_ms / 1000.0 if args.slo_ttft_ms is not None else None
    slo_itl = args.slo_itl_ms / 1000.0 if args.slo_itl_ms is not None else None
    runs: list[tuple[str, list[RequestResult]]] = []
    for path in args.results:
        try:
            with open(path, "rb") as f:
                runs.append((_label_of(path), read_results(f)))
        except (OSError, ValueError) as exc:
            print(f"narwhal bench: cannot read results {path}: {exc}", file=sys.stderr)
            return 2

    running = bool(args.trace or args.generate)
    if not running:
        if not (args.plot and runs):
            parser.print_usage(sys.stderr)
            print("narwhal bench: give --trace FILE or --generate (or --plot FILE.png --results FILE...)",
                  file=sys.stderr)  # fmt: skip
            return 2
        for label, results in runs:
            print(format_summary(summarize(results, slo_ttft_s=slo_ttft, slo_itl_s=slo_itl), title=label))
        return _plot(runs, args, slo_ttft, slo_itl)

    if args.virtual == bool(args.base_url):
        print("narwhal bench: give exactly one of --base-url URL or --virtual", file=sys.stderr)
        return 2
    try:
        requests = workload(args)
    except TraceError as exc:
        print(f"narwhal bench: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print("narwhal bench: the workload is empty", file=sys.stderr)
        return 2
    try:
        headers = tuple(parse_header(h) for h in args.header)
    except ValueError as exc:
        print(f"narwhal bench: {exc}", file=sys.stderr)
        return 2
    if args.client == "openai" and args.virtual:
        print("narwhal bench: --client openai sends over sockets: give --base-url, not --virtual", file=sys.stderr)
        return 2
    synth = PromptSynth(seed=args.seed, token_ids=args.token_ids)
    from narwhal_bench.client import Progress, Target

    progress = None if args.no_progress else Progress(len(requests))
    target = Target(
        base_url=args.base_url or "http://virtual",
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key or os.environ.get(API_KEY_ENV),
        stream=not args.no_stream,
        timeout_s=args.timeout,
        headers=headers,
        client=args.client,
    )
    hit_rate = None
    extra: dict[str, object] = {}
    wall = time.perf_counter()
    if args.virtual:
        from narwhal_bench.virtual import FleetError, run_virtual

        try:
            outcome = run_virtual(requests, target, synth=synth, fleet=args.fleet, engine_options=args.engine_option,
                                  router_config=args.router_config, concurrency=args.concurrency,
                                  progress=progress, relay=args.virtual_relay)  # fmt: skip
        except FleetError as exc:
            print(f"narwhal bench: {exc}", file=sys.stderr)
            return 2
        results = outcome.results
        hit_rate = outcome.hit_rate
        wall = time.perf_counter() - wall
        trace_s = max((r.sent_s + (r.e2e_s or 0.0) for r in results), default=0.0)
        extra = {"virtual_seconds": trace_s, "wall_seconds": wall, "speedup": trace_s / wall if wall > 0 else None}
    else:
        from narwhal_bench.client import run_replay, scrape_metrics

        try:
            target.address()
            if target.client == "openai":
                from narwhal_bench.sdk import api_base

                api_base(target.base_url, target.endpoint)
        except ValueError as exc:
            print(f"narwhal bench: {exc}", file=sys.stderr)
            return 2
        try:
            before = scrape_metrics(args.engine_metrics) if args.engine_metrics else None
        except Exception as exc:  # noqa: BLE001 - any scrape failure is reported the same way
            print(f"narwhal bench: cannot scrape engine metrics: {exc}", file=sys.stderr)
            return 2
        results = run_replay(requests, target, synth=synth, concurrency=args.concurrency, progress=progress)
        wall = time.perf_counter() - wall
        if before is not None:
            try:
                hit_rate = prefix_hit_rate(before, scrape_metrics(args.engine_metrics))
            except Exception as exc:  # noqa: BLE001
                print(f"narwhal bench: cannot scrape engine metrics after the run: {exc}", file=sys.stderr)
    label = args.label or ("virtual " + args.fleet if args.virtual else "run")
    summary = summarize(results, slo_ttft_s=slo_ttft, slo_itl_s=slo_itl)
    print(format_summary(summary, hit_rate=hit_rate, title=label))
    if args.virtual:
        print(f"virtual replay: {extra['virtual_seconds']:.1f} trace seconds in {wall:.1f} wall seconds "
              f"({extra['speedup'] or 0:.1f} trace s per wall s)")  # fmt: skip
    if args.output:
        with open(args.output, "wb") as f:
            for r in results:
                f.write(r.to_json() + b"\n")
    if args.summary_json:
        data = {"label": label, **summary.to_json(), **extra}
        if hit_rate is not None:
            data["prefix_hit_rate"] = hit_rate.rate
            data["prefix_hit_rate_per_engine"] = dict(hit_rate.per_engine)
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    if args.plot:
        runs.insert(0, (label, results))
        return _plot(runs, args, slo_ttft, slo_itl)
    return 0


def _plot(runs: list[tuple[str, list[RequestResult]]], args: argparse.Namespace,
          slo_ttft: float | None, slo_itl: float | None) -> int:  # fmt: skip
    from narwhal_bench.plot import PlotError, plot_runs

    try:
        plot_runs(runs, args.plot, slo_ttft_s=slo_ttft, slo_itl_s=slo_itl)
    except PlotError as exc:
        print(f"narwhal bench: {exc}", file=sys.stderr)
        return 2
    print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
