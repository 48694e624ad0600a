"""JSON on the wire: exact decoding and encoding of request and answer bodies.

The request rules (docs/contract.md) promise that fields Narwhal does not
interpret reach the engines as the same JSON value the client sent: numbers
by exact decimal value, strings by code point. ``orjson`` is fast but parses every number into a C double or
a 64-bit integer, which changes the value of numbers with more than 15
significant digits, of integers beyond 64 bits and of tiny exponents
(``1e-400`` becomes ``0.0``; ``1e400`` is even refused). So bodies are decoded in two ways:

* the fast path, ``orjson``, whenever the body holds no number-like text that
  could lose precision outside its strings (:func:`_scan`, a cheap
  conservative scan that steps over each string to its closing quote);
* the exact path, the standard library's decoder with every float and every
  large integer kept as its original text (:class:`RawFloat`,
  :class:`RawInt`), which :func:`dumps` writes back verbatim.

Both paths reject what is not JSON: invalid UTF-8, ``NaN``/``Infinity``
literals, lone surrogates; and, to bound the work per body, nesting deeper
than :data:`MAX_DEPTH` and integer literals longer than
:data:`MAX_INT_DIGITS` digits.
Duplicate keys keep the last value; since Narwhal always re-encodes the
body, the engines see exactly the value Narwhal validated.
"""

from __future__ import annotations

import json
from types import FunctionType
from typing import Any, Final

import orjson

__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "JsonError", "RawFloat", "RawInt", "loads", "loads_answer", "dumps", "dumps_line"]

#: Deepest nesting accepted. orjson's encoder stops at 254 levels and every
#: body is re-encoded, so the limit sits well below that.
MAX_DEPTH: Final = 128
#: Longest integer literal accepted (CPython refuses to convert longer ones).
MAX_INT_DIGITS: Final = 4300
# A document nested d levels deep holds d openers and d closers: anything
# shorter than this is JSON no deeper than MAX_DEPTH, or no JSON at all (which
# the decoders refuse), and needs no bracket count (a stream event, mostly).
_DEEP_SIZE: Final = 2 * (MAX_DEPTH + 1)

def _number_classes() -> bytes:
    table = bytearray(b" " * 256)
    for b in b"0123456789.":
        table[b] = ord("d")
    for b in b"eE":
        table[b] = ord("e")
    table[ord("-")] = ord("m")
    for b in b"[{":
        table[b] = ord("o")
    return bytes(table)


# The risky-number scan looks, outside strings, for what orjson would not give
# back by value (compiled: one C loop, _scan_loop; pure: bytes operations,
# _scan_classes, which blank out every string, then map every byte to its
# class, digit or dot, exponent letter, minus, opener or other, and search
# the classes; where a quote may be escaped, they keep the strings, a more
# careful verdict than the loop's, and as quick as it was before it stepped
# over strings):
# * 16 digits-or-dots in a row: more significant digits than a double keeps,
#   or an integer beyond 64 bits (which orjson turns into a float);
# * a negative exponent of 3 digits or more: a subnormal or an underflow to
#   0.0 (``4.9e-324`` comes back as ``5e-324``, ``1e-400`` as ``0.0``).
# Positive exponents are safe: up to ``e308`` a number of at most 15
# significant digits comes back as the same decimal value, beyond it orjson
# refuses the number (infinity) and the exact path takes the body. The scan
# errs on the side of the exact path (``1e-1.2``, which is no JSON number).
# A string runs from a quote to the next quote not escaped (after an odd run
# of backslashes), or to the end of the bytes: JSON's own rule, so in a
# document orjson accepts the scan sees exactly its numbers and openers (a
# prompt's digits or brackets cost nothing), and in one it refuses, what the
# scan says changes no outcome. In the byte classes "mddd" is rare and fast
# to look for; only then is "emddd" (slower: "e" is a common letter) looked for.
_CLASSES: Final = _number_classes()
_LONG_RUN: Final = b"d" * 16


def _scan_classes(data: bytes) -> int:
    """The number scan with bytes operations: ``2 * openers + risky`` (see :func:`_scan_loop`).

    The same as the loop's where no quote follows a backslash; elsewhere it
    looks inside strings too (a slower parse, never a wrong one).
    """
    if b'"' in data and b'\\"' not in data:
        # No quote is escaped: every other stretch between quotes is a string's contents, blanked out.
        data = b'""'.join(data.split(b'"')[::2])
    classes = data.translate(_CLASSES)
    risky = _LONG_RUN in classes or (b"mddd" in classes and b"emddd" in classes)
    return 2 * classes.count(b"o") + risky


