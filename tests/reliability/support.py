"""Helpers of the reliability fault matrix (docs/contract.md, "Prefill and decode legs", "Admission, capacity
and retries", "The journal").

Everything is synchronous and bounded: clients over real loopback sockets
(httpx, and raw sockets for clients that leave), checks of what every
scenario must leave behind — one terminal record per request, capacity back
to zero, KV accounted for on the simulated engines — and a ``narwhal serve``
subprocess for the signal scenarios.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..harness import RouterThread
from ..helpers import COMPLETION_PATHS, COMPLETIONS, REPO, body_for, poll, rid_of, sse_payloads
from ..rawhttp import RawClient, request_bytes
from ..serving import ServeProcess, write_config  # noqa: F401  (re-exported for the suite)

#: The three ways a router may release unpulled KV (docs/contract.md, "Prefill and decode legs"; ``engine.kv_release``).
KV_MODES = ("decode_pull", "abort_endpoint", "decode_abort", "lease")
#: Run a test once per KV release mode, as ``mode``.
each_kv_mode = pytest.mark.parametrize("mode", KV_MODES)

#: Upper bound of every wait in this suite; the scenarios normally settle in well under a second.
WAIT = 10.0


# ------------------------------------------------------------------- requests


def body(route: str = COMPLETIONS, *, stream: bool = False, max_tokens: int = 4,
         text: str = "The narwhal is a whale", **fields: Any) -> dict[str, Any]:
    """A valid request body for ``route``: :func:`tests.helpers.body_for` with ``max_tokens`` (and ``stream``)."""
    return body_for(route, text, max_tokens=max_tokens, **({"stream": True} if stream else {}), **fields)


def post(router: RouterThread, route: str = COMPLETIONS, *, headers: Mapping[str, str] | None = None,
         timeout: float = WAIT, **fields: Any) -> httpx.Response:
    """POST a completion request and read the whole answer."""
    return httpx.post(router.url + route, json=body(route, **fields), headers=dict(headers or {}),
                      timeout=timeout)


def _event_json(payload: str) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        raise AssertionError(f"an SSE event relayed to the client is not JSON: {payload!r}") from None


def assert_completed_stream(text: str) -> list[dict[str, Any]]:
    """A stream that ended normally: JSON chunks, then ``[DONE]`` last; returns the chunks."""
    payloads = sse_payloads(text)
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    chunks = [_event_json(p) for p in payloads[:-1]]
    assert all(isinstance(c, dict) and "error" not in c for c in chunks), chunks
    return chunks


def assert_error_stream(text: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A stream cut by a failure (docs/contract.md, "Admission, capacity and retries"): chunks, then ONE
    ``data: {"error": {...}}`` event that ends it.

    Returns the chunks before the error and the error object.
    """
    payloads = sse_payloads(text)
    if payloads and payloads[-1] == "[DONE]":  # tolerated after the error event, never before it
        payloads = payloads[:-1]
    assert "[DONE]" not in payloads, payloads
    events = [_event_json(p) for p in payloads]
    assert all(isinstance(e, dict) for e in events), events
    errors = [i for i, e in enumerate(events) if "error" in e]
    assert errors == [len(events) - 1], f"want exactly one error event, last: {payloads}"
    envelope = events[-1]
    assert set(envelope) == {"error"}, envelope
    error = envelope["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "server_error", error
    return events[:-1], error


class StreamClient:
    """A streamed request read as it arrives (httpx), so a test can act between chunks."""

    def __init__(self, router: RouterThread, route: str = COMPLETIONS, *,
                 headers: Mapping[str, str] | None = None, timeout: float = WAIT, **fields: Any) -> None:
        self._client = httpx.Client(timeout=timeout)
        self._cm = self._client.stream("POST", router.url + route, json=body(route, stream=True, **fields),
                                       headers=dict(headers or {}))
        self.response = self._cm.__enter__()
        self._iter = self.response.iter_raw()
        self.text = ""

    @property
    def status(self) -> int:
        return self.response.status_code

    @property
    def rid(self) -> str:
        return rid_of(self.response)

    def read_events(self, count: int) -> str:
        """Read until at least ``count`` whole SSE events arrived."""
        while self.text.count("\n\n") < count:
            self.text += next(self._iter).decode()
        return self.text

    def read_all(self) -> str:
        for piece in self._iter:
            self.text += piece.decode()
        return self.text

    def close(self) -> None:
        try:
            self._cm.__exit__(None, None, None)
        finally:
            self._client.close()


# ------------------------------------------------------------------ raw clients


class CompletionClient(RawClient):
    """A completion request on a plain socket: send it, maybe read a little, then just close."""

    def __init__(self, router: RouterThread, route: str = COMPLETIONS, *,
                 headers: Sequence[tuple[str, str]] = (), **fields: Any) -> None:
        assert router.address is not None
        super().__init__(router.address, timeout=WAIT)
        self.send(request_bytes("POST", route, json.dumps(body(route, **fields)).encode(),
                                headers=[("content-type", "application/json"), *headers]))

    def read_until(self, marker: bytes, count: int = 1) -> bytes:
        """Read until ``marker`` occurs ``count`` times in what was received (EOFError if it closes first)."""
        while self.received.count(marker) < count:
            self._fill()
        return bytes(self.received)

    @property
    def rid(self) -> str:
        head = self.read_until(b"\r\n\r\n").split(b"\r\n\r\n")[0].decode("latin-1")
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "x-request-id":
                return value.strip()
        raise AssertionError(f"no x-request-id in {head!r}")


# ---------------------------------------------------------------- the journal


def assert_failed(record: dict[str, Any], *, code: str, leg: str | None, engine: str | None,
                  status: int, terminal: str = "failed") -> None:
    """A terminal record that names its error, failing leg and engine (docs/contract.md, "Admission, capacity
    and retries", "The journal")."""
    assert record["terminal"] == terminal, record
    assert record["status"] == status, record
    error = record["error"]
    assert error is not None and error["code"] == code, record
    assert error["leg"] == leg, error
    assert error["engine"] == engine, error


def assert_backend_ids(record: dict[str, Any]) -> None:
    """Each leg's backend ID is ``<rid>-p<n>`` / ``<rid>-d<n>`` and names exactly one attempt
    (docs/contract.md, "Prefill and decode legs")."""
    rid = record["rid"]
    seen = set()
    for leg in record["legs"]:
        letter = {"prefill": "p", "decode": "d"}[leg["phase"]]
        assert leg["backend_id"] == f"{rid}-{letter}{leg['attempt']}", leg
        assert leg["backend_id"] not in seen, record["legs"]
        seen.add(leg["backend_id"])
        kv = leg["kv"]
        if kv is not None and kv.get("release_id"):
            assert kv["release_id"] not in seen, record["legs"]
            seen.add(kv["release_id"])


# ------------------------------------------------------------------- capacity


def metric(router: RouterThread, name: str, **labels: str) -> float:
    """One sample of the router's ``/metrics``."""
    text = httpx.get(router.url + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no {name} {labels} in /metrics:\n{text}")


def assert_idle(router: RouterThread, timeout: float = WAIT) -> Any:
    """Every request, leg, slot and queue place is given back (docs/contract.md, "Admission, capacity and
    retries"); return the statistics."""
    stats = router.wait_idle(timeout)
    assert stats.requests == 0 and stats.inflight == 0 and stats.queued == 0 and stats.legs == 0, stats
    assert all(n == 0 for n in stats.engine_outstanding.values()), stats.engine_outstanding
    return stats


# -------------------------------------------------------------------------- KV


def kv_counts(sim: Any) -> dict[str, int]:
    s = sim.stats()
    return {k: s[k] for k in ("kv_held", "kv_held_total", "kv_pulled", "kv_released", "kv_expired")}


def wait_kv(sim: Any, predicate: Callable[[dict[str, Any]], bool], timeout: float = WAIT) -> dict[str, Any]:
    return sim.wait_for(predicate, timeout=timeout)  # type: ignore[no-any-return]


def prefill_kv_legs(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The prefill legs that left KV on their engine (they returned KV params)."""
    return [leg for leg in record["legs"] if leg["phase"] == "prefill" and leg["kv"] is not None]


def assert_unpulled_kv(record: dict[str, Any], leg: dict[str, Any], mode: str) -> None:
    """The journal's outcome for KV a prefill leg left and no decode leg pulled (docs/contract.md, "Prefill
    and decode legs")."""
    kv = leg["kv"]
    assert kv is not None, leg
    # The engine's key: the backend ID as vLLM mangles it (cmpl-<id>-0, a random suffix from 0.14).
    assert leg["backend_id"] in kv["owner"], kv
    assert kv["engine"] == leg["engine"], kv
    if mode == "lease":
        assert kv["outcome"] == "held_until_lease", kv
        assert kv["method"] == "lease", kv
    else:
        # decode_abort: nothing comes back to confirm the release (docs/operate.md).
        assert kv["outcome"] == ("release_sent" if mode == "decode_abort" else "released"), kv
        assert kv["method"] == mode, kv
        assert kv["error"] is None, kv
        if mode == "decode_abort":
            assert kv["release_id"] is not None and kv["release_id"].startswith(record["rid"] + "-d"), kv


def assert_kv_settled(prefill_sims: Iterable[Any], mode: str | None, *, unpulled: int = 0,
                      expire: bool = True, timeout: float = WAIT) -> None:
    """Every KV owner the prefill engines took is accounted for; none expired unless ``mode`` is ``lease``.

    ``unpulled`` is how many owners no decode leg pulled. Under
    ``abort_endpoint`` / ``decode_abort`` the router released each of them, so
    ``kv_released`` grew by exactly that and ``kv_expired`` stayed 0. Under
    ``lease`` (prefill sims with a short lease) the router could do nothing:
    they expired (``expire=False`` where a decode engine's own abort may free
    them first).
    """
    sims = list(prefill_sims)
    for sim in sims:
        wait_kv(sim, lambda s: s["kv_held"] == 0, timeout)
    totals = [kv_counts(s) for s in sims]
    for t in totals:
        assert t["kv_held_total"] == t["kv_pulled"] + t["kv_released"] + t["kv_expired"], t
    released = sum(t["kv_released"] for t in totals)
    expired = sum(t["kv_expired"] for t in totals)
    if mode == "lease":
        assert released + expired == unpulled, totals
        if expire:
            assert expired == unpulled, totals
    elif mode == "decode_pull":
        # Its releases are decode requests that pull the KV: the engine counts them as pulls.
        assert expired == 0, totals
    else:
        assert expired == 0, totals
        assert released == unpulled, totals


# -------------------------------------------------------------------- polling


def wait_sim_finished(sim: Any, request_id: str, timeout: float = WAIT) -> dict[str, Any]:
    """Wait until the engine is done with the request it received as ``request_id``; its record."""
    def done() -> dict[str, Any] | None:
        found = [r for r in sim.requests() if r["request_id"] == request_id]
        return found[0] if found and found[0]["duration_ms"] is not None else None
    return poll(done, timeout=timeout, what=f"engine done with {request_id}")  # type: ignore[no-any-return]


def sim_requests(sim: Any, *, route: str | None = None) -> list[dict[str, Any]]:
    """Completion requests a sim received (releases included), oldest first."""
    return [r for r in sim.requests() if r["path"].split("?")[0] in ((route,) if route else COMPLETION_PATHS)]


# --------------------------------------------------------- narwhal serve process


def run_journal_cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[bytes]:
    """``narwhal journal ARGS`` as a subprocess."""
    return subprocess.run([sys.executable, "-m", "narwhal.cli", "journal", *args], cwd=REPO,
                          capture_output=True, timeout=timeout, check=False)
