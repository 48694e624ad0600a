"""RESP2, the protocol Redis speaks, sans-IO: a command's bytes out, replies parsed in (docs/operate.md, "Budgets across replicas").

Three calls, as the HTTP/1.1 codec has them: :func:`encode_command` turns
a command into the array of bulk strings a client sends;
:meth:`RespParser.receive_data` buffers what the server sent and
:meth:`RespParser.next_reply` pulls the next whole reply, or
:data:`NEED_DATA`. Bytes may be fed split anywhere: a reply is parsed from
its first byte again once more arrive, and taken from the buffer only when
whole, so feeding one byte at a time gives the same replies as feeding all
at once.

Replies are plain values: a simple string is a :class:`SimpleString`, an
error reply a :class:`ErrorReply` (a value, not an exception: a script's
``NOSCRIPT`` is an answer the caller acts on), an integer an ``int``, a
bulk string ``bytes``, an array a ``list`` of replies, and the nil bulk
string and nil array both ``None``. :func:`encode_reply` writes a reply the
way a server does; the tests use it as the parser's round trip.

Each reply is bounded (a bulk string's length, an array's, how deep arrays
nest, a line's length): a server that sends more, or bytes that are not
RESP2, raises :class:`RespProtocolError`, after which the parser is not
to be used again.
"""

from __future__ import annotations

import re
from typing import Final, TypeAlias, Union

import attrs

__all__ = [
    "NEED_DATA", "NeedData", "SimpleString", "ErrorReply", "Reply", "RespProtocolError", "RespParser",
    "encode_command", "encode_reply",
]

_CRLF: Final = b"\r\n"
_INTEGER: Final = re.compile(rb"-?[0-9]{1,19}\Z")


class NeedData:
    """:meth:`RespParser.next_reply` has no whole reply yet: feed more bytes."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


#: The one :class:`NeedData`.
NEED_DATA: Final = NeedData()


@attrs.frozen
class SimpleString:
    """A simple string reply (``+OK``)."""

    value: bytes
    """Its bytes, without the ``+`` and the CRLF."""

    def __attrs_post_init__(self) -> None:
        if b"\r" in self.value or b"\n" in self.value:
            raise ValueError("a simple string holds no CR or LF")


@attrs.frozen
class ErrorReply:
    """An error reply (``-NOSCRIPT No matching script``)."""

    message: str
    """Its text, without the ``-`` and the CRLF; its first word is the error's kind."""

    def __attrs_post_init__(self) -> None:
        if "\r" in self.message or "\n" in self.message:
            raise ValueError("an error reply holds no CR or LF")

    @property
    def kind(self) -> str:
        """The first word: ``ERR``, ``NOSCRIPT``, ``WRONGTYPE``..."""
        return self.message.split(" ", 1)[0]


Reply: TypeAlias = Union[SimpleString, ErrorReply, int, bytes, None, list["Reply"]]


class RespProtocolError(Exception):
    """The server's bytes are not RESP2, or a reply is past the parser's limits."""


def encode_command(*args: bytes | str | int) -> bytes:
    """The bytes of one command: an array of bulk strings (``str`` as UTF-8, ``int`` in decimal)."""
    if not args:
        raise ValueError("a command has at least its name")
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bool) or not isinstance(arg, (bytes, str, int)):
            raise TypeError(f"a command's argument is bytes, str or int, not {type(arg).__name__}")
        data = arg.encode() if isinstance(arg, str) else b"%d" % arg if isinstance(arg, int) else arg
        parts += (b"$%d\r\n" % len(data), data, _CRLF)
    return b"".join(parts)


def encode_reply(reply: Reply) -> bytes:
    """The bytes a server writes for ``reply`` (``None`` as the nil bulk string)."""
    if reply is None:
        return b"$-1\r\n"
    if isinstance(reply, SimpleString):
        return b"+" + reply.value + _CRLF
    if isinstance(reply, ErrorReply):
        return b"-" + reply.message.encode() + _CRLF
    if isinstance(reply, bool):
        raise TypeError("a reply is no bool")
    if isinstance(reply, int):
        return b":%d\r\n" % reply
    if isinstance(reply, bytes):
        return b"$%d\r\n" % len(reply) + reply + _CRLF
    return b"*%d\r\n" % len(reply) + b"".join(encode_reply(item) for item in reply)


