"""What every test suite shares: the contract's names, checks of answers, the journal, ports.

One home for the small things the pure core tests, the simulator tests and
the end-to-end, reliability and security suites all need, so that none of
them keeps its own copy: the model and route names, the prefill leg's
``kv_transfer_params``, the OpenAI error envelope check, the request ID
check, readers of the journal file, bounded polling, loopback ports, the
process's TCP sockets and their options, and a
tokenizer both a router and the simulator can load.
Nothing here starts a router (that is :mod:`tests.harness`, in a thread, and
:mod:`tests.serving`, as a process), so importing it costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from narwhal_core.auth import api_key_digest

from .rawhttp import Response as RawResponse

#: The repository's root.
REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------ the contract

#: The model every test router serves, and its one alias.
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ALIAS = "llama-3.1-8b"

#: The completion routes (docs/contract.md, "Request rules").
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
COMPLETION_PATHS = (COMPLETIONS, CHAT)

#: Run a test once per completion route, as ``route``.
each_route = pytest.mark.parametrize("route", COMPLETION_PATHS, ids=["completions", "chat"])

#: What the prefill leg asks of the engine (docs/contract.md, "Prefill and decode legs").
PREFILL_KV_REQUEST: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Header names Narwhal may write on a leg: anything else would be forwarded client state.
LEG_HEADERS = frozenset({"host", "content-type", "content-length", "x-request-id", "authorization"})

#: What a router request ID looks like: at most 100 of [A-Za-z0-9-] (docs/contract.md, "Prefill and decode legs").
RID_RE = re.compile(r"[A-Za-z0-9-]{1,100}\Z")
#: A backend ID: at most 128 characters of [A-Za-z0-9-].
BACKEND_ID_RE = re.compile(r"[A-Za-z0-9-]{1,128}\Z")


def body_for(route: str, text: str = "The narwhal is", **fields: Any) -> dict[str, Any]:
    """A minimal valid body for ``route``: the model, the prompt or one user message, then ``fields``."""
    if route == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}
    return {"model": MODEL, "prompt": text, **fields}


def keys_file_text(keys: Mapping[str, str]) -> str:
    """The text of an api_keys file (docs/security.md) for ``{client: key}``: SHA-256 digests only."""
    return "".join(
        f'[[keys]]\nclient = "{client}"\nsha256 = "{api_key_digest(key)}"\n\n' for client, key in keys.items()
    )


def write_keys_file(path: Path, keys: Mapping[str, str]) -> Path:
    """:func:`keys_file_text` written to ``path``; returns ``path``."""
    path.write_text(keys_file_text(keys))
    return path


# --------------------------------------------------------------- answers


def _status(response: Any) -> int:
    return response.status if isinstance(response, RawResponse) else int(response.status_code)


def _header(response: Any, name: str) -> str | None:
    if isinstance(response, RawResponse):
        return response.header(name)
    return response.headers.get(name)  # type: ignore[no-any-return]


def _text(response: Any) -> str:
    return response.body[:300].decode("utf-8", "replace") if isinstance(response, RawResponse) else response.text


def assert_envelope(
    response: Any,
    status: int,
    *,
    type: str | None | object,
    code: str | None | object = ...,
    param: str | None | object = ...,
    retry_after: bool | None = None,
) -> dict[str, Any]:
    """Check an OpenAI error envelope (docs/contract.md, "Responses and errors"); return its ``error`` object.

    ``response`` is an httpx response or a :class:`tests.rawhttp.Response`.
    ``type``, ``code`` and ``param`` are checked unless given as ``...``;
    ``retry_after`` True wants a whole-seconds ``Retry-After``, False none.
    """
    assert _status(response) == status, (_status(response), _text(response))
    assert (_header(response, "content-type") or "").startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    if type is not ...:
        assert error["type"] == type, error
    if code is not ...:
        assert error["code"] == code, error
    if param is not ...:
        assert error["param"] == param, error
    if retry_after is True:
        value = _header(response, "retry-after")
        assert value is not None and value.isdigit(), response.headers
    elif retry_after is False:
        assert _header(response, "retry-after") is None, response.headers
    return error  # type: ignore[no-any-return]


def rid_of(response: Any) -> str:
    """The router request ID a response carries; it must look like one."""
    rid = _header(response, "x-request-id")
    assert rid is not None, f"no x-request-id on {_status(response)}"
    assert RID_RE.match(rid), rid
    return rid


def sse_payloads(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking that every event is one well-formed ``data:`` line."""
    assert text.endswith("\n\n"), text[-300:]
    payloads = []
    for event in text.split("\n\n")[:-1]:
        lines = event.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), repr(event)
        payloads.append(lines[0][len("data: "):])
    return payloads


