"""Runtime parity: the same scripted scenario journals the same records on trio and on asyncio.

Both adapters perform what the shared driver (narwhal_runtime/driver.py)
decides; the tests at the end check that they do so the same way where it
shows from outside: an exception in the core (while it handles an event, or
while its commands are drained) ends only its request, identically, and the
process goes on serving; a request's journal record is written before its
client sees the end of the answer; and a connection over
``ingress.max_connections`` waits, unanswered, until a slot frees
(the listen backlog on both: neither accepts while every slot is held); and
a failed accept is handled by one rule (narwhal_runtime/listening.py,
``accept_error``): a connection's own failure is dropped silently and the
next accepted at once, any other failure logs one line and pauses; and the
router's side of a client connection and of a leg's engine connection
carries the same socket options on trio, asyncio and uvloop
(narwhal_runtime/socket_options.py), read back from the kernel; and a
client that takes none of its bytes for ``ingress.send_timeout_s`` is
dropped, however few they are, while one that reads slowly but reads is
not (narwhal_runtime/slow_clients.py), on trio, asyncio and uvloop.

One scenario — valid, invalid, streaming, unknown model, a decode engine that
fails every leg (so the router retries elsewhere), a client that leaves
mid-stream — runs once per runtime against a fresh simulated fleet. The two
journals must be identical once what legitimately differs between two runs is
masked: timestamps and durations, router IDs, engine URLs (replaced by their
role and position) and the engines' KV owner keys.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_core import ClientData, RidSource, Router
from narwhal_runtime import listening
from narwhal_runtime.app import load_authenticator
from narwhal_runtime.metrics import render
from narwhal_sim.testing import SimProcess, SimThread

from .. import harness
from ..harness import LogCapture, RouterThread, make_config
from ..helpers import MODEL, RouterWrapper, poll, read_journal, tcp_options_in_process, wait_for_terminals

_TIMES = {"ts", "received", "started", "duration_ms", "ttft_ms"}


def _scenario(router: RouterThread, journal: Path) -> int:
    """Drive the scenario; return how many completion requests it sent."""
    sent = 0
    with httpx.Client(base_url=router.url, timeout=10) as client:
        def post(path: str, body: dict[str, Any], rid: str, **kwargs: Any) -> httpx.Response:
            nonlocal sent
            sent += 1
            return client.post(path, json=body, headers={"x-request-id": rid}, **kwargs)

        answer = post("/v1/completions", {"prompt": "The narwhal is", "max_tokens": 4}, "c-plain")
        assert answer.status_code == 200, answer.text
        answer = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 3, "stream": True,
                                               "stream_options": {"include_usage": True}}, "c-stream")
        assert answer.status_code == 200 and "data: [DONE]" in answer.text
        assert post("/v1/completions", {"prompt": "x", "n": 2}, "c-n2").status_code == 400
        assert post("/v1/completions", {"prompt": "x", "model": "gpt-9"}, "c-model").status_code == 404
        assert post("/v1/chat/completions", {"messages": "hi"}, "c-type").status_code == 400
        answer = post("/v1/completions", {"prompt": "A tusk", "max_tokens": 2, "kv_transfer_params": {}},
                      "c-stripped")
        assert answer.status_code == 200, answer.text
    # A client that leaves while its stream is running (the decode engine is slow
    # enough to still be sending).
    sent += 1
    raw = json.dumps({"prompt": "Leaving early", "max_tokens": 400, "stream": True}).encode()
    with socket.create_connection(router.address, timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-request-id: c-gone\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    wait_for_terminals(journal, sent)
    router.wait_idle()
    return sent


def _masked(records: list[dict[str, Any]], urls: dict[str, str]) -> list[Any]:
    rids: dict[str, str] = {}

    def mask(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: mask(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [mask(v, key) for v in value]
        if key in _TIMES and value is not None:
            return "<time>"
        if key == "rid":
            return rids.setdefault(value, f"rid{len(rids)}")
        if key in ("backend_id", "release_id", "owner") and isinstance(value, str):
            # A known rid first: a random rid prefix can itself look like a leg (``d`` and digits only).
            for real, name in rids.items():
                match = re.search(re.escape(real) + r"-([pd]\d+)(-.*)?$", value)
                if match:
                    prefix = "" if value.startswith(real) else "?-"
                    return f"{prefix}{name}-{match.group(1)}" + ("-<suffix>" if match.group(2) else "")
            match = re.fullmatch(r"(.+?)-([pd]\d+)(-.*)?", value)
            assert match, value
            return f"{rids.get(match.group(1), '?')}-{match.group(2)}" + ("-<suffix>" if match.group(3) else "")
        if key in ("engine", "prefill", "decode") and isinstance(value, str):  # (routing names engines too)
            return urls.get(value, value)
        return value

    return [mask(record) for record in records]


def _run(runtime: str, tmp_path: Path) -> tuple[str, list[Any]]:
    journal = tmp_path / f"journal-{runtime}.jsonl"
    with SimThread(role="prefill", speed=0) as prefill, \
            SimThread(role="decode", speed=0, faults={"error_rate": 1.0}) as failing, \
            SimThread(role="decode", speed=40) as decode:  # fmt: skip
        config = make_config(
            journal, prefill=(prefill.url,), decode=(failing.url, decode.url),
            engine={"kv_release": "abort_endpoint"},
            health={"probe_interval_s": 600.0, "unhealthy_after": 100},
        )
        with RouterThread(config, runtime) as router:
            _scenario(router, journal)
            library = router.loop_library
        urls = {prefill.url: "prefill0", failing.url: "decode0", decode.url: "decode1"}
        return str(library), _masked(read_journal(journal), urls)


def test_both_runtimes_journal_the_same_scenario_identically(tmp_path: Path) -> None:
    trio_library, on_trio = _run("trio", tmp_path)
    asyncio_library, on_asyncio = _run("asyncio", tmp_path)
    assert (trio_library, asyncio_library) == ("trio", "asyncio")
    assert len(on_trio) == 7 + 4  # seven terminal records, four admitted requests' progress records
    terminals = [r["terminal"] for r in on_trio if r["terminal"] is not None]
    assert terminals.count("completed") == 3 and terminals.count("invalid") == 3, terminals
    assert "cancelled" in terminals
    retried = [r for r in on_trio if r["terminal"] == "completed" and len(r["legs"]) > 2]
    assert retried, "the failing decode engine should have forced a retry"
    for trio_record, asyncio_record in zip(on_trio, on_asyncio, strict=True):
        assert trio_record == asyncio_record


# ------------------------------------------------------------ error containment


class _FaultyRouter(RouterWrapper):
    """Raises for requests whose body carries a marker.

    ``parity-receive``: right after the router handled the request's bytes;
    ``parity-drain``: from :meth:`next_output`, while the adapter drains the
    commands that event produced (nothing is lost: the commands stay queued).
    """

    def __init__(self, inner: Router) -> None:
        super().__init__(inner)
        self.drain_fault = False

    def receive(self, event: Any, *, now: float) -> None:
        self.inner.receive(event, now=now)
        if type(event) is ClientData and b"parity-receive" in event.data:
            raise RuntimeError("injected fault: receive")
        if type(event) is ClientData and b"parity-drain" in event.data:
            self.drain_fault = True

    def next_output(self) -> Any:
        if self.drain_fault:
            self.drain_fault = False
            raise RuntimeError("injected fault: drain")
        return self.inner.next_output()


def _faulty_router(config: Any, *, now: float, env: Any = None, rid_prefix: str | None = None) -> Any:
    return _FaultyRouter(Router(
        config, rid_source=RidSource(rid_prefix or "parity"), authenticator=load_authenticator(config),
        wall_offset=0.0, now=now, render_metrics=render,
    ))


def _contain_run(runtime: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[Any]]:
    monkeypatch.setattr(harness, "build_router", _faulty_router)
    journal = tmp_path / f"faults-{runtime}.jsonl"
    answers = []
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode:
        config = make_config(journal, prefill=(prefill.url,), decode=(decode.url,),
                             health={"probe_interval_s": 600.0})
        with LogCapture() as log, RouterThread(config, runtime) as router:
            assert isinstance(router.server.serving.router, _FaultyRouter)
            for prompt in ("parity-receive", "parity-drain", "after the faults"):
                # A connection each: the router closes the one whose request failed.
                with httpx.Client(base_url=router.url, timeout=10) as client:
                    answer = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
                    answers.append((answer.status_code, answer.headers["content-type"].split(";")[0],
                                    answer.json().get("error")))
            wait_for_terminals(journal, 3)
            router.wait_idle()
            stats = router.statistics()
            assert stats.inflight == 0 and stats.requests == 0, stats
            assert router.alive  # still serving
        errors = [(e["problem"], e["during"]) for e in log.events() if e["event"] == "internal_error"]
        urls = {prefill.url: "prefill0", decode.url: "decode0"}
    assert errors == [("RuntimeError: injected fault: receive", "ClientData"),
                      ("RuntimeError: injected fault: drain", "ClientData")], errors
    return answers, _masked(read_journal(journal), urls)


def test_a_fault_in_the_core_is_contained_identically_on_both_runtimes(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    trio_answers, on_trio = _contain_run("trio", tmp_path, monkeypatch)
    asyncio_answers, on_asyncio = _contain_run("asyncio", tmp_path, monkeypatch)
    envelope = {"message": "Internal router error.", "type": "server_error", "param": None, "code": "internal_error"}
    assert trio_answers[:2] == [(500, "application/json", envelope)] * 2, trio_answers
    assert trio_answers[2] == (200, "application/json", None), trio_answers
    assert asyncio_answers == trio_answers
    terminals = [(r["terminal"], r["status"], (r.get("error") or {}).get("code")) for r in on_trio
                 if r["terminal"] is not None]
    assert terminals == [("failed", 500, "internal_error")] * 2 + [("completed", 200, None)], terminals
    assert on_asyncio == on_trio


# ------------------------------------------------------------------ write order


def _order_run(runtime: str, tmp_path: Path) -> list[tuple[str, bool]]:
    """Serve requests with the adapter's effects traced; return, per request, (kind, record before end)."""
    journal = tmp_path / f"order-{runtime}.jsonl"
    trace: list[tuple[str, Any]] = []
    seen: list[tuple[str, bool]] = []
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode:
        config = make_config(journal, prefill=(prefill.url,), decode=(decode.url,),
                             health={"probe_interval_s": 600.0})
        with RouterThread(config, runtime) as router:
            effects = router.server.serving.effects  # what the driver performs each batch through
            write_journal, send = effects.write_journal, effects.send

            def traced_journal(lines: list[bytes]) -> Any:
                records = [json.loads(line) for line in lines]
                trace.append(("journal", {r["rid"] for r in records if r["terminal"] is not None}))
                return write_journal(lines)

            def traced_send(conn: Any, data: bytes, close: bool) -> None:
                trace.append(("send", (conn, data)))
                send(conn, data, close)

            def install() -> None:
                effects.write_journal, effects.send = traced_journal, traced_send

            router.call(install)
            for kind in ("plain", "stream", "plain", "stream"):
                body = {"prompt": "Order", "max_tokens": 5, "stream": kind == "stream"}
                with httpx.Client(base_url=router.url, timeout=10) as client:  # a connection per request
                    answer = client.post("/v1/completions", json=body)
                    assert answer.status_code == 200, answer.text
                    rid = answer.headers["x-request-id"]
                    # The answer is whole: its terminal record is in the file already.
                    on_file = any(r["rid"] == rid and r["terminal"] is not None for r in read_journal(journal))
                seen.append((kind, on_file))
            router.wait_idle()
    # In the adapter's own trace: the journal write holding each terminal record
    # comes before the last bytes sent to that request's connection.
    conns: dict[Any, str] = {}
    last_send: dict[str, int] = {}
    first_record: dict[str, int] = {}
    for index, (what, value) in enumerate(trace):
        if what == "journal":
            for rid in value:
                first_record.setdefault(rid, index)
        else:
            conn, data = value
            match = re.search(rb"x-request-id: ([^\r]+)", data, re.IGNORECASE)
            if match:
                conns[conn] = match.group(1).decode()
            if data and conn in conns:
                last_send[conns[conn]] = index
    assert len(last_send) == 4, trace
    for rid, index in last_send.items():
        assert first_record[rid] < index, (rid, trace)
    return seen