class RespParser:
    """Replies from the bytes a Redis server sends, in order, however the bytes were split."""

    __slots__ = ("max_bulk_bytes", "max_array_length", "max_depth", "max_line_bytes", "_buffer")

    def __init__(self, *, max_bulk_bytes: int = 1 << 20, max_array_length: int = 1 << 16,
                 max_depth: int = 8, max_line_bytes: int = 1 << 16) -> None:
        #: The longest bulk string taken.
        self.max_bulk_bytes = max_bulk_bytes
        #: The most elements an array may have.
        self.max_array_length = max_array_length
        #: How deep arrays may nest (1: an array of scalars).
        self.max_depth = max_depth
        #: The longest line (a simple string, an error, a length) taken.
        self.max_line_bytes = max_line_bytes
        self._buffer = bytearray()

    def receive_data(self, data: bytes) -> None:
        """Bytes the server sent, as they came."""
        self._buffer += data

    @property
    def buffered(self) -> int:
        """How many bytes wait to be parsed (part of a reply, or whole ones not pulled yet)."""
        return len(self._buffer)

    def next_reply(self) -> Reply | NeedData:
        """The next whole reply, or :data:`NEED_DATA`; raises :class:`RespProtocolError`."""
        parsed = self._parse(0, 0)
        if parsed is NEED_DATA:
            return NEED_DATA
        assert isinstance(parsed, tuple)
        reply, end = parsed
        del self._buffer[:end]
        return reply

    def _line(self, pos: int) -> tuple[bytes, int] | NeedData:
        buf = self._buffer
        end = buf.find(_CRLF, pos)
        if end < 0:
            if len(buf) - pos > self.max_line_bytes + 1:
                raise RespProtocolError(f"a line longer than {self.max_line_bytes} bytes")
            return NEED_DATA
        if end - pos - 1 > self.max_line_bytes:
            raise RespProtocolError(f"a line longer than {self.max_line_bytes} bytes")
        return bytes(buf[pos + 1:end]), end + 2

    def _parse(self, pos: int, depth: int) -> tuple[Reply, int] | NeedData:
        buf = self._buffer
        if pos >= len(buf):
            return NEED_DATA
        line = self._line(pos)
        if line is NEED_DATA:
            return NEED_DATA
        assert isinstance(line, tuple)
        text, after = line
        kind = buf[pos]
        if kind == 0x2B:  # +
            if b"\r" in text or b"\n" in text:
                raise RespProtocolError("a simple string holds a CR or LF")
            return SimpleString(text), after
        if kind == 0x2D:  # -
            if b"\r" in text or b"\n" in text:
                raise RespProtocolError("an error reply holds a CR or LF")
            return ErrorReply(text.decode("utf-8", "replace")), after
        if kind == 0x3A:  # :
            return _integer(text), after
        if kind == 0x24:  # $
            return self._bulk(_integer(text), after)
        if kind == 0x2A:  # *
            return self._array(_integer(text), after, depth + 1)
        raise RespProtocolError(f"a reply starts with {bytes([kind])!r}, no RESP2 type")

    def _bulk(self, length: int, pos: int) -> tuple[Reply, int] | NeedData:
        if length == -1:
            return None, pos
        if not 0 <= length <= self.max_bulk_bytes:
            raise RespProtocolError(f"a bulk string of {length} bytes (at most {self.max_bulk_bytes})")
        buf = self._buffer
        end = pos + length
        if len(buf) < end + 2:
            return NEED_DATA
        if buf[end:end + 2] != _CRLF:
            raise RespProtocolError("a bulk string not ended by CRLF where its length says")
        return bytes(buf[pos:end]), end + 2

    def _array(self, length: int, pos: int, depth: int) -> tuple[Reply, int] | NeedData:
        if length == -1:
            return None, pos
        if not 0 <= length <= self.max_array_length:
            raise RespProtocolError(f"an array of {length} elements (at most {self.max_array_length})")
        if depth > self.max_depth:
            raise RespProtocolError(f"arrays nested deeper than {self.max_depth}")
        items: list[Reply] = []
        for _ in range(length):
            parsed = self._parse(pos, depth)
            if parsed is NEED_DATA:
                return NEED_DATA
            assert isinstance(parsed, tuple)
            item, pos = parsed
            items.append(item)
        return items, pos


def _integer(text: bytes) -> int:
    if not _INTEGER.match(text):
        raise RespProtocolError(f"not an integer: {text[:32]!r}")
    return int(text)