# --------------------------------------------------------------- engines


def completion_records(engines: Any) -> list[dict[str, Any]]:
    """Every completion request the simulated engines received (probes and control requests left out).

    ``engines`` is a :class:`tests.harness.Fleet` or any iterable of simulators.
    """
    out: list[dict[str, Any]] = []
    for engine in engines.all() if hasattr(engines, "all") else engines:
        out.extend(r for r in engine.requests() if r["path"].split("?")[0] in COMPLETION_PATHS)
    return out


def header_pairs(record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The headers an engine received, names lowercased, in order."""
    return [(name.lower(), value) for name, value in record["headers"]]


def header_values(record: Mapping[str, Any], name: str) -> list[str]:
    """Every value of one header an engine received."""
    return [value for n, value in header_pairs(record) if n == name.lower()]


# --------------------------------------------------------------- polling


def poll(predicate: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.01,
         what: str = "condition") -> Any:
    """Call ``predicate`` until it returns something truthy; that value, or TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s (last: {value!r})")
        time.sleep(interval)


# ----------------------------------------------------------- the journal


def read_journal(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete record of a journal file (a line still being written, after the last newline, is left out)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.split(b"\n") if line.strip()]


def wait_for_terminals(
    path: str | os.PathLike[str], count: int, timeout: float = 10.0
) -> list[dict[str, Any]]:
    """Poll the journal until it holds ``count`` terminal records; return all records."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_journal(path)
        if sum(1 for r in records if r.get("terminal") is not None) >= count:
            return records
        if time.monotonic() > deadline:
            raise TimeoutError(f"journal has {len(records)} records, wanted {count} terminal ones: {records}")
        time.sleep(0.01)


def journal_terminal(journal_path: str | os.PathLike[str], rid: str, timeout: float = 10.0) -> dict[str, Any]:
    """Wait for the terminal record of ``rid``; check it is its only one and its last record (docs/contract.md, "The journal")."""

    def find() -> list[dict[str, Any]] | None:
        records = [r for r in read_journal(journal_path) if r.get("rid") == rid]
        return records if any(r.get("terminal") is not None for r in records) else None

    records = poll(find, timeout=timeout, what=f"terminal record of {rid}")
    terminals = [r for r in records if r.get("terminal") is not None]
    assert len(terminals) == 1, terminals
    assert records[-1] is terminals[0], records
    return terminals[0]


def terminals_by_rid(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The terminal record of each rid (asserting there is exactly one, and it is last)."""
    out: dict[str, dict[str, Any]] = {}
    last: dict[str, dict[str, Any]] = {}
    for record in records:
        rid = record["rid"]
        if rid in out:
            raise AssertionError(f"record after the terminal record of {rid}: {record}")
        last[rid] = record
        if record.get("terminal") is not None:
            out[rid] = record
    missing = set(last) - set(out)
    assert not missing, f"rids without a terminal record: {missing}"
    return out


def assert_journal_consistent(journal_path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Every rid in the journal file has exactly one terminal record, and it is its last; those records by rid."""
    return terminals_by_rid(read_journal(journal_path))


def only_terminals(journal_path: str | os.PathLike[str], count: int,
                   timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """Wait for ``count`` terminal records; every rid has exactly one, its last (docs/contract.md, "The journal")."""
    out = terminals_by_rid(wait_for_terminals(journal_path, count, timeout))
    assert len(out) == count, (count, out)
    return out


# ----------------------------------------------------------------- ports


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A loopback port something listens on (and never accepts), for as long as the block runs."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield int(busy.getsockname()[1])


def tcp_options_in_process() -> list[tuple[tuple[str, int], tuple[str, int], int, int]]:
    """Every connected TCP socket this process holds: ``(local, peer, TCP_NODELAY, TCP_NOTSENT_LOWAT)``.

    Read from a duplicate of each descriptor (``/proc/self/fd``), so a test
    sees what the kernel holds for a router running in a thread of this
    process, on either runtime, without reaching into the adapter.
    """
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not stat.S_ISSOCK(os.stat(int(name)).st_mode):
                continue
            fd = os.dup(int(name))
        except OSError:
            continue  # gone meanwhile
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)  # not an internet socket, or gone
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                local, peer = sock.getsockname()[:2], sock.getpeername()[:2]
                nodelay = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                lowat = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
            except OSError:
                continue  # a listening socket (no peer), or one that closed meanwhile
            found.append((local, peer, nodelay, lowat))
    return found


# ------------------------------------------------------------- tokenizer

#: A chat template for :func:`save_word_tokenizer`: every message as ``<s> role content``, then the prompt.
WORD_CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant{% endif %}"
)


def save_word_tokenizer(folder: Path, words: Iterable[str]) -> Path:
    """A ``tokenizer.json`` of one id per word of ``words`` (no network, no training), saved in ``folder``.

    Ids 0, 1 and 2 are ``[UNK]``, ``<s>`` and ``</s>`` (special tokens), then
    the chat roles, then the words in order. Text splits on whitespace and punctuation; a completion's ids
    start with the BOS ``<s>`` (as Llama's do). ``tokenizer_config.json``
    beside it holds :data:`WORD_CHAT_TEMPLATE`. Returns ``folder``, for
    ``model.tokenizer`` and the simulator's ``--tokenizer``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocabulary = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for word in ("system", "user", "assistant", *words):
        vocabulary.setdefault(word, len(vocabulary))
    tok = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="[UNK]"))
    tok.add_special_tokens(["[UNK]", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": WORD_CHAT_TEMPLATE}))
    return folder


class RouterWrapper:
    """A :class:`narwhal_core.Router` inside a wrapper, for tests that change what some of its calls do.

    Not a subclass: where the router's parts are compiled by mypyc, ``Router``
    is a native class, which an interpreted class cannot extend. What the
    wrapper does not define is the wrapped router's (``inner``).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def on_runtime(runtime: str, body: Callable[[Any, Any], Any]) -> None:
    """Run ``await body(io, event)`` on ``runtime`` (``"trio"``, ``"asyncio"``), then cancel the tasks it left.

    ``io`` is the adapter's :class:`IO` (on trio over a nursery of its own),
    ``event`` a new event of the runtime's.
    """
    if runtime == "trio":
        import trio

        from narwhal_trio.io import IO as TrioIO

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                io = TrioIO(nursery)
                await body(io, trio.Event())
                await io.cancel_tasks()
                nursery.cancel_scope.cancel()  # what is left: the connections' own tasks

        trio.run(main)
    else:
        import asyncio

        from narwhal_asyncio.io import IO as AsyncioIO

        async def amain() -> None:
            io = AsyncioIO(asyncio.get_running_loop())
            await body(io, asyncio.Event())
            await io.cancel_tasks()

        asyncio.run(amain())


def read_request(conn: socket.socket, buf: bytes) -> tuple[str, dict[str, str], bytes, bytes] | None:
    """The next HTTP/1.1 request a fake engine reads from ``conn``, ``buf`` holding what came before it.

    Returns its request line, its headers (names lower-cased), its body and
    the bytes after it; ``None`` when the peer closes first.
    """
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head, _, buf = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(buf) < length:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    return lines[0], headers, buf[:length], buf[length:]
