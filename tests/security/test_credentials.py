"""The credential boundary (docs/contract.md, "The engine request"; docs/security.md), end to end over real sockets.

Client credentials stop at Narwhal: they never reach an engine, a log line or
the journal. The engine credential goes only to engines: never to a client, a
log line or the journal. ``api_keys`` mode holds SHA-256 digests only,
compares them in constant time, and reloads its keys file on SIGHUP without
dropping traffic. ``trusted_header`` takes the client ID only from trusted
proxies and never forwards it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import narwhal_core.auth
from narwhal_sim.testing import SimThread

from ..harness import Fleet
from ..helpers import (
    CHAT,
    COMPLETIONS,
    COMPLETION_PATHS,
    LEG_HEADERS,
    MODEL,
    REPO,
    assert_envelope,
    assert_journal_consistent,
    body_for,
    completion_records,
    header_values,
    journal_terminal,
    poll,
    write_keys_file,
)
from .support import Answer, FakeEngine, RawClient, Received, assert_still_serves, header_names, json_post



def _client_headers(client_key: str) -> list[tuple[str, str]]:
    """Every place a client may put a credential (docs/contract.md, "The engine request"), plus
    internal-looking headers."""
    return [
        ("Authorization", f"Bearer {client_key}"),
        ("api-key", client_key + "-api-key"),
        ("x-api-key", client_key + "-x-api-key"),
        ("Cookie", f"session={client_key}-cookie"),
        ("X-Narwhal-Client", "admin"),
    ]


def _stream_body(response_body: bytes) -> list[Any]:
    events = [line[len(b"data: "):] for line in response_body.split(b"\n") if line.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", response_body[-200:]
    return [json.loads(e) for e in events[:-1]]


# ------------------------------------------------------ client credentials


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_client_credentials_never_reach_engines_logs_or_journal(
    start_secure_router, secure_fleet, journal_path, keys_file, client_key, engine_key, router_log, stream
) -> None:
    router = start_secure_router(ingress={"auth": "api_keys", "api_keys_file": str(keys_file)})
    rids = []
    for route in COMPLETION_PATHS:
        with RawClient(router.address) as client:
            client.send(json_post(route, body_for(route, max_tokens=3, stream=stream), _client_headers(client_key)))
            response = client.read_response()
        assert response.status == 200, response.body[:300]
        if stream:
            assert _stream_body(response.body)
        # The engine credential never reaches the client.
        assert engine_key not in response.body.decode("latin-1")
        assert engine_key not in json.dumps(response.headers)
        rid = response.header("x-request-id")
        rids.append(rid)
        record = journal_terminal(journal_path, rid)
        assert record["terminal"] == "completed"
        # The trusted client comes from the key, not from the client's X-Narwhal-Client.
        assert record["client"] == "team-a"

    legs = completion_records(secure_fleet.all())
    assert len(legs) == 4, legs
    for record in secure_fleet.prefill[0].requests() + secure_fleet.decode[0].requests():
        # Probes, legs and KV pulls alike: only Narwhal's headers, only the engine credential.
        raw = json.dumps(record)
        assert client_key not in raw, record
        assert "admin" not in [v for _, v in record["headers"]]
    for leg in legs:
        assert set(header_names(leg)) <= LEG_HEADERS, header_names(leg)
        assert header_values(leg, "authorization") == [f"Bearer {engine_key}"]
        assert header_values(leg, "cookie") == [] and header_values(leg, "x-narwhal-client") == []

    journal_text = Path(journal_path).read_text()
    assert client_key not in journal_text and engine_key not in journal_text
    log_text = router_log.text()
    assert client_key not in log_text and engine_key not in log_text
    assert_still_serves(router.address, journal_path, headers=[("Authorization", f"Bearer {client_key}")])
    assert_journal_consistent(journal_path)


def _echoing_engine(kind: str) -> FakeEngine:
    """A decode engine that quotes the Authorization header it received back in its error."""

    def answer(received: Received) -> Answer:
        credential = dict((k.lower(), v) for k, v in received.headers).get("authorization", "")
        message = f"token {credential} is not allowed for this model"
        if kind == "refusal":
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
            return 400, "application/json", json.dumps(body).encode()
        event = json.dumps({"error": {"message": message, "type": "server_error", "code": 500}})
        return 200, "text/event-stream", f"data: {event}\n\ndata: [DONE]\n\n".encode()

    return FakeEngine(answer)


@pytest.mark.parametrize("kind", ["refusal", "stream-error"])
def test_engine_key_never_reaches_the_client_even_when_an_engine_quotes_it(
    start_secure_router, journal_path, engine_key, router_log, kind
) -> None:
    """An engine's error message is relayed to the client (docs/contract.md, "Responses and errors");
    Narwhal's own credential must not be."""
    with SimThread(role="prefill", speed=0, api_key=engine_key) as prefill, _echoing_engine(kind) as decode:
        router = start_secure_router(
            fleet_=Fleet(prefill=[prefill], decode=[decode]), engine={"kv_release": "abort_endpoint"}
        )
        with RawClient(router.address) as client:
            client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=3, stream=kind == "stream-error")))
            response = client.read_response()
        rid = response.header("x-request-id")
        record = journal_terminal(journal_path, rid)
        # The engine did receive the credential (so the echo is real)...
        assert decode.completions() and f"Bearer {engine_key}" in json.dumps(decode.completions()[0].headers)
        # ...and Narwhal must not hand it on.
        # The refusal is relayed with its 400; the stream's error event arrives after its 200 head.
        assert response.status == {"refusal": 400, "stream-error": 200}[kind], response.body[:300]
        assert record["terminal"] == {"refusal": "invalid", "stream-error": "failed"}[kind], record
        assert engine_key not in response.body.decode("latin-1"), response.body[:400]
        assert engine_key not in json.dumps(record), record
        assert engine_key not in Path(journal_path).read_text()
        assert engine_key not in router_log.text()


