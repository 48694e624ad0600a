"""What both runtimes do the same way before and around the event loop.

Reading the config and keys files, resolving the engine credential from the
environment, choosing the rid prefix and the wall-clock offset, building the
:class:`narwhal_core.Router`, the start-up errors, the ``listening`` line,
tuning the cyclic GC once serving, what each signal does and the exit status
(:class:`Run`): none of it depends on trio or asyncio, so it lives here once
and ``narwhal_trio`` / ``narwhal_asyncio`` stay mirror images.
"""

from __future__ import annotations

import gc
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from narwhal_build import core_build
from narwhal_core import (
    Authenticator,
    Config,
    RidSource,
    Router,
    parse_api_keys,
    parse_config,
)
from narwhal_core.config import engine_api_key
from narwhal_core.errors import ConfigError

from .group_metrics import current_group
from .log import log_event
from .metrics import render
from .tokenizer import EngineTokenizer, TokenizerLoadError, load_tokenizer

__all__ = [
    "load_config", "load_authenticator", "load_prompt_tokenizer", "build_router", "settle_gc", "GC_THRESHOLDS",
    "random_rid_prefix", "log_listening", "StartupError", "journal_failure", "listen_failure",
    "startup_failure", "STOPPED_BY_SIGNAL", "Run", "core_build",
]

#: The cyclic GC's thresholds once serving (Python's default: 700, 10, 10): see
#: :func:`settle_gc`. With 9,000 slow streams open, trio spends about a fifth
#: less CPU; much higher, garbage cycles (cancelled legs...) pile up between
#: collections and the soak run's RSS no longer stays flat.
GC_THRESHOLDS = (5_000, 10, 10)


class StartupError(Exception):
    """Narwhal could not start: one plain line on standard error, exit status 1 (docs/operate.md)."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def journal_failure(path: str, exc: OSError) -> StartupError:
    """The journal file could not be opened (checked before listening)."""
    return StartupError(f"cannot open journal {path}: {_reason(exc)}")


def listen_failure(listen: str, exc: OSError) -> StartupError:
    """The listening socket could not be opened (address in use, no such address...)."""
    return StartupError(f"cannot listen on {listen}: {_reason(exc)}")


def startup_failure(exc: BaseException) -> StartupError | None:
    """The start-up failure ``exc`` stands for, or ``None`` when it is something else.

    A :class:`StartupError`, or an :class:`OSError` raised before serving
    began, possibly wrapped in exception groups by a nursery (trio), is one;
    any other exception (a bug) is not, and keeps its traceback.
    """
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, StartupError):
        return exc
    if isinstance(exc, OSError):
        return StartupError(f"cannot start: {_reason(exc)}")
    return None


#: Exit status after a second SIGTERM or SIGINT cut the drain short: 128 + the signal's number.
STOPPED_BY_SIGNAL = 128


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a TOML config file; raise :class:`ConfigError` naming the bad key."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("config", f"cannot read {os.fspath(path)}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError("config", f"{os.fspath(path)} is not UTF-8 text") from None
    return parse_config(text, env=os.environ if env is None else env)


def load_authenticator(config: Config) -> Authenticator:
    """The ingress authenticator, with the API keys file read when ``auth = "api_keys"``."""
    keys = None
    if config.ingress.auth == "api_keys":
        path = config.ingress.api_keys_file
        assert path is not None  # the config model requires it in this mode
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError("ingress.api_keys_file", f"cannot read {path}: {exc.strerror}") from None
        keys = parse_api_keys(text)
    return Authenticator.from_config(config.ingress, keys)


def load_prompt_tokenizer(config: Config) -> EngineTokenizer | None:
    """``model.tokenizer`` and its chat template, loaded; None when unset.

    A tokenizer or template that does not load is a config error at start
    (``narwhal serve`` and ``--check-config`` exit 2 naming the key).
    """
    if config.model.tokenizer is None:
        return None
    try:
        return load_tokenizer(config.model.tokenizer, config.model.chat_template)
    except TokenizerLoadError as exc:
        raise ConfigError(exc.key, str(exc)) from None


def random_rid_prefix() -> str:
    """A random prefix for the process's request IDs: ten hex characters, the last a letter.

    A rid is this prefix and a ten-digit hex counter, and it comes back in
    every prefill answer (``remote_request_id``). Ending in a letter, a rid
    never holds more than ten decimal digits in a row: the number scan of
    :func:`narwhal_core.wire.loads` once counted digits inside strings too, and
    a run of sixteen sent the answer down its slow exact path
    (benchmarks/README.md, "What moves an instruction count"). It steps over strings now, so the
    letter changes nothing there; it stays, as the rid's documented shape
    (docs/operate.md, "Several routers in front of one fleet").
    """
    return secrets.token_hex(5)[:9] + secrets.choice("abcdef")


def build_router(
    config: Config,
    *,
    now: float,
    env: Mapping[str, str] | None = None,
    rid_prefix: str | None = None,
    wall_clock: Callable[[], float] = time.time,
) -> Router:
    """A router for ``config`` whose clock reads ``now`` at this moment.

    ``now`` is the runtime's monotonic clock (``trio.current_time()`` or
    ``loop.time()``); journal timestamps are that clock plus the offset to
    the wall clock measured here.
    """
    tokenizer = load_prompt_tokenizer(config)
    return Router(
        config,
        tokenizer=tokenizer,
        rid_source=RidSource(rid_prefix or random_rid_prefix()),
        authenticator=load_authenticator(config),
        engine_api_key=engine_api_key(config, os.environ if env is None else env),
        wall_offset=wall_clock() - now,
        now=now,
        render_metrics=group.render if (group := current_group()) is not None else render,
    )


def settle_gc() -> None:
    """Once serving: hide start-up objects from the cyclic GC and let it run less often.

    Reference counting frees nearly everything a request allocates; the
    collector only looks for cycles, and with Python's default threshold
    (700 allocations) it walks the objects of every open stream again and
    again: with thousands of streams open, a large share of the process's
    time. The objects made at start-up (modules, config, the router) live
    as long as the process: :func:`gc.freeze` leaves them out of every
    collection.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def log_listening(config: Config, host: str, port: int, runtime: str, loop: str) -> None:
    """The ``listening`` log line (with how the core runs), and a warning for a stale compiled core."""
    core, stale = core_build()
    log_event("listening", host=host, port=port, runtime=runtime, loop=loop, core=core,
              model=config.model.name, journal=config.journal.path)
    if stale:
        log_event("core_stale", level="error", modules=stale,
                  hint="source changed after compilation: the old code runs; rebuild "
                       "(python setup.py build_ext --inplace, or pip install -e .)")