def test_the_journal_record_is_written_before_the_answer_ends_on_both_runtimes(tmp_path: Path) -> None:
    expected = [("plain", True), ("stream", True), ("plain", True), ("stream", True)]
    assert _order_run("trio", tmp_path) == expected
    assert _order_run("asyncio", tmp_path) == expected


# ------------------------------------------------------------ connection slots


@pytest.mark.parametrize("runtime", harness.RUNTIMES)
def test_a_connection_over_the_limit_waits_for_a_slot(runtime: str, tmp_path: Path) -> None:
    health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode, \
            RouterThread(make_config(tmp_path / "journal.jsonl", prefill=(prefill.url,), decode=(decode.url,),
                                     ingress={"max_connections": 1}), runtime) as router:  # fmt: skip
        first = socket.create_connection(router.address, timeout=10)
        first.sendall(health)
        assert first.recv(65536).startswith(b"HTTP/1.1 200")  # it holds the one slot
        with socket.create_connection(router.address, timeout=10) as second:
            second.sendall(health)
            second.settimeout(0.5)
            with pytest.raises(socket.timeout):
                second.recv(65536)  # no slot: not served yet
            first.close()  # frees the slot
            second.settimeout(10)
            assert second.recv(65536).startswith(b"HTTP/1.1 200")


