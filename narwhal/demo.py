"""``narwhal demo``: the router plus a simulated prefill and decode engine, on loopback.

Everything runs in this one process: two engine simulators on background
threads and the router on the chosen runtime, routing as a config with only
``[model]`` and ``[engine]`` does (docs/configure.md, ``[routing]``). The
demo prints a ready-to-paste ``curl`` line, a second one that sends a long
prompt (send it twice: the second prefill finds it cached), and the
``narwhal journal`` line that shows how a request was routed; it serves
until Ctrl-C (or SIGTERM), then drains and exits 0.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import socket
import sys
from collections.abc import Sequence

from narwhal_core import Config
from narwhal_core.config import (
    EngineConfig,
    HealthConfig,
    IngressConfig,
    JournalConfig,
    ModelConfig,
)

__all__ = ["main", "demo_config"]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: The second curl's request body, written next to the journal.
LONG_PROMPT_FILE = "narwhal-demo-long-prompt.json"


def demo_config(port: int, prefill_url: str, decode_url: str, journal: str) -> Config:
    """The embedded default configuration of the demo."""
    return Config(
        model=ModelConfig(name=MODEL, aliases=("llama-3.1-8b",)),
        ingress=IngressConfig(listen=f"127.0.0.1:{port}", auth="none"),
        engine=EngineConfig(prefill=(prefill_url,), decode=(decode_url,), kv_release="abort_endpoint"),
        health=HealthConfig(probe_interval_s=2.0),
        journal=JournalConfig(path=journal, fsync="interval"),
    )


def write_long_prompt(journal: str) -> str:
    """The demo's long request body (a prompt of some 1,600 tokens), written beside the journal; its path."""
    path = os.path.join(os.path.dirname(journal), LONG_PROMPT_FILE)
    prompt = "The narwhal is a toothed whale of the Arctic; its tusk is a spiral canine tooth. " * 80
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"model": MODEL, "prompt": prompt, "max_tokens": 16}, f)
    return path


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def main(argv: Sequence[str]) -> int:
    """Run the demo; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="narwhal demo",
        description="The router plus a simulated prefill and decode engine, on loopback, in one process.",
    )
    parser.add_argument("--port", type=int, default=8000, help="router port (default 8000; a free one if taken)")
    parser.add_argument("--runtime", choices=("trio", "asyncio"), default="trio")
    parser.add_argument("--journal", default="narwhal-demo-journal.jsonl", help="journal file")
    parser.add_argument("--speed", type=float, default=20.0, help="engine simulator speed (0 = instant)")
    args = parser.parse_args(list(argv))

    from narwhal_sim.testing import SimThread

    port = args.port if _port_free(args.port) else 0
    with SimThread(role="prefill", speed=args.speed) as prefill, SimThread(role="decode", speed=args.speed) as decode:
        config = demo_config(port, prefill.url, decode.url, args.journal)
        if args.runtime == "asyncio":
            from narwhal_asyncio.server import run as run_demo
        else:
            from narwhal_trio.server import run as run_demo

        long_prompt = write_long_prompt(args.journal)

        def ready(host: str, bound: int) -> None:
            body = '{"model": "%s", "prompt": "The narwhal is", "max_tokens": 16}' % MODEL
            url = f"http://{host}:{bound}/v1/completions"
            print(
                f"\nNarwhal demo: router on http://{host}:{bound} ({args.runtime}), "
                f"prefill engine {prefill.url}, decode engine {decode.url}\n"
                f"journal: {args.journal}   stop: Ctrl-C\n\n"
                f"curl -s {url} -H 'Content-Type: application/json' -d '{body}'\n\n"
                "A long prompt: send it twice, and the second prefill finds it cached "
                '(routing.policy = "prefix", the default):\n'
                f"curl -si {url} -H 'Content-Type: application/json' -d @{shlex.quote(long_prompt)}\n\n"
                "How a request was routed (the routing record: engines weighed, tokens each had to compute), "
                "by the x-request-id of its answer:\n"
                f"narwhal journal {shlex.quote(args.journal)} --rid ID\n",
                flush=True,
            )

        return run_demo(config, ready)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