class Stoppable(Protocol):
    """What a runtime's server offers to the signals (both ``Server`` classes)."""

    def shutdown(self) -> None: ...
    def reload_keys(self) -> None: ...


class Run:
    """One ``narwhal serve`` (or ``demo``) process, the same on both runtimes: signals, readiness, exit status.

    SIGHUP re-reads the API keys file without dropping traffic. The first
    SIGTERM/SIGINT begins a graceful drain; a second cancels what the drain
    has left at once (exit status 128 + its number: 130 for Ctrl-C); a third
    stops without waiting for the router. A failure to start is one line on
    stderr, exit status 1 (docs/operate.md).
    """

    #: The signals a runtime listens for.
    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, on_ready: Callable[[str, int], None] | None = None) -> None:
        self._on_ready = on_ready
        #: Serving began: a failure after it is not a start-up failure.
        self.serving = False
        self.status = 0
        self._stops = 0

    def started(self, host: str, port: int) -> None:
        """The server listens: settle the GC, tell ``on_ready``."""
        self.serving = True
        settle_gc()
        if self._on_ready is not None:
            self._on_ready(host, port)

    def signal_received(self, signum: int, server: Stoppable) -> bool:
        """Act on ``signum``; ``True`` when the runtime must stop serving at once (the third stop)."""
        if signum == signal.SIGHUP:
            server.reload_keys()
            return False
        self._stops += 1
        log_event("signal", signal=signal.Signals(signum).name)
        if self._stops == 1:
            server.shutdown()  # serving ends once the drain completes
        elif self._stops == 2:
            self.status = STOPPED_BY_SIGNAL + signum
            server.shutdown()  # cut the drain short
        else:
            return True
        return False

    def exit_status(self, body: Callable[[], object]) -> int:
        """Run ``body`` (the runtime's event loop); the process's exit status."""
        try:
            body()
        except KeyboardInterrupt:  # a Ctrl-C before the signal handlers were in place
            return STOPPED_BY_SIGNAL + signal.SIGINT
        except BaseException as exc:
            failure = None if self.serving else startup_failure(exc)
            if failure is None:
                raise
            print(f"narwhal: {failure}", file=sys.stderr)
            return 1
        return self.status