# ------------------------------------------------------------ accept failures


class _AcceptFaults:
    """``accept`` on the router's listening port fails with the scripted errnos first; each try is noted.

    A connection's own failures (a reset, a firewall's ``EPERM``) and the
    other errors cannot be caused on loopback at will, so they are raised
    from ``socket.accept`` itself, as the kernel would, while the connection
    stays in the listen backlog for the next try.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.port: int | None = None
        self.script: list[int] = []
        #: (monotonic time, errno name or "accepted") per try that did not find the backlog empty.
        self.tries: list[tuple[float, str]] = []
        real_accept = socket.socket.accept

        def accept(sock: socket.socket) -> Any:
            if self.port is None or sock.getsockname()[1] != self.port:
                return real_accept(sock)
            if self.script:
                code = self.script.pop(0)
                self.tries.append((time.monotonic(), errno.errorcode[code]))
                raise OSError(code, os.strerror(code))
            accepted = real_accept(sock)  # BlockingIOError: nothing waiting, not noted
            self.tries.append((time.monotonic(), "accepted"))
            return accepted

        monkeypatch.setattr(socket.socket, "accept", accept)


def _accept_run(runtime: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                script: list[int]) -> tuple[list[tuple[float, str]], list[dict[str, Any]]]:
    """Connect once while ``accept`` fails as ``script`` says; return the tries and the ``accept_failed`` lines."""
    faults = _AcceptFaults(monkeypatch)
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode, \
            LogCapture() as log, \
            RouterThread(make_config(tmp_path / f"journal-{runtime}.jsonl", prefill=(prefill.url,),
                                     decode=(decode.url,)), runtime) as router:  # fmt: skip
        faults.script = list(script)
        faults.port = router.address[1]
        with socket.create_connection(router.address, timeout=10) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert client.recv(65536).startswith(b"HTTP/1.1 200")  # served once accepted
        faults.port = None
    return faults.tries, [e for e in log.events() if e["event"] == "accept_failed"]


@pytest.mark.parametrize("runtime", harness.RUNTIMES)
def test_a_connections_own_accept_failure_is_dropped_silently(runtime: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Any pause would outlast the client's 10 s wait: the next connection must be accepted at once.
    monkeypatch.setattr(listening, "ACCEPT_RETRY_S", 60.0)
    script = [errno.ECONNABORTED, errno.EPERM, errno.EPROTO, errno.ECONNRESET, errno.EHOSTUNREACH]
    tries, logged = _accept_run(runtime, tmp_path, monkeypatch, script)
    assert [name for _, name in tries] == [errno.errorcode[code] for code in script] + ["accepted"]
    assert logged == []


@pytest.mark.parametrize("runtime", harness.RUNTIMES)
def test_any_other_accept_failure_logs_one_line_and_pauses(runtime: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pause = 0.3
    monkeypatch.setattr(listening, "ACCEPT_RETRY_S", pause)
    tries, logged = _accept_run(runtime, tmp_path, monkeypatch, [errno.EMFILE, errno.EINVAL])
    assert [name for _, name in tries] == ["EMFILE", "EINVAL", "accepted"]
    gaps = [later - earlier for (earlier, _), (later, _) in zip(tries, tries[1:])]
    assert all(gap >= pause - 0.01 for gap in gaps), gaps  # a shortage, and an error nobody expected
    assert [(e["shortage"], e["level"]) for e in logged] == [(True, "error"), (False, "error")], logged
    assert os.strerror(errno.EMFILE) in logged[0]["error"] and os.strerror(errno.EINVAL) in logged[1]["error"]


# ------------------------------------------------------------ socket options

#: ``(TCP_NODELAY, TCP_NOTSENT_LOWAT)`` the router's side of each kind of
#: connection carries on every runtime (narwhal_runtime/socket_options.py).
CLIENT_SOCKET = (1, 2**14)
ENGINE_SOCKET = (1, 0)


@pytest.mark.parametrize("runtime, uvloop", [("trio", False), ("asyncio", False), ("asyncio", True)])
def test_client_and_engine_sockets_carry_the_same_options_on_every_runtime(runtime: str, uvloop: bool,
                                                                          tmp_path: Path) -> None:
    if uvloop:
        pytest.importorskip("uvloop")
    body = json.dumps({"model": MODEL, "prompt": "The narwhal is", "max_tokens": 2}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))
    # The decode engine in its own process: its KV pulls from the prefill engine
    # are connections to an engine port too, and must not be taken for the router's.
    with SimThread(role="prefill", speed=0) as prefill, SimProcess(role="decode", speed=0) as decode, \
            RouterThread(make_config(tmp_path / "journal.jsonl", prefill=(prefill.url,), decode=(decode.url,),
                                     health={"probe_interval_s": 600.0}), runtime, uvloop=uvloop) as router, \
            socket.create_connection(router.address, timeout=10) as client:  # fmt: skip
        client.sendall(request)
        assert client.recv(65536).startswith(b"HTTP/1.1 200")  # the connection stays open (keep-alive)
        engines = {prefill.port, decode.port}

        def found() -> tuple[list[Any], list[Any]] | None:
            sockets = tcp_options_in_process()
            accepted = [options for _, peer, *options in sockets if peer == client.getsockname()[:2]]
            legs = [options for _, peer, *options in sockets if peer[1] in engines]  # the pooled leg connections
            return (accepted, legs) if accepted and len(legs) >= 2 else None

        accepted, legs = poll(found, timeout=5, what="the router's client and leg sockets")
        if uvloop:
            assert router.call(lambda: type(router.server._loop).__module__).startswith("uvloop")
    assert [tuple(options) for options in accepted] == [CLIENT_SOCKET]
    assert {tuple(options) for options in legs} == {ENGINE_SOCKET}


# ------------------------------------------------------------ the send timeout

#: ``ingress.send_timeout_s`` of the slow-client runs: short, so the test is.
SEND_TIMEOUT_S = 0.4


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("runtime, uvloop", [("trio", False), ("asyncio", False), ("asyncio", True)])
def test_a_client_that_takes_none_of_its_bytes_is_dropped_after_the_send_timeout(
    runtime: str, uvloop: bool, stream: bool, tmp_path: Path
) -> None:
    """One rule on every runtime (narwhal_runtime/slow_clients.py): a client that takes none of the bytes
    Narwhal has for it for ``send_timeout_s`` is dropped, however few they are (here a few hundred KiB,
    well under ``HIGH_WATER``): mid-stream (its request ends ``cancelled``) or once its whole answer is
    written, on a keep-alive connection. The drop says why in one log line, the same on every runtime."""
    if uvloop:
        pytest.importorskip("uvloop")
    journal = tmp_path / "journal.jsonl"
    # Streamed: ~240 bytes per token, the decode engine still generating long after the drop (~3 s
    # nominal at speed 8). Whole: ~130 KB at once. Either way far more than the kernel buffers hold.
    tokens, speed = (4000, 8.0) if stream else (30000, 0.0)
    body = json.dumps({"model": MODEL, "prompt": "Never read", "max_tokens": tokens, "ignore_eos": True,
                       "stream": stream}).encode()
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=speed) as decode, \
            LogCapture() as log, \
            RouterThread(make_config(journal, prefill=(prefill.url,), decode=(decode.url,),
                                     ingress={"send_timeout_s": SEND_TIMEOUT_S},
                                     health={"probe_interval_s": 600.0}), runtime, uvloop=uvloop) as router, \
            socket.socket() as client:  # fmt: skip
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        client.connect(router.address)
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))
        sent = time.monotonic()
        poll(lambda: router.statistics().connections == 1, timeout=5.0, interval=0.005, what="the client seen")
        # The client reads nothing: once the kernel holds what it can, the rest waits in the router.
        poll(lambda: router.statistics().connections == 0, timeout=5.0, interval=0.005, what="the client dropped")
        assert time.monotonic() - sent >= SEND_TIMEOUT_S
        [record] = [r for r in wait_for_terminals(journal, 1) if r["terminal"] is not None]
        if stream:
            # Dropped while its engine still generated: what the journal says.
            assert (record["terminal"], record["status"], record["error"]["code"]) == (
                "cancelled", 499, "client_disconnected"), record
        else:
            assert (record["terminal"], record["status"]) == ("completed", 200), record
        # The client's side ends too, its answer cut short.
        head, rest = _read_to_end(client, 5.0)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        if stream:
            assert not rest.endswith(b"\r\n0\r\n\r\n")
        else:
            length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
            assert len(rest) < length
    [line] = [e for e in log.events() if e["event"] == "client_send_timeout"]
    assert line["level"] == "warning" and line["send_timeout_s"] == SEND_TIMEOUT_S, line
    assert line["unsent_bytes"] > 0 and set(line) == {"ts", "level", "event", "send_timeout_s", "unsent_bytes",
                                                       "consequence"}, line


def _read_to_end(client: socket.socket, timeout: float) -> tuple[bytes, bytes]:
    """What ``client`` receives until the router closes (or resets) it: the answer's head and the rest."""
    client.settimeout(timeout)
    received = bytearray()
    try:
        while data := client.recv(65536):
            received += data
    except ConnectionResetError:
        pass
    head, _, rest = bytes(received).partition(b"\r\n\r\n")
    return head, rest