# -------------------------------------------------------------- api_keys


def test_router_keeps_only_key_digests(start_router, tmp_path, client_key, runtime) -> None:
    other = "sk-client-SECRET-other-" + "x" * 8
    path = write_keys_file(tmp_path / "keys.toml", {"team-a": client_key, "team-b": other})
    assert client_key not in path.read_text() and other not in path.read_text()
    router = start_router(ingress={"auth": "api_keys", "api_keys_file": str(path)})
    authenticator = router.call(lambda: router._server.serving.router._auth)
    keys = authenticator.keys
    assert set(keys.digests) == {hashlib.sha256(k.encode()).digest() for k in (client_key, other)}
    assert all(isinstance(d, bytes) and len(d) == 32 for d in keys.digests)
    shown = repr(authenticator) + repr(keys)
    assert client_key not in shown and other not in shown
    for digest in keys.digests:
        assert digest.hex() not in repr(keys)


def test_keys_file_with_a_plaintext_key_refuses_to_start_without_echoing_it(
    tmp_path, runtime, fleet, client_key
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[keys]]\nclient = "team-a"\nkey = "{client_key}"\n')
    config = _serve_config(tmp_path, fleet, keys)
    proc = subprocess.run(
        [sys.executable, "-m", "narwhal.cli", "serve", "--config", str(config), "--runtime", runtime],
        cwd=REPO, capture_output=True, timeout=30,
    )
    assert proc.returncode == 2, proc
    err = proc.stderr.decode()
    assert "ingress.api_keys_file" in err and client_key not in err, err
    assert client_key not in proc.stdout.decode()


def test_api_key_comparison_runs_in_constant_time_end_to_end(
    start_router, tmp_path, journal_path, monkeypatch
) -> None:
    """Every digest is compared with ``hmac.compare_digest`` on every request, whichever key (if any) matches.

    Timing over loopback is too noisy to measure without flakiness, so the
    comparison itself is observed: the presented key is hashed first (the
    plaintext is never compared), and the number and kind of comparisons do
    not depend on which entry matched, or on how close a wrong key came.
    """
    keys = {f"team-{i}": f"sk-client-SECRET-{i}-" + "k" * 24 for i in range(4)}
    path = write_keys_file(tmp_path / "keys.toml", keys)
    router = start_router(ingress={"auth": "api_keys", "api_keys_file": str(path)})
    calls: list[tuple[Any, Any]] = []
    real = narwhal_core.auth.hmac.compare_digest

    def recording(a: Any, b: Any) -> bool:
        if threading.current_thread().name.startswith("router-"):
            calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(narwhal_core.auth.hmac, "compare_digest", recording)
    first, last = keys["team-0"], keys["team-3"]
    tried = {
        "first": (first, 200), "last": (last, 200), "wrong": ("sk-client-SECRET-nope", 401),
        "prefix": (first[:-1], 401), "last-char": (first[:-1] + "j", 401), "longer": (first + "k", 401),
    }
    for name, (key, status) in tried.items():
        calls.clear()
        with RawClient(router.address) as client:
            client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1), [("Authorization", f"Bearer {key}")]))
            response = client.read_response()
        assert response.status == status, (name, response.body)
        assert len(calls) == len(keys), (name, len(calls))
        presented = hashlib.sha256(key.encode()).digest()
        for a, b in calls:
            assert isinstance(a, bytes) and isinstance(b, bytes) and len(a) == len(b) == 32, (name, a, b)
            assert presented in (a, b), name
            assert key.encode() not in (a, b)
        if status == 401:
            record = journal_terminal(journal_path, response.header("x-request-id"))
            assert record["terminal"] == "denied" and record["client"] is None
    assert_still_serves(router.address, journal_path, headers=[("Authorization", f"Bearer {last}")])
    assert_journal_consistent(journal_path)