def _scan_loop(data: bytes) -> int:
    """The number scan in one pass over the bytes (the same verdict as :func:`_scan_classes` where no quote is escaped).

    Returns ``2 * openers + risky``: the number of ``[`` and ``{`` bytes
    outside strings, and whether a risky number (above) may be present
    there; strings are stepped over (:func:`_string_end`). Compiled, ``wire.pxd``
    types its locals and the loop runs in C, faster than the bytes
    operations; interpreted, it is far slower than they are, so the pure
    build uses :func:`_scan_classes` (benchmarks/README.md, "Figures behind
    the code") (``tests/core/test_contract_properties.py``
    checks that the two always agree).
    """
    run = 0  # digits or dots in a row
    after = 0  # 1: after an exponent letter, 2: and a minus, 3-4: and that many digits
    openers = 0
    risky = 0
    i = 0
    n = len(data)
    at = data  # compiled: a pointer to its bytes, read without a bounds check (wire.pxd)
    while i < n:
        c = at[i]
        i += 1
        if c == 0x22:  # a string: no number in it
            i = _string_end(data, i)
            run = 0
            after = 0
        elif 0x30 <= c <= 0x39 or c == 0x2E:
            run += 1
            if run >= 16:
                risky = 1
            if after >= 2:
                after += 1
                if after == 5:
                    risky = 1
            else:
                after = 0
        else:
            run = 0
            if c == 0x65 or c == 0x45:
                after = 1
            elif c == 0x2D and after == 1:
                after = 2
            else:
                after = 0
                if c == 0x5B or c == 0x7B:
                    openers += 1
    return 2 * openers + risky


def _string_end(data: bytes, i: int) -> int:
    """Past the closing quote of the string whose contents start at ``data[i]``; ``len(data)`` if it has none.

    Bytes are looked at 64 at a time, one by one, an escape (a backslash
    and the byte after it) as one; once 64 in a row hold no backslash (a
    prompt's prose), ``bytes.find`` looks for the next quote at C speed,
    and the backslashes before it say whether it is escaped: an odd run
    escapes it (the run follows a byte that is no backslash, so it is made
    of whole escapes). The opening quote stops that look back. Text dense
    with escapes (code, JSON in a string) stays with the byte loop, which a
    call per quote would cost more than.
    """
    n = len(data)
    at = data  # compiled: a pointer to its bytes (wire.pxd)
    while True:
        near = min(i + 64, n)
        plain = True
        while i < near:
            c = at[i]
            if c == 0x22:
                return i + 1
            if c == 0x5C:
                plain = False
                i += 2  # the byte after the backslash belongs to the escape
            else:
                i += 1
        if i >= n:
            return n
        if plain:
            quote = data.find(b'"', i)
            if quote < 0:
                return n
            k = quote - 1
            while at[k] == 0x5C:
                k -= 1
            if (quote - k) % 2 == 1:
                return quote + 1  # an even run of backslashes (or none) before it: it closes the string
            i = quote + 1


#: The scan :func:`loads` runs: the loop where it is compiled (a C function,
#: not a Python one), the bytes operations where it is not.
_scan = _scan_classes if isinstance(_scan_loop, FunctionType) else _scan_loop


_OPTIONS: Final = orjson.OPT_PASSTHROUGH_SUBCLASS


class JsonError(ValueError):
    """The bytes are not a JSON document Narwhal accepts; the message says why."""


class RawFloat(float):
    """A JSON number with a fraction or exponent, remembering its exact text."""

    __slots__ = ("text",)
    text: str

    def __new__(cls, text: str) -> RawFloat:
        self = super().__new__(cls, text)
        self.text = text
        return self


class RawInt(int):
    """A JSON integer too large for 64 bits, remembering its exact text."""

    text: str

    def __new__(cls, text: str) -> RawInt:
        self = super().__new__(cls, text)
        self.text = text
        return self


def _parse_int(text: str) -> int:
    # 18 digits always fit in 64 bits; longer ones keep their text.
    if len(text) <= 18:
        return int(text)
    if len(text) > MAX_INT_DIGITS:
        raise JsonError(f"integer literal longer than {MAX_INT_DIGITS} digits")
    return RawInt(text)


