"""The ``narwhal`` command.

usage: narwhal COMMAND [options]      (narwhal COMMAND --help for its options)

commands:
  serve --config FILE [--runtime trio|asyncio] [--workers N]
        run the router (docs/configure.md describes the config file)
  serve --config FILE --check-config
        run serve's start-up checks on FILE, print whether it is valid, exit
  demo [--port N] [--runtime trio|asyncio]
        the router and two simulated engines in one process, on loopback
  sim --role prefill|decode|mixed --listen HOST:PORT [...]
        one simulated engine (docs/simulator.md)
  journal FILE [--rid ID] [--terminal T] [--follow] [--unfinished]
        read a journal file (docs/operate.md)
  bench [--trace FILE] (--base-url URL | --virtual --fleet 4P2D) [...]
        replay a trace against an OpenAI-compatible endpoint, or a
        simulated fleet in virtual time (docs/bench.md)

options:
  -h, --help     show this help and exit
  --version      show the version and exit
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from narwhal_build import use_pure_core_if_requested

__all__ = ["main", "version"]

RUNTIMES = ("trio", "asyncio")


def version() -> str:
    """The installed distribution's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("narwhal")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="narwhal serve", description="Run the router.")
    parser.add_argument(
        "--check-config", action="store_true",
        help="only run the start-up checks serve makes before it listens (the config, the API keys file, "
             "the engine credential's variable, the journal's directory), print one line and exit: 0 valid, "
             "2 bad config, 1 journal not writable; opens no socket, contacts no engine (docs/operate.md)")
    parser.add_argument("--config", required=True, help="TOML config file (see docs/configure.md)")
    parser.add_argument("--runtime", choices=RUNTIMES, default="trio", help="event loop (default: trio)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="worker processes sharing the port (overrides ingress.workers; docs/operate.md)")
    # Set by the supervisor when it starts a worker (narwhal_runtime/supervisor.py).
    for flag in ("--worker-index", "--worker-port", "--supervisor-pid"):
        parser.add_argument(flag, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-metrics-dir", help=argparse.SUPPRESS)
    return parser


def _serve(argv: Sequence[str]) -> int:
    args = _serve_parser().parse_args(argv)
    if args.check_config:
        from .check_config import check_config

        return check_config(args.config)
    from narwhal_core.errors import ConfigError

    from narwhal_runtime.app import load_config
    from narwhal_runtime.workers import resolve_workers

    try:
        config = load_config(args.config)
        workers = resolve_workers(config, args.workers)
        if args.worker_index is not None:
            return _worker(config, args, workers)
        if workers > 1:
            from narwhal_runtime.supervisor import Supervisor

            return Supervisor(args.config, config, runtime=args.runtime, workers=workers).run()
    except ConfigError as exc:
        print(exc.line(), file=sys.stderr)
        return 2
    if config.ingress.workers != 1:  # --workers 1, or "auto" on one core: one plain process
        import attrs

        config = attrs.evolve(config, ingress=attrs.evolve(config.ingress, workers=1))
    return _run(config, args.runtime)


def _worker(config: object, args: argparse.Namespace, workers: int) -> int:
    """One worker of a supervised group: its share of the config, then an ordinary ``serve``."""
    from narwhal_runtime.group_metrics import join_group
    from narwhal_runtime.workers import die_with_supervisor, worker_config

    die_with_supervisor(args.supervisor_pid)
    join_group(args.worker_metrics_dir, args.worker_index)
    mine = worker_config(config, index=args.worker_index, workers=workers, port=args.worker_port)  # type: ignore[arg-type]
    return _run(mine, args.runtime)


def _run(config: object, runtime: str) -> int:
    from narwhal_core.errors import ConfigError

    try:
        if runtime == "asyncio":
            from narwhal_asyncio.server import run
        else:
            from narwhal_trio.server import run
        return run(config)  # type: ignore[arg-type]
    except ConfigError as exc:
        print(exc.line(), file=sys.stderr)
        return 2


def _sim(argv: Sequence[str]) -> int:
    from narwhal_sim.cli import main as sim_main

    return sim_main(list(argv))


def _journal(argv: Sequence[str]) -> int:
    from .journal_cli import main as journal_main

    return journal_main(list(argv))


def _bench(argv: Sequence[str]) -> int:
    from narwhal_bench.cli import main as bench_main

    return bench_main(list(argv))


def _demo(argv: Sequence[str]) -> int:
    from .demo import main as demo_main

    return demo_main(list(argv))


_COMMANDS = {"serve": _serve, "sim": _sim, "demo": _demo, "journal": _journal, "bench": _bench}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``narwhal`` command; returns the exit status."""
    # Before any command imports the core: NARWHAL_PURE_PYTHON=1 picks its sources.
    use_pure_core_if_requested()
    args = list(sys.argv[1:] if argv is None else argv)
    usage = (__doc__ or "").split("\n", 2)[2].strip()
    if args and args[0] in ("-h", "--help"):
        print(usage)
        return 0
    if args and args[0] == "--version":
        print(f"narwhal {version()}")
        return 0
    if not args:
        print(usage, file=sys.stderr)
        return 2
    if args[0] not in _COMMANDS:
        print(f"narwhal: unknown command {args[0]!r} (narwhal --help lists the commands)", file=sys.stderr)
        return 2
    return _COMMANDS[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(main())