def _serve_config(tmp_path: Path, fleet: Fleet, keys: Path, **ingress: Any) -> Path:
    lines = [
        "[model]", f'name = "{MODEL}"', "",
        "[ingress]", 'listen = "127.0.0.1:0"', 'auth = "api_keys"', f'api_keys_file = "{keys}"',
        *[f"{k} = {json.dumps(v)}" for k, v in ingress.items()], "",
        "[engine]", f"prefill = {json.dumps(list(fleet.prefill_urls))}",
        f"decode = {json.dumps(list(fleet.decode_urls))}", "",
        "[health]", "probe_interval_s = 0.2", "",
        "[journal]", f'path = "{tmp_path / "journal.jsonl"}"', 'fsync = "never"', "",
        "[shutdown]", "grace_s = 5.0", "",
    ]
    path = tmp_path / "narwhal.toml"
    path.write_text("\n".join(lines))
    return path


class _Serve:
    """``narwhal serve`` as a subprocess whose JSON log lines (stderr) are collected."""

    def __init__(self, config: Path, runtime: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "narwhal.cli", "serve", "--config", str(config), "--runtime", runtime],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self.lines: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, name="serve-stderr", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            with self._lock:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        with self._lock:
            lines = list(self.lines)
        for line in lines:
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict) and value.get("event") == name:
                out.append(value)
        return out

    def wait_event(self, name: str, count: int = 1, timeout: float = 10.0) -> dict[str, Any]:
        def found() -> list[dict[str, Any]] | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"narwhal serve exited with {self.proc.returncode}: {self.lines}")
            events = self.events(name)
            return events if len(events) >= count else None

        return poll(found, timeout=timeout, what=f"log event {name!r} x{count}")[-1]  # type: ignore[no-any-return]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def test_sighup_reloads_the_keys_file_without_dropping_traffic(runtime, fleet, tmp_path) -> None:
    key_a = "sk-client-SECRET-A-" + "a" * 20
    key_b = "sk-client-SECRET-B-" + "b" * 20
    keys = write_keys_file(tmp_path / "keys.toml", {"team-a": key_a})
    serve = _Serve(_serve_config(tmp_path, fleet, keys), runtime)
    try:
        listening = serve.wait_event("listening", timeout=15)
        url = f"http://127.0.0.1:{listening['port']}"
        body = body_for(COMPLETIONS, max_tokens=1)

        def post(key: str) -> int:
            return httpx.post(url + COMPLETIONS, json=body, headers={"Authorization": f"Bearer {key}"},
                              timeout=10).status_code

        results: list[tuple[float, int | str]] = []  # (when the answer came, status or error)
        stop = threading.Event()

        def client_loop() -> None:
            with httpx.Client(timeout=10) as client:
                while not stop.is_set():
                    try:
                        status: int | str = client.post(
                            url + COMPLETIONS, json=body, headers={"Authorization": f"Bearer {key_a}"}
                        ).status_code
                    except httpx.HTTPError as exc:
                        status = f"{type(exc).__name__}: {exc}"
                    results.append((time.monotonic(), status))

        loop = threading.Thread(target=client_loop, name="key-a-loop", daemon=True)
        loop.start()
        try:
            poll(lambda: sum(1 for _, s in results if s == 200) >= 10, timeout=10, what="traffic with key A")
            # Replace the file atomically, as an operator's tooling would, then signal.
            staged = write_keys_file(tmp_path / "keys.next.toml", {"team-b": key_b})
            os.replace(staged, keys)
            switched = time.monotonic()
            serve.proc.send_signal(signal.SIGHUP)
            serve.wait_event("keys_reloaded", timeout=10)
            poll(lambda: post(key_b) == 200, timeout=5, what="key B accepted")
            count = len(results)
            poll(lambda: len(results) >= count + 10, timeout=10, what="traffic after the reload")
        finally:
            stop.set()
            loop.join(15)
        assert post(key_a) == 401
        assert post(key_b) == 200

        failures = [(t, s) for t, s in results if s not in (200, 401)]
        assert not failures, f"requests failed around the reload: {failures[:5]}"
        assert all(s == 200 for t, s in results if t < switched), "key A refused before the reload"
        statuses = [s for _, s in results]
        first_401 = statuses.index(401)
        assert set(statuses[first_401:]) == {401}, "key A accepted again after the reload"

        # A bad keys file on SIGHUP keeps the keys in force.
        keys.write_text("[[keys]]\nclient = \n")
        serve.proc.send_signal(signal.SIGHUP)
        failed = serve.wait_event("keys_reload_failed", timeout=10)
        assert "ingress.api_keys_file" in failed.get("error", ""), failed
        assert post(key_b) == 200 and post(key_a) == 401
        assert serve.proc.poll() is None
    finally:
        code = serve.stop()
    assert code == 0, serve.lines
    log_text = "\n".join(serve.lines)
    assert key_a not in log_text and key_b not in log_text
    terminals = assert_journal_consistent(tmp_path / "journal.jsonl")
    journal_text = (tmp_path / "journal.jsonl").read_text()
    assert key_a not in journal_text and key_b not in journal_text
    assert {r["terminal"] for r in terminals.values()} == {"completed", "denied"}


