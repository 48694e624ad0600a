"""The ``narwhal`` command (SPEC §8).

``narwhal serve --config FILE [--runtime trio|asyncio]``
``narwhal sim --role prefill|decode|mixed --listen ADDR [...]``
``narwhal demo [--port N] [--runtime trio|asyncio]``
``narwhal journal FILE [--rid ID] [--terminal T] [--follow] [--unfinished]``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

RUNTIMES = ("trio", "asyncio")


def _serve(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="narwhal serve", description="Run the router.")
    parser.add_argument("--config", required=True, help="TOML config file (see docs/configure.md)")
    parser.add_argument("--runtime", choices=RUNTIMES, default="trio", help="event loop (default: trio)")
    args = parser.parse_args(argv)
    from narwhal_core.errors import ConfigError

    from .app import load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc.line(), file=sys.stderr)
        return 2
    return _run(config, args.runtime)


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


def _demo(argv: Sequence[str]) -> int:
    from .demo import main as demo_main

    return demo_main(list(argv))


_COMMANDS = {"serve": _serve, "sim": _sim, "demo": _demo, "journal": _journal}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``narwhal`` command."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in _COMMANDS:
        print(__doc__.strip(), file=sys.stderr if args and args[0] not in ("-h", "--help") else sys.stdout)
        return 0 if args and args[0] in ("-h", "--help") else 2
    return _COMMANDS[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(main())
