"""Coverage-guided fuzzing of the client-facing codec and the request contract (atheris; not run in CI).

Each input is split in two by its first byte: the rest is fed to the
codec's oracle (``tests/core/http_reference.py``: h11 with the codec's
strictness) in two reads at that point (and whole, to it and to the codec's
:class:`narwhal_core.http.ServerConnection`, which must parse the same), and
every request that comes out has its body checked by
:func:`narwhal_core.contract.check_request`. A crash is any exception other
than the expected ``RemoteProtocolError`` / ``ContractError``, a 5xx other
than 505 for a client's bytes, buffered bytes over the codec's bound, a parse
that depends on where the bytes were split, or an accepted body that does
not survive re-encoding, or a difference between the codec and its oracle.

    python -m venv /tmp/atheris && /tmp/atheris/bin/pip install atheris
    PYTHONPATH=.:$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])') \\
        /tmp/atheris/bin/python benchmarks/fuzz_atheris.py -max_total_time=120 [corpus_dir]

Any libFuzzer flag works (``-runs=N``, ``-max_len=4096``, ``-jobs=2``...).
Without ``-max_total_time`` or ``-runs`` the script adds ``-max_total_time=60``
so that it always ends.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["narwhal_core", "h11"]):
    from narwhal_core import wire
    from narwhal_core.contract import check_request, is_router_owned
    from narwhal_core.errors import ContractError, RemoteProtocolError
    from narwhal_core.http import NEED_DATA, PAUSED, ContinueExpected, HttpRequest, ServerConnection
    from tests.core.http_reference import ReferenceServerConnection

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
NAMES = frozenset({MODEL, "llama-3.1-8b"})
ROUTES = ("/v1/completions", "/v1/chat/completions")
LIMITS = {"max_request_line_bytes": 512, "max_header_bytes": 2048, "max_headers": 32, "max_body_bytes": 16384}
BOUND = LIMITS["max_request_line_bytes"] + LIMITS["max_header_bytes"] + LIMITS["max_body_bytes"] + 4


def _parse(chunks: list[bytes], codec: type[ServerConnection] = ReferenceServerConnection) -> tuple[list[tuple[object, ...]], int | None]:
    conn = codec(**LIMITS)
    events: list[tuple[object, ...]] = []
    # An empty read means EOF: only the last one may be empty.
    for chunk in [*(c for c in chunks if c), b""]:
        conn.receive_data(chunk)
        if len(conn._buf) > BOUND:  # noqa: SLF001 - the bound under test
            raise AssertionError(f"{len(conn._buf)} bytes buffered, bound {BOUND}")  # noqa: SLF001
        while True:
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                if exc.status >= 500 and exc.status != 505:
                    raise AssertionError(f"client bytes answered with {exc.status}") from exc
                return events, exc.status if exc.reason != "dropped" else None
            if event is NEED_DATA:
                break
            if event is PAUSED:
                return events, None
            if isinstance(event, ContinueExpected):
                events.append(("continue", event.method, event.target, event.headers, event.content_length))
                conn.send_continue()
            elif isinstance(event, HttpRequest):
                events.append(("request", event.method, event.target, event.headers, event.body))
                conn.send_response(200, [], b"")
                if conn.must_close:
                    return events, None
            else:
                return events, None
    return events, None


def _check_body(target: str, body: bytes) -> None:
    route = target.partition("?")[0]
    if route not in ROUTES:
        route = ROUTES[len(body) % 2]
    try:
        accepted = check_request(route, body, NAMES, MODEL)  # type: ignore[arg-type]
    except ContractError as exc:
        if exc.status not in (400, 404):
            raise AssertionError(f"contract answered {exc.status}") from exc
        return
    if accepted.body.get("model") != MODEL or any(is_router_owned(k) for k in accepted.body):
        raise AssertionError(f"accepted body not cleaned: {accepted.body!r}")
    if wire.loads(wire.dumps(accepted.body)) != accepted.body:
        raise AssertionError("accepted body does not survive re-encoding")


def test_one_input(data: bytes) -> None:
    if not data:
        return
    cut, rest = data[0], data[1:]
    whole = _parse([rest])
    split = _parse([rest[: cut % (len(rest) + 1)], rest[cut % (len(rest) + 1):]])
    if whole != split:
        raise AssertionError(f"the parse depends on the split: {whole!r} != {split!r}")
    # The codec must parse exactly as its oracle (h11) does.
    fast = _parse([rest], ServerConnection)
    if fast != whole:
        raise AssertionError(f"the codec parses differently from its oracle: {fast!r} != {whole!r}")
    for event in whole[0]:
        if event[0] == "request":
            _check_body(str(event[2]), event[4])  # type: ignore[arg-type]
    # The body parser alone, on the raw input too (most inputs are not HTTP).
    _check_body(ROUTES[cut % 2], rest)


def main() -> None:
    argv = list(sys.argv)
    if not any(a.startswith(("-max_total_time", "-runs")) for a in argv[1:]):
        argv.append("-max_total_time=60")
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