#: A client that asks for a long answer and takes 2 KiB of it every 50 ms (about 40 KB/s); it prints
#: what it saw as JSON.
SLOW_READER = r"""
import json, re, socket, sys, time
body = sys.stdin.buffer.read()
client = socket.socket()
client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
client.connect((sys.argv[1], int(sys.argv[2])))
client.settimeout(5.0)
client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))
received = bytearray()
started = time.monotonic()
dropped = None
while True:
    head, _, rest = bytes(received).partition(b"\r\n\r\n")
    found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    if found and len(rest) >= int(found.group(1)):
        break
    data = client.recv(2048)
    if not data:
        dropped = len(received)
        break
    received += data
    time.sleep(0.05)
seconds = time.monotonic() - started
print(json.dumps({"dropped_after": dropped, "seconds": seconds, "status_line": head.split(b"\r\n")[0].decode()}))
sys.stdout.flush()
client.close()
"""


@pytest.mark.parametrize("runtime, uvloop", [("trio", False), ("asyncio", False), ("asyncio", True)])
def test_a_client_that_reads_slowly_but_reads_is_not_dropped(runtime: str, uvloop: bool, tmp_path: Path) -> None:
    """The other half of the rule: a client that takes some of its bytes within each ``send_timeout_s``
    keeps its connection, however long its whole answer takes to read (here about twice that)."""
    if uvloop:
        pytest.importorskip("uvloop")
    timeout = 0.6
    body = json.dumps({"model": MODEL, "prompt": "Read slowly", "max_tokens": 14000, "ignore_eos": True}).encode()
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode, \
            LogCapture() as log, \
            RouterThread(make_config(tmp_path / "journal.jsonl", prefill=(prefill.url,), decode=(decode.url,),
                                     ingress={"send_timeout_s": timeout},
                                     health={"probe_interval_s": 600.0}), runtime, uvloop=uvloop) as router:  # fmt: skip
        # The reader is a process of its own, so its steady reading never waits on this
        # process's threads or its garbage collector.
        reader = subprocess.run(
            [sys.executable, "-c", SLOW_READER, router.address[0], str(router.address[1])],
            input=body, capture_output=True, timeout=60, check=False,
        )
        assert reader.returncode == 0, reader.stderr.decode()[-2000:]
        result = json.loads(reader.stdout)
        assert result["dropped_after"] is None, f"dropped after {result['dropped_after']} bytes"
        assert result["seconds"] > 2 * timeout  # longer than one timeout, in all
        assert result["status_line"].startswith("HTTP/1.1 200")
    assert [e for e in log.events() if e["event"] == "client_send_timeout"] == []


