"""What both runtimes do the same way before and around the event loop.

Reading the config and keys files, resolving the engine credential from the
environment, choosing the rid prefix and the wall-clock offset, building the
:class:`narwhal_core.Router`, tuning the cyclic GC once serving: none of it
depends on trio or asyncio, so it lives here once and ``narwhal_trio`` /
``narwhal_asyncio`` stay mirror images.
"""

from __future__ import annotations

import gc
import os
import secrets
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx

from narwhal_core import (
    CONTROL_BODY_LIMIT,
    Authenticator,
    Config,
    Event,
    RidSource,
    Router,
    StartControl,
    parse_api_keys,
    parse_config,
)
from narwhal_core.config import engine_api_key
from narwhal_core.errors import ConfigError

from .corebuild import core_build
from .log import log_event
from .metrics import render

__all__ = [
    "load_config", "load_authenticator", "build_router", "settle_gc", "GC_THRESHOLDS",
    "HIGH_WATER", "LINGER_S", "LINGER_BYTES", "log_listening", "control_request",
    "StartupError", "journal_failure", "listen_failure", "startup_failure", "contain", "STOPPED_BY_SIGNAL",
]

# Client-socket policy both runtimes follow.

#: Bytes queued for one client beyond which what feeds it (an engine leg
#: relaying a stream) waits: trio's feeding task waits for the writer,
#: asyncio stops reading the legs.
HIGH_WATER = 1 << 20
#: After Narwhal closes a connection (an error answer, ``connection: close``):
#: how long, and for how many bytes, it goes on reading and discarding what
#: the client still sends, its own side already shut, before closing the
#: socket. Closing with unread bytes makes the kernel reset the connection,
#: and the client could lose the answer (a 413 or 503 in the middle of an
#: upload) before reading it.
LINGER_S = 2.0
LINGER_BYTES = 4 << 20

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


def contain(router: Router, event: Event | None, exc: Exception) -> None:
    """The router raised while handling ``event``: end what it was about, keep serving.

    The request the event belongs to (if any) ends as ``failed`` with 500
    ``internal_error`` and its terminal record; the error is logged once,
    with its traceback (``internal_error``). Both runtimes call this from
    their one place that feeds the router.
    """
    problem = f"{type(exc).__name__}: {exc}"
    trace = "".join(traceback.format_exception(exc))
    try:
        router.contain_failure(event, problem, trace)
    except Exception as again:  # noqa: BLE001 - the router is broken beyond one request
        log_event("internal_error", level="error", rid=None, problem=problem,
                  during="deadline" if event is None else type(event).__name__, traceback=trace,
                  containment=f"{type(again).__name__}: {again}")


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
    return Router(
        config,
        rid_source=RidSource(rid_prefix or secrets.token_hex(5)),
        authenticator=load_authenticator(config),
        engine_api_key=engine_api_key(config, os.environ if env is None else env),
        wall_offset=wall_clock() - now,
        now=now,
        render_metrics=render,
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


async def control_request(http: httpx.AsyncClient, cmd: StartControl) -> tuple[int, bytes]:
    """Send a control request (probe, abort); its status and the first ``CONTROL_BODY_LIMIT`` bytes of its body.

    The caller bounds it in time and reports failures as its runtime names them.
    """
    body = b""
    async with http.stream(
        cmd.method, cmd.engine.url + cmd.target,
        headers=list(cmd.headers), content=cmd.body, timeout=cmd.timeout,
    ) as response:
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) >= CONTROL_BODY_LIMIT:
                break  # enough to know what the engine said
        return response.status_code, body[:CONTROL_BODY_LIMIT]