# --------------------------------------------------------- trusted_header


def test_trusted_header_only_from_trusted_proxies_and_never_forwarded(
    start_router, fleet, journal_path
) -> None:
    router = start_router(ingress={"auth": "trusted_header", "trusted_proxies": ("127.0.0.1/32",)})
    body = body_for(CHAT, max_tokens=2)

    # The proxy at 127.0.0.1 names the client.
    with RawClient(router.address, source="127.0.0.1") as proxy:
        proxy.send(json_post(CHAT, body, [("X-Narwhal-Client", "team-proxy")]))
        response = proxy.read_response()
    assert response.status == 200, response.body
    record = journal_terminal(journal_path, response.header("x-request-id"))
    assert record["client"] == "team-proxy" and record["terminal"] == "completed"
    legs = completion_records(fleet.all())
    assert len(legs) == 2
    for leg in legs:
        assert "x-narwhal-client" not in header_names(leg)
        assert "team-proxy" not in json.dumps(leg["headers"])

    # Any other peer (here 127.0.0.2, still loopback) may not, whatever it sends.
    refused = [
        ("127.0.0.2", [("X-Narwhal-Client", "team-proxy")]),
        ("127.0.0.2", []),
        ("127.0.0.1", []),
        ("127.0.0.1", [("X-Narwhal-Client", "team-proxy"), ("X-Narwhal-Client", "admin")]),
        ("127.0.0.1", [("X-Narwhal-Client", "bad\x7fid")]),
    ]
    for source, headers in refused:
        with RawClient(router.address, source=source) as client:
            client.send(json_post(CHAT, body, headers))
            response = client.read_response()
        assert_envelope(response, 401, type="authentication_error")
        record = journal_terminal(journal_path, response.header("x-request-id"))
        assert record["terminal"] == "denied" and record["client"] is None, record
    assert len(completion_records(fleet.all())) == 2, "a refused request reached an engine"
    assert_still_serves(router.address, journal_path, headers=[("X-Narwhal-Client", "team-proxy")])
    assert_journal_consistent(journal_path)


def test_models_route_needs_the_key_too(start_router, keys_file, client_key) -> None:
    router = start_router(ingress={"auth": "api_keys", "api_keys_file": str(keys_file)})
    assert httpx.get(router.url + "/v1/models", timeout=5).status_code == 401
    ok = httpx.get(router.url + "/v1/models", headers={"Authorization": f"Bearer {client_key}"}, timeout=5)
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