# ------------------------------------------------------------ the exit flush


@pytest.mark.parametrize("reads", [True, False], ids=["reads", "never-reads"])
@pytest.mark.parametrize("runtime, uvloop", [("trio", False), ("asyncio", False), ("asyncio", True)])
def test_an_answer_still_queued_at_shutdown_gets_the_exit_flush_then_is_cut(
    runtime: str, uvloop: bool, reads: bool, tmp_path: Path
) -> None:
    """One end on every runtime (narwhal_runtime/client_connections.py, ``ClientConnections.aclose``): the
    drain is over once every answer is written, but what a client has not yet taken waits in the router. A
    client that reads gets all of it after the drain ended, then the router's close; one that reads nothing
    is cut after ``EXIT_FLUSH_S``, and the router stops all the same. (trio used to drop the bytes at once.)"""
    if uvloop:
        pytest.importorskip("uvloop")
    journal = tmp_path / "journal.jsonl"
    body = json.dumps({"model": MODEL, "prompt": "Read later", "max_tokens": 30000, "ignore_eos": True}).encode()
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode, \
            socket.socket() as client:  # fmt: skip
        router = RouterThread(make_config(journal, prefill=(prefill.url,), decode=(decode.url,),
                                          health={"probe_interval_s": 600.0}), runtime, uvloop=uvloop).start()
        try:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: ~130 KB cannot fit
            client.connect(router.address)
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(body), body))
            [record] = [r for r in wait_for_terminals(journal, 1) if r["terminal"] is not None]
            assert (record["terminal"], record["status"]) == ("completed", 200), record
            assert router.call(lambda: sum(len(c.out) for c in router.server.serving.clients.live)) > 0  # still queued
            stopping = time.monotonic()
            router.call_soon(lambda: router.server.serving.shutdown())
            if not reads:
                router._thread.join(10)  # type: ignore[union-attr]
                assert not router.alive
                assert 0.9 <= time.monotonic() - stopping < 5.0  # EXIT_FLUSH_S, then the cut
            head, rest = _read_to_end(client, 10.0)
        finally:
            router.stop()
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    if reads:
        assert len(rest) == length and time.monotonic() - stopping < 5.0  # all of it, then the router's close
    else:
        assert len(rest) < length  # cut
    assert [r for r in read_journal(journal) if r["terminal"] is not None] == [record]  # its one record
