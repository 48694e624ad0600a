"""Request and backend IDs (docs/contract.md, "Prefill and decode legs"; "The engine request": client_rid)."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from narwhal_core.errors import NarwhalError
from narwhal_core.ids import RidSource, backend_id, parse_backend_id, sanitize_client_rid

from ..corebuild import examples

RID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-"
BACKEND_ID = re.compile(r"[A-Za-z0-9-]{1,128}\Z")

rids = st.text(alphabet=RID_ALPHABET, min_size=1, max_size=100)
# Rids full of dashes and digits are the ones that could make a suffix ambiguous.
tricky_rids = st.text(alphabet="-0123456789pd", min_size=1, max_size=100)
phases = st.sampled_from(["prefill", "decode"])
attempts = st.integers(min_value=1, max_value=999_999)
triples = st.tuples(st.one_of(rids, tricky_rids), phases, attempts)


@settings(max_examples=examples(500), deadline=None)
@given(triple=triples)
@example(triple=("a" * 100, "prefill", 999_999))
@example(triple=("-", "decode", 1))
@example(triple=("x-p1", "prefill", 1))
@example(triple=("x-p", "prefill", 11))
@example(triple=("1-d2-p3", "decode", 10))
def test_backend_id_shape_and_inverse(triple: tuple[str, str, int]) -> None:
    rid, phase, attempt = triple
    value = backend_id(rid, phase, attempt)  # type: ignore[arg-type]
    assert BACKEND_ID.match(value), value
    assert len(value) <= 128
    assert parse_backend_id(value) == (rid, phase, attempt)


@settings(max_examples=examples(1000), deadline=None)
@given(a=triples, b=triples)
@example(a=("x-p1", "prefill", 1), b=("x", "prefill", 1))
@example(a=("x-p", "prefill", 11), b=("x-p1", "prefill", 1))
@example(a=("x", "prefill", 11), b=("x-p1", "prefill", 1))
@example(a=("a-d1", "decode", 1), b=("a", "decode", 1))
def test_backend_id_is_injective(a: tuple[str, str, int], b: tuple[str, str, int]) -> None:
    if a != b:
        assert backend_id(*a) != backend_id(*b), (a, b)  # type: ignore[arg-type]
    else:
        assert backend_id(*a) == backend_id(*b)  # type: ignore[arg-type]


@settings(max_examples=examples(300), deadline=None)
@given(rid=st.one_of(rids, tricky_rids), attempt=attempts, other=attempts)
def test_retries_get_new_backend_ids(rid: str, attempt: int, other: int) -> None:
    """docs/contract.md, "Prefill and decode legs": a retried leg gets a new backend ID; the two phases never
    share one."""
    assert backend_id(rid, "prefill", attempt) != backend_id(rid, "decode", attempt)
    if attempt != other:
        assert backend_id(rid, "prefill", attempt) != backend_id(rid, "prefill", other)


def test_documented_examples() -> None:
    assert backend_id("abc", "prefill", 1) == "abc-p1"
    assert backend_id("abc", "decode", 1) == "abc-d1"


invalid_rids = st.one_of(
    st.just(""),
    st.text(alphabet=RID_ALPHABET, min_size=101, max_size=200),
    st.text(min_size=1, max_size=50).filter(lambda t: any(c not in RID_ALPHABET for c in t)),
    st.sampled_from(["a\n", "a b", "a_b", "é", "a.b", "abc\x00", "ab\u0660"]),
)


@settings(max_examples=examples(200), deadline=None)
@given(rid=invalid_rids, phase=phases, attempt=attempts)
def test_invalid_rid_is_refused(rid: str, phase: str, attempt: int) -> None:
    with pytest.raises(NarwhalError):
        backend_id(rid, phase, attempt)  # type: ignore[arg-type]


@settings(max_examples=examples(200), deadline=None)
@given(rid=rids, phase=phases, attempt=st.one_of(st.integers(max_value=0), st.integers(min_value=1_000_000)))
@example(rid="a", phase="prefill", attempt=0)
@example(rid="a", phase="prefill", attempt=-1)
@example(rid="a", phase="decode", attempt=1_000_000)
def test_invalid_attempt_is_refused(rid: str, phase: str, attempt: int) -> None:
    with pytest.raises(NarwhalError):
        backend_id(rid, phase, attempt)  # type: ignore[arg-type]


@pytest.mark.parametrize("attempt", [1.0, 1.5, True, "1", None], ids=repr)
def test_non_integer_attempt_is_refused(attempt: object) -> None:
    """An attempt that is not an int must not produce an ID outside ``[A-Za-z0-9-]`` (e.g. ``rid-p1.5``)."""
    try:
        value = backend_id("abc", "prefill", attempt)  # type: ignore[arg-type]
    except NarwhalError:
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"backend_id raised {type(exc).__name__}, not NarwhalError: {exc!r}")
    assert BACKEND_ID.match(value), f"backend_id('abc', 'prefill', {attempt!r}) = {value!r}"
    pytest.fail(f"backend_id accepted attempt {attempt!r} and returned {value!r}")


@pytest.mark.parametrize("phase", ["p", "mixed"])
def test_invalid_phase_raises_narwhal_error(phase: str) -> None:
    """One error family escapes the core (docs/design.md): not a bare KeyError."""
    with pytest.raises(NarwhalError):
        backend_id("abc", phase, 1)  # type: ignore[arg-type]


@settings(max_examples=examples(300), deadline=None)
@given(value=st.text(max_size=150))
@example(value="abc-p0")
@example(value="abc-p01")
@example(value="-p1")
@example(value="abc-x1")
@example(value="abc-p1\n")
@example(value="a" * 101 + "-p1")
def test_parse_backend_id_accepts_only_backend_ids(value: str) -> None:
    try:
        rid, phase, attempt = parse_backend_id(value)
    except NarwhalError:
        return
    # Whatever it accepts, it must be the backend ID of what it returns.
    assert backend_id(rid, phase, attempt) == value


@settings(max_examples=examples(100), deadline=None)
@given(
    prefix=st.text(alphabet=RID_ALPHABET.replace("-", ""), min_size=1, max_size=64),
    start=st.integers(min_value=0, max_value=2**48),
    count=st.integers(min_value=1, max_value=300),
)
def test_rid_source_gives_distinct_valid_rids(prefix: str, start: int, count: int) -> None:
    source = RidSource(prefix, start)
    seen = [source() for _ in range(count)]
    assert len(set(seen)) == count
    for rid in seen:
        assert rid.startswith(prefix)
        # Every rid must be usable for backend IDs of every attempt.
        assert BACKEND_ID.match(backend_id(rid, "decode", 999_999))


def test_rid_source_is_deterministic() -> None:
    assert [RidSource("n1")() for _ in range(2)] == [RidSource("n1")()] * 2
    source = RidSource("n1")
    assert [source(), source()] != [RidSource("n1")()] * 2


@pytest.mark.parametrize("prefix", ["", "a-b", "a b", "é", "a" * 65])
def test_rid_source_refuses_bad_prefixes(prefix: str) -> None:
    with pytest.raises(NarwhalError):
        RidSource(prefix)


@settings(max_examples=examples(500), deadline=None)
@given(raw=st.one_of(st.binary(max_size=600), st.text(max_size=200).map(lambda t: t.encode("utf-8"))))
@example(raw=b"")
@example(raw=b"\\" * 200)
@example(raw=b"\x00" * 100)
@example(raw=b"a" * 127 + b"\xff")
@example(raw=b"a" * 500)
def test_sanitize_client_rid_is_bounded_and_printable(raw: bytes) -> None:
    out = sanitize_client_rid(raw)
    assert isinstance(out, str)
    assert len(out) <= 128
    assert all(0x20 <= ord(c) < 0x7F for c in out), out
    # Printable ASCII (other than the escape character) survives as is, up to the cut.
    if all(0x20 <= b < 0x7F and b != 0x5C for b in raw):
        assert out == raw[:128].decode("ascii")
    # Nothing non-printable is trusted: no control characters, no raw non-ASCII.
    assert "\n" not in out and "\r" not in out


def test_sanitize_client_rid_escapes_are_unambiguous() -> None:
    assert sanitize_client_rid(None) is None
    assert sanitize_client_rid(b"\\x41") != sanitize_client_rid(b"A")
    assert sanitize_client_rid(b"\n") != sanitize_client_rid(b"\\x0a")
