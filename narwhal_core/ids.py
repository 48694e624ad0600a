"""Request and backend IDs (docs/contract.md, "Prefill and decode legs").

The router request ID (``rid``) is assigned at ingress from an injected
source. Every leg attempt gets a *backend ID*, a pure function of
``(rid, phase, attempt)``::

    backend_id(rid, phase, attempt) = rid + "-" + phase letter + decimal attempt

with ``"p"`` for prefill and ``"d"`` for decode, e.g. ``"3f9c0a1b2c3d0000001-p1"``.
The suffix after the last ``-`` contains no ``-`` and the attempt has no leading
zeros, so the suffix can be split off unambiguously: the function is
injective even though rids may themselves contain ``-``. Rids are at most
:data:`MAX_RID_LEN` characters of ``[A-Za-z0-9-]`` and attempts at most
:data:`MAX_ATTEMPT`, which keeps every backend ID within 128 characters.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal

from .errors import NarwhalError

__all__ = [
    "Phase",
    "PREFILL",
    "DECODE",
    "MAX_RID_LEN",
    "MAX_ATTEMPT",
    "MAX_BACKEND_ID_LEN",
    "backend_id",
    "parse_backend_id",
    "RidSource",
    "sanitize_client_rid",
]

Phase = Literal["prefill", "decode"]
PREFILL: Final = "prefill"
DECODE: Final = "decode"

MAX_RID_LEN: Final = 100
MAX_ATTEMPT: Final = 999_999
MAX_BACKEND_ID_LEN: Final = 128
MAX_CLIENT_RID_LEN: Final = 128

_RID_RE: Final = re.compile(r"[A-Za-z0-9-]{1,100}\Z")
_SUFFIX_RE: Final = re.compile(r"(.+)-([pd])([1-9][0-9]*)\Z", re.S)
_LETTER: Final[Mapping[str, str]] = MappingProxyType({PREFILL: "p", DECODE: "d"})
_PHASE: Final[Mapping[str, Phase]] = MappingProxyType({"p": PREFILL, "d": DECODE})


def backend_id(rid: str, phase: Phase, attempt: int) -> str:
    """The backend ID of leg ``attempt`` (1-based) of ``phase`` for request ``rid``."""
    if not isinstance(rid, str) or not _RID_RE.match(rid):
        raise NarwhalError(f"invalid rid {rid!r}: 1-{MAX_RID_LEN} characters of [A-Za-z0-9-]")
    letter = _LETTER.get(phase)
    if letter is None:
        raise NarwhalError(f"invalid phase {phase!r}: prefill or decode")
    if type(attempt) is not int or not 1 <= attempt <= MAX_ATTEMPT:
        raise NarwhalError(f"attempt {attempt!r} is not an integer in 1..{MAX_ATTEMPT}")
    return f"{rid}-{letter}{attempt}"


def parse_backend_id(value: str) -> tuple[str, Phase, int]:
    """The inverse of :func:`backend_id`: ``(rid, phase, attempt)``."""
    m = _SUFFIX_RE.match(value)
    if m is None or not _RID_RE.match(m.group(1)):
        raise NarwhalError(f"not a backend ID: {value[:140]!r}")
    return m.group(1), _PHASE[m.group(2)], int(m.group(3))


class RidSource:
    """Router request IDs: an injected per-process prefix plus a counter.

    The adapter passes a random ``prefix`` chosen at start-up (the core has no
    randomness), so rids stay unique across restarts that append to the same
    journal. IDs are ``prefix`` followed by 10 lowercase hex digits.
    """

    __slots__ = ("_prefix", "_next")

    def __init__(self, prefix: str, start: int = 0) -> None:
        if not re.fullmatch(r"[A-Za-z0-9]{1,64}", prefix):
            raise NarwhalError(f"invalid rid prefix {prefix!r}: 1-64 characters of [A-Za-z0-9]")
        self._prefix = prefix
        self._next = start

    def __call__(self) -> str:
        n = self._next
        self._next = n + 1
        return f"{self._prefix}{n:010x}"


_PRINTABLE: Final = frozenset(range(0x20, 0x7F)) - {ord("\\")}
_SAFE_RID: Final = re.compile(rb"[\x20-\x5b\x5d-\x7e]*")


def sanitize_client_rid(raw: bytes | None) -> str | None:
    """The client's ``x-request-id`` as journal-safe text, never trusted (docs/contract.md, "The engine request").

    Printable ASCII is kept; every other byte (and ``\\``) is escaped as
    ``\\xNN``; the result is cut to 128 characters.
    """
    if raw is None:
        return None
    if len(raw) <= MAX_CLIENT_RID_LEN and _SAFE_RID.fullmatch(raw):
        return raw.decode("ascii")  # the common case: nothing to escape
    out = []
    size = 0
    for b in raw:
        piece = chr(b) if b in _PRINTABLE else f"\\x{b:02x}"
        size += len(piece)
        if size > MAX_CLIENT_RID_LEN:
            break
        out.append(piece)
    return "".join(out)
