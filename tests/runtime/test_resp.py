"""The RESP2 codec (narwhal_runtime/resp.py): round trips, bytes split anywhere, limits and bad bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal_runtime.resp import (
    NEED_DATA, ErrorReply, Reply, RespParser, RespProtocolError, SimpleString, encode_command, encode_reply,
)

_line_bytes = st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)
_line_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=40)
_scalars = st.one_of(
    st.none(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.binary(max_size=64),
    _line_bytes.map(SimpleString),
    _line_text.map(ErrorReply),
)
replies: st.SearchStrategy[Reply] = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=6), max_leaves=30,
)


def parse_all(data: bytes, chunk: int | None = None) -> list[Reply]:
    """Every whole reply in ``data``, fed all at once or ``chunk`` bytes at a time."""
    parser = RespParser()
    out: list[Reply] = []
    pieces = [data] if chunk is None else [data[i:i + chunk] for i in range(0, len(data), chunk)]
    for piece in pieces:
        parser.receive_data(piece)
        while (reply := parser.next_reply()) is not NEED_DATA:
            out.append(reply)
    assert parser.buffered == 0
    return out


@given(st.lists(replies, min_size=1, max_size=4))
def test_replies_round_trip_through_the_parser(values: list[Reply]) -> None:
    data = b"".join(encode_reply(v) for v in values)
    assert parse_all(data) == values


@given(st.lists(replies, min_size=1, max_size=3))
def test_byte_at_a_time_gives_the_same_replies_as_all_at_once(values: list[Reply]) -> None:
    data = b"".join(encode_reply(v) for v in values)
    assert parse_all(data, chunk=1) == parse_all(data) == values


@given(replies, st.data())
def test_a_reply_split_at_any_byte_parses_once_whole(value: Reply, data: st.DataObject) -> None:
    encoded = encode_reply(value)
    cut = data.draw(st.integers(min_value=0, max_value=len(encoded)))
    parser = RespParser()
    parser.receive_data(encoded[:cut])
    if cut < len(encoded):
        assert parser.next_reply() is NEED_DATA
    parser.receive_data(encoded[cut:])
    assert parser.next_reply() == value
    assert parser.next_reply() is NEED_DATA


def test_a_script_reply_split_at_every_byte() -> None:
    # The shape the shared budget script answers: [granted, "seconds"].
    encoded = b"*2\r\n:7\r\n$5\r\n0.125\r\n"
    for cut in range(len(encoded) + 1):
        parser = RespParser()
        parser.receive_data(encoded[:cut])
        if cut < len(encoded):
            assert parser.next_reply() is NEED_DATA, cut
        parser.receive_data(encoded[cut:])
        assert parser.next_reply() == [7, b"0.125"], cut


@given(st.lists(st.one_of(st.binary(max_size=30), st.text(st.characters(blacklist_categories=("Cs",)), max_size=10),
                          st.integers(min_value=-(10**12), max_value=10**12)), min_size=1, max_size=8))
def test_a_command_is_an_array_of_bulk_strings(args: list[bytes | str | int]) -> None:
    (parsed,) = parse_all(encode_command(*args))
    assert parsed == [a.encode() if isinstance(a, str) else b"%d" % a if isinstance(a, int) else a for a in args]


def test_the_nil_array_and_the_nil_bulk_string_are_none() -> None:
    assert parse_all(b"*-1\r\n$-1\r\n*2\r\n$-1\r\n*0\r\n") == [None, None, [None, []]]


def test_an_error_reply_names_its_kind() -> None:
    (reply,) = parse_all(b"-NOSCRIPT No matching script. Please use EVAL.\r\n")
    assert isinstance(reply, ErrorReply) and reply.kind == "NOSCRIPT"


@pytest.mark.parametrize("data, words", [
    (b"!3\r\nabc\r\n", "no RESP2 type"),
    (b":12a\r\n", "not an integer"),
    (b": 12\r\n", "not an integer"),
    (b"$3\r\nabcd\r\n", "not ended by CRLF"),
    (b"$-2\r\n", "bulk string of -2"),
    (b"$2000000\r\n", "bulk string of 2000000"),
    (b"*100000\r\n", "array of 100000"),
    (b"*1\r\n" * 9 + b":1\r\n", "nested deeper than 8"),
    (b"+" + b"a" * 70000, "line longer"),
])
def test_bad_or_oversized_bytes_raise_a_protocol_error(data: bytes, words: str) -> None:
    parser = RespParser()
    parser.receive_data(data)
    with pytest.raises(RespProtocolError, match=words):
        parser.next_reply()


def test_limits_are_constructor_parameters() -> None:
    parser = RespParser(max_bulk_bytes=4, max_array_length=2, max_depth=1)
    parser.receive_data(b"$4\r\nabcd\r\n*2\r\n:1\r\n:2\r\n")
    assert parser.next_reply() == b"abcd" and parser.next_reply() == [1, 2]
    for data in (b"$5\r\nabcde\r\n", b"*3\r\n", b"*1\r\n*1\r\n:1\r\n"):
        parser = RespParser(max_bulk_bytes=4, max_array_length=2, max_depth=1)
        parser.receive_data(data)
        with pytest.raises(RespProtocolError):
            parser.next_reply()


def test_encode_command_refuses_what_is_not_bytes_str_or_int() -> None:
    with pytest.raises(TypeError):
        encode_command(b"SET", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode_command(b"SET", True)
    with pytest.raises(ValueError):
        encode_command()