def _reject_constant(name: str) -> Any:
    raise JsonError(f"{name} is not valid JSON")


_EXACT: Final = json.JSONDecoder(
    parse_float=RawFloat, parse_int=_parse_int, parse_constant=_reject_constant
)


def _default(obj: Any) -> Any:
    if isinstance(obj, (RawFloat, RawInt)):
        return orjson.Fragment(obj.text)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _depth_ok(data: bytes) -> bool:
    # Only run on the exact path: a bracket count that ignores string contents.
    depth = 0
    in_string = False
    escaped = False
    for b in data:
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:
                escaped = True
            elif b == 0x22:
                in_string = False
        elif b == 0x22:
            in_string = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif b in (0x5D, 0x7D):
            depth -= 1
    return True


def loads(data: bytes) -> Any:
    """Decode a JSON document exactly; raise :class:`JsonError` if it is not JSON."""
    # One C-speed pass looks for risky numbers and counts openers, the cheap
    # bound on depth (only a body with many needs the string-aware scan).
    scan = _scan(data)
    if len(data) >= _DEEP_SIZE and scan > 2 * MAX_DEPTH + 1 and not _depth_ok(data):
        raise JsonError(f"JSON nesting deeper than {MAX_DEPTH} levels")
    if not scan & 1:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            if "infinity" not in exc.msg:
                raise JsonError(_describe(exc)) from None
            # A huge exponent (1e400): valid JSON, kept exactly by the exact path.
    return _loads_exact(data)


def loads_answer(data: bytes) -> Any:
    """Decode an engine's answer (or one stream event): orjson first.

    The exactness :func:`loads` guarantees is owed to what clients send
    (docs/contract.md, "Request rules"); an engine's numbers were written
    by a JSON encoder from doubles, and orjson reads them back to the same
    doubles and writes the same shortest text. Anything orjson refuses (``1e400``, or not JSON at
    all) goes through :func:`loads`, for its exactness or its error.
    """
    if len(data) >= _DEEP_SIZE and data.count(b"[") + data.count(b"{") > MAX_DEPTH and not _depth_ok(data):
        raise JsonError(f"JSON nesting deeper than {MAX_DEPTH} levels")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return _loads_exact(data)


def _loads_exact(data: bytes) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise JsonError("body is not valid UTF-8") from None
    try:
        value = _EXACT.decode(text)
    except json.JSONDecodeError as exc:
        raise JsonError(f"invalid JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise JsonError(f"JSON nesting deeper than {MAX_DEPTH} levels") from None
    try:
        # Lone surrogates decode in the standard library but are not text.
        orjson.dumps(value, default=_default, option=_OPTIONS)
    except orjson.JSONEncodeError as exc:
        if "surrogate" in str(exc):
            raise JsonError("body contains a lone surrogate (not valid Unicode)") from None
        raise JsonError(f"body cannot be re-encoded: {exc}") from None
    return value


def _describe(exc: orjson.JSONDecodeError) -> str:
    if "depth" in exc.msg:
        return f"JSON nesting deeper than {MAX_DEPTH} levels"
    if "utf-8" in exc.msg.lower() or "surrogate" in exc.msg.lower():
        return "body is not valid UTF-8 JSON text"
    return f"invalid JSON: {exc.msg} at position {exc.pos}"


def dumps(value: Any) -> bytes:
    """Encode a value decoded by :func:`loads` (or built from plain types) as compact JSON."""
    try:
        return orjson.dumps(value, default=_default, option=_OPTIONS)
    except orjson.JSONEncodeError as exc:
        if "64-bit" not in str(exc):
            raise
    # Plain ints beyond 64 bits (not from loads, which keeps their text).
    return orjson.dumps(_wide_ints(value), default=_default, option=_OPTIONS)


def dumps_line(value: Any) -> bytes:
    """:func:`dumps` followed by a newline (one JSON Lines record)."""
    try:
        return orjson.dumps(value, default=_default, option=_OPTIONS | orjson.OPT_APPEND_NEWLINE)
    except orjson.JSONEncodeError as exc:
        if "64-bit" not in str(exc):
            raise
    return dumps(value) + b"\n"


def _wide_ints(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _wide_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wide_ints(v) for v in value]
    if type(value) is int and not -(2**63) <= value < 2**64:
        return RawInt(str(value))
    return value
