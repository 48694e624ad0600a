"""What both runtimes do the same way around a health probe: name why it failed, list resolved addresses.

The core decides what a failed probe means (docs/operate.md, "Engines in
rotation"); the adapter only says why it failed, in words an operator can act
on: the engine's name does not resolve, the connection was refused, reset or
timed out. And for a probe that asks for it (``StartControl.resolve``), the
adapter resolves the engine's host name first and hands the core the
addresses (``EngineResolved``), which a prefill answer's ``remote_host`` may
name (docs/configure.md, ``engine.kv_hosts``).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

__all__ = ["describe_failure", "addresses_of", "shorten", "MAX_REASON"]

#: Longest failure description passed on (a resolver's or a library's message can be long).
MAX_REASON = 200


def _chain(exc: BaseException) -> list[BaseException]:
    # The exception, its causes and contexts, and the members of exception
    # groups, outermost first (trio wraps the socket call's error).
    seen: set[int] = set()
    out: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo and len(out) < 64:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        for linked in (e.__cause__, e.__context__):
            if linked is not None:
                todo.append(linked)
    return out


def describe_failure(exc: BaseException) -> str:
    """Why a request to an engine got no answer, in a few words.

    ``DNS failure: ...`` (the name does not resolve), ``connection refused``,
    ``connection reset``, ``timeout``, ``connection failed: <reason>`` for
    another socket error, else the exception's type and message.
    """
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, socket.gaierror):
            return shorten(f"DNS failure: {e.strerror or e}")
    for e in chain:
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
    for e in chain:
        if isinstance(e, ConnectionResetError):
            return "connection reset"
        if isinstance(e, TimeoutError):
            return "timeout"
    for e in chain:
        if isinstance(e, OSError) and e.strerror:
            return shorten(f"connection failed: {e.strerror}")
    text = str(exc)
    return shorten(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def addresses_of(infos: Iterable[Any]) -> tuple[str, ...]:
    """The IP addresses of a ``getaddrinfo`` answer, each once, in order."""
    out: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if address not in out:
            out.append(address)
    return tuple(out)


def shorten(text: str) -> str:
    """``text``, cut to :data:`MAX_REASON` characters."""
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."
