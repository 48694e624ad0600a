"""``narwhal sim`` / ``python -m narwhal_sim``: run one simulated engine.

On start it prints exactly one JSON line to stdout::

    {"event": "listening", "host": "127.0.0.1", "port": 8100, "role": "prefill",
     "url": "http://127.0.0.1:8100", "engine_id": "sim-prefill-..."}

and serves until SIGTERM or SIGINT, then exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import attrs

from narwhal_sim.model import ROLES, Faults, FaultsError
from narwhal_sim.server import DEFAULT_MODEL, SimConfig, SimEngine
from narwhal_sim.sglang import SglangEngine

__all__ = ["main", "build_parser", "config_from_args", "parse_listen", "run"]

_DEFAULTS = SimConfig()
_FAULT_DEFAULTS = Faults()


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` (all interfaces)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen must be HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", int(port)


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr (``narwhal sim: error: …``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str = "narwhal sim") -> argparse.ArgumentParser:
    """The argument parser; every flag has a documented default."""
    p = _Parser(
        prog=prog,
        description="Run a simulated vLLM-compatible engine that speaks Narwhal's PD protocol.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = _DEFAULTS
    p.add_argument("--role", choices=ROLES, default=d.role, help="prefill, decode, or mixed (both)")
    p.add_argument("--protocol", choices=("vllm", "sglang"), default=d.protocol,
                   help="the engine's PD protocol: vLLM's NIXL pull, or SGLang's bootstrap rooms "
                        "(docs/simulator.md, 'SGLang PD')")  # fmt: skip
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on; port 0 picks a free one")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds output text, KV owner suffixes and faults")
    p.add_argument("--speed", type=float, default=d.speed,
                   help="divide every modelled time by this; 0 answers at once (no sleeps)")  # fmt: skip
    p.add_argument("--api-key-env", metavar="VAR", default=None,
                   help="require 'Authorization: Bearer $VAR' on every route but /sim/*")  # fmt: skip
    p.add_argument("--engine-id", default=None, help="remote_engine_id (default: random per start)")
    p.add_argument("--advertise-host", default=None,
                   help="remote_host given to decode engines (default: localhost, vLLM's "
                        "VLLM_NIXL_SIDE_CHANNEL_HOST default)")  # fmt: skip
    p.add_argument("--tp-size", type=int, default=d.tp_size, help="tp_size reported in kv_transfer_params")

    s = p.add_argument_group("SGLang PD (--protocol sglang; docs/simulator.md, 'SGLang PD')")
    s.add_argument("--bootstrap-port", type=int, default=d.bootstrap_port,
                   help="SGLang's --disaggregation-bootstrap-port: a prefill engine's bootstrap server; 0 picks one")
    s.add_argument("--bootstrap-timeout-s", type=float, default=d.bootstrap_timeout_s,
                   help="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT: a prefill room's wait for its decode side")
    s.add_argument("--waiting-timeout-s", type=float, default=d.waiting_timeout_s,
                   help="SGLANG_DISAGGREGATION_WAITING_TIMEOUT: a decode request's wait for its room's KV")

    v = p.add_argument_group("vLLM version (docs/simulator.md, 'vLLM versions')")
    v.add_argument("--vllm-version", default=None, metavar="VERSION",
                   help="the vLLM modelled: a family (0.9, 0.10, 0.11, 0.14, 0.18, lease, 0.28) or a release like "
                        "0.14.1 (default: 0.28, current vLLM)")  # fmt: skip
    v.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="fill usage.prompt_tokens_details (else null, as vLLM without this flag)")  # fmt: skip
    v.add_argument("--tokens-only", action="store_true",
                   help="vLLM's --tokens-only: serve POST /abort_requests (0.14 family on)")  # fmt: skip
    v.add_argument("--dev-mode", action="store_true",
                   help="vLLM's VLLM_SERVER_DEV_MODE: POST /abort_requests answering {status, aborted}")  # fmt: skip
    v.add_argument("--abort-request-route", nargs="?", const="json", default=False, choices=("json", "bare"),
                   help="serve the simulator's own POST /abort_request (no vLLM has it): json answers "
                        "{released}, bare answers 200 with no body as SGLang")  # fmt: skip
    v.add_argument("--pre-admission-ms", type=float, default=d.pre_admission_ms,
                   help="real ms before a request reaches the engine; a decode client leaving within it "
                        "never reached the engine")  # fmt: skip
    v.add_argument("--incomplete-kv-params", choices=("reject", "recompute", "crash"), default=d.incomplete_kv_params,
                   help="a decode request whose kv_transfer_params lack a needed field: 400, recompute, "
                        "or the engine dies (500 on every later completion)")  # fmt: skip
    v.add_argument("--bidirectional-kv", action="store_true",
                   help="vLLM's bidirectional_kv_xfer on a decode engine (0.28 family): each finished "
                        "decode answers its own kv_transfer_params and holds its blocks for "
                        "--decoder-kv-blocks-ttl")  # fmt: skip
    v.add_argument("--decoder-kv-blocks-ttl", type=float, default=d.decoder_kv_blocks_ttl_s, metavar="S",
                   help="vLLM's decoder_kv_blocks_ttl: seconds a bidirectional decode engine holds a finished "
                        "request's blocks")  # fmt: skip
    v.add_argument("--kv-transfer-mode", choices=("pull", "push"), default=d.kv_transfer_mode,
                   help="the NIXL connector's transfer_mode in prefill answers (push: vLLM's push scheduler; "
                        "lease family only)")  # fmt: skip
    p.add_argument("--log", default="stderr",
                   help="request log of JSON lines: FILE, '-' (stdout, after the startup line), "
                        "'stderr', or 'none'")  # fmt: skip
    p.add_argument("--record-limit", type=int, default=d.record_limit, help="requests kept for /sim/requests")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="event loop; auto uses uvloop when installed")  # fmt: skip

    g = p.add_argument_group("engine model")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks, help="KV blocks of the engine")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (default: 8192; --max-model-len without chunked prefill)")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="never split a prompt over steps (a prompt must fit the step budget)")  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=d.max_model_len, help="longest prompt plus output")
    g.add_argument("--kv-lease-s", type=float, default=None,
                   help="seconds unpulled KV is held before it expires (wall clock; default: the version "
                        "family's, 30 for lease)")  # fmt: skip
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--step-base-ms", type=float, default=d.step_base_ms, help="fixed time of one engine step")
    g.add_argument("--prefill-per-token-ms", type=float, default=d.prefill_per_token_ms,
                   help="step time per prompt token computed in it")  # fmt: skip
    g.add_argument("--decode-per-seq-ms", type=float, default=d.decode_per_seq_ms,
                   help="step time per sequence decoding in it")  # fmt: skip
    g.add_argument("--kv-transfer-base-ms", type=float, default=d.kv_transfer_base_ms, help="fixed KV pull time")
    g.add_argument("--kv-transfer-per-block-ms", type=float, default=d.kv_transfer_per_block_ms,
                   help="KV pull time per block")  # fmt: skip
    g.add_argument("--kv-pull-timeout-s", type=float, default=d.kv_pull_timeout_s,
                   help="timeout of a KV pull or release sent to a prefill engine")  # fmt: skip
    g.add_argument("--kv-pull-grace-ms", type=float, default=None,
                   help="real time a decode leg watches for its client closing before it pulls "
                        "(default: 2, or 0 at --speed 0)")  # fmt: skip
    g.add_argument("--kv-load-failure", choices=("recompute", "fail"), default=d.kv_load_failure,
                   help="on a failed KV pull: recompute the prompt, or fail the request with 500")  # fmt: skip

    t = p.add_argument_group("tokens and KV events")
    t.add_argument("--tokenizer", metavar="PATH", default=None,
                   help="a Hugging Face tokenizer.json (or its directory): count and hash prompts by its ids "
                        "(default: 4 characters per token)")  # fmt: skip
    t.add_argument("--chat-template", metavar="FILE", default=None,
                   help="jinja2 chat template (default: chat_template.jinja or tokenizer_config.json beside the "
                        "tokenizer; none: chat is refused, as vLLM refuses it)")
    t.add_argument("--kv-events-endpoint", metavar="tcp://HOST:PORT", default=None,
                   help="publish vLLM KV events (ZMQ PUB; binds for host * or port 0, else connects)")
    t.add_argument("--kv-events-replay-endpoint", metavar="tcp://HOST:PORT", default=None,
                   help="the replay ROUTER socket (default: the PUB port + 1)")
    t.add_argument("--kv-events-topic", default="", help="topic frame of the KV event messages")
    t.add_argument("--kv-events-batch-map", action="store_true",
                   help="encode each KV event batch as a map, not an array (vLLM's EventBatch without array_like)")
    t.add_argument("--data-parallel-rank", type=int, default=0, metavar="R",
                   help="publish KV events as data-parallel rank R: on the endpoints' ports + R, as vLLM does")

    h = p.add_argument_group("HTTP")
    h.add_argument("--keep-alive-s", type=float, default=d.keep_alive_s, help="idle keep-alive timeout")
    h.add_argument("--read-timeout-s", type=float, default=d.read_timeout_s, help="request read timeout")
    h.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body")

    f = p.add_argument_group("faults (completion routes; also POST /sim/faults at runtime)")
    fd = _FAULT_DEFAULTS
    f.add_argument("--error-rate", type=float, default=fd.error_rate, help="share answered with --error-status")
    f.add_argument("--error-status", type=int, default=fd.error_status, help="status of injected errors")
    f.add_argument("--drop-rate", type=float, default=fd.drop_rate, help="share closed without an answer")
    f.add_argument("--delay-s", type=float, default=fd.delay_s, help="seconds added before handling")
    f.add_argument("--delay-rate", type=float, default=fd.delay_rate, help="share that gets --delay-s")
    f.add_argument("--stall-after-chunks", type=int, default=None,
                   help="stop sending after this many chunks, keep the connection open")  # fmt: skip
    f.add_argument("--stall-rate", type=float, default=fd.stall_rate, help="share that stalls")
    f.add_argument("--drop-after-chunks", type=int, default=None, help="close the connection after this many chunks")
    f.add_argument("--drop-after-chunks-rate", type=float, default=fd.drop_after_chunks_rate,
                   help="share dropped after --drop-after-chunks")  # fmt: skip
    f.add_argument("--omit-kv-params-rate", type=float, default=fd.omit_kv_params_rate,
                   help="share of prefill answers without kv_transfer_params")  # fmt: skip
    f.add_argument("--malformed-json-rate", type=float, default=fd.malformed_json_rate,
                   help="share of answers with broken JSON")  # fmt: skip
    f.add_argument("--eos-rate", type=float, default=fd.eos_rate,
                   help="share whose first token ends the sequence (finish_reason stop), unless min_tokens >= 1")
    f.add_argument("--pull-fail-rate", type=float, default=fd.pull_fail_rate,
                   help="share of decode legs whose KV read fails (the prefill engine keeps the blocks)")
    f.add_argument("--push-reg-lost-rate", type=float, default=fd.push_reg_lost_rate,
                   help="share of push-mode decode legs whose registration never reaches the prefill engine")
    f.add_argument("--unhealthy", action="store_true", help="/health answers 503")
    f.add_argument("--reasoning-only", action="store_true", help="chat answers carry only reasoning_content")
    return p


_FAULT_FIELDS = tuple(attrs.fields_dict(Faults))


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> SimConfig:
    """Turn parsed flags into a :class:`SimConfig`; ``ValueError`` with a clear message when bad."""
    host, port = parse_listen(args.listen)
    api_key = _api_key(args.api_key_env, environ)
    faults = _faults(args)
    config = SimConfig(
        role=args.role,
        **_sglang_settings(args),
        host=host,
        port=port,
        model=args.model,
        seed=args.seed,
        speed=args.speed,
        api_key=api_key,
        engine_id=args.engine_id,
        advertise_host=args.advertise_host,
        tp_size=args.tp_size,
        vllm_version=args.vllm_version,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        tokens_only=args.tokens_only,
        dev_mode=args.dev_mode,
        abort_request_route=args.abort_request_route,
        incomplete_kv_params=args.incomplete_kv_params,
        bidirectional_kv=args.bidirectional_kv,
        decoder_kv_blocks_ttl_s=args.decoder_kv_blocks_ttl,
        kv_transfer_mode=args.kv_transfer_mode,
        pre_admission_ms=args.pre_admission_ms,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_lease_s=args.kv_lease_s,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=not args.no_chunked_prefill,
        prefix_caching=not args.no_prefix_caching,
        step_base_ms=args.step_base_ms,
        prefill_per_token_ms=args.prefill_per_token_ms,
        decode_per_seq_ms=args.decode_per_seq_ms,
        kv_transfer_base_ms=args.kv_transfer_base_ms,
        kv_transfer_per_block_ms=args.kv_transfer_per_block_ms,
        kv_pull_timeout_s=args.kv_pull_timeout_s,
        kv_pull_grace_ms=args.kv_pull_grace_ms,
        kv_load_failure=args.kv_load_failure,
        keep_alive_s=args.keep_alive_s,
        read_timeout_s=args.read_timeout_s,
        max_body_bytes=args.max_body_bytes,
        record_limit=args.record_limit,
        log=None if args.log == "none" else args.log,
        faults=faults,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_batch_map=args.kv_events_batch_map,
        data_parallel_rank=args.data_parallel_rank,
    )
    config.check()
    return config


def _sglang_settings(args: argparse.Namespace) -> dict[str, Any]:
    names = ("protocol", "bootstrap_port", "bootstrap_timeout_s", "waiting_timeout_s")
    return {name: getattr(args, name) for name in names}


def _api_key(variable: str | None, environ: Mapping[str, str]) -> str | None:
    if variable is None:
        return None
    api_key = environ.get(variable)
    if not api_key:
        raise ValueError(f"--api-key-env: environment variable {variable} is not set")
    return api_key


def _faults(args: argparse.Namespace) -> Faults:
    try:
        return Faults.from_json({name: getattr(args, name) for name in _FAULT_FIELDS})
    except FaultsError as exc:
        raise ValueError(str(exc)) from None


def loop_factory(kind: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """An event-loop factory: uvloop when asked for or, with ``auto``, when installed."""
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def startup_line(engine: SimEngine | SglangEngine) -> str:
    """The one JSON line printed when the engine listens (a SGLang engine adds its protocol and bootstrap port)."""
    line = {
        "event": "listening",
        "host": engine.host,
        "port": engine.port,
        "role": engine.config.role,
        "url": engine.url,
        "engine_id": engine.engine_id,
    }
    if isinstance(engine, SglangEngine):
        line.update(protocol="sglang", bootstrap_port=engine.bootstrap_port)
    return json.dumps(line)


def run(config: SimConfig, *, loop: str = "auto") -> int:
    """Serve ``config`` until SIGTERM/SIGINT; the exit status."""

    async def serve() -> int:
        stop = asyncio.Event()
        running = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                running.add_signal_handler(signum, stop.set)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread: the caller stops us another way
        engine: SimEngine | SglangEngine
        try:
            engine = SglangEngine(config) if config.protocol == "sglang" else SimEngine(config)
        except (ValueError, OSError) as exc:  # a tokenizer or chat template that does not load
            print(f"narwhal sim: error: {exc}", file=sys.stderr)
            return 2

        def announce(e: SimEngine | SglangEngine) -> None:
            sys.stdout.write(startup_line(e) + "\n")
            sys.stdout.flush()

        try:
            await engine.start(on_listening=announce)
        except OSError as exc:
            print(f"narwhal sim: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
            return 1
        try:
            await stop.wait()
        finally:
            await engine.close()
        return 0

    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        try:
            return runner.run(serve())
        except KeyboardInterrupt:
            return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``narwhal sim`` (``argv`` are the arguments after ``sim``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"narwhal sim: error: {exc}", file=sys.stderr)
        return 2
    return run(config, loop=args.loop)
