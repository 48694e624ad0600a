"""An unexpected exception in the core, while it handles one connection's event, ends that request only.

The router is a subclass of the real one that raises for chosen requests
(found by a marker in their prompt, which every leg's request carries):

* ``leg-fault``: on the first bytes of its prefill leg, before the router
  reads them (a whole answer, not yet begun);
* ``client-fault``: right after the router handled the request's bytes (it
  is admitted, its prefill leg started);
* ``stream-fault``: on its decode leg's third read, once its stream has begun.

On both runtimes: each faulted request ends 500 ``internal_error`` in the
OpenAI envelope (the begun stream with that error as its last event), with a
``failed`` terminal record; the process log has one ``internal_error`` line
per fault, with the traceback; a stream running meanwhile and the requests
after it are served as usual; and the two runtimes journal the same records.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_runtime.app import load_authenticator
from narwhal_runtime.metrics import render
from narwhal_core import ClientData, LegData, RidSource, Router, StartLeg
from narwhal_sim.testing import SimThread

from .. import harness
from ..harness import LogCapture, RouterThread, make_config
from ..helpers import RouterWrapper, read_journal, wait_for_terminals
from .test_runtime_parity import _masked

MARKERS = ("leg-fault", "client-fault", "stream-fault")


class FaultyRouter(RouterWrapper):
    """Raises inside :meth:`receive` for the requests whose prompt carries a marker."""

    def __init__(self, inner: Router) -> None:
        super().__init__(inner)
        self.traps: dict[str, str] = {}  # leg -> marker
        self.reads: dict[str, int] = {}

    def next_output(self) -> Any:
        cmd = self.inner.next_output()
        if type(cmd) is StartLeg:
            phase = "prefill" if cmd.leg.rsplit("-", 1)[-1].startswith("p") else "decode"
            if phase == "prefill" and b"leg-fault" in cmd.data:
                self.traps[cmd.leg] = "leg-fault"
            elif phase == "decode" and b"stream-fault" in cmd.data:
                self.traps[cmd.leg] = "stream-fault"
        return cmd

    def receive(self, event: Any, *, now: float) -> None:
        if type(event) is LegData and event.leg in self.traps:
            reads = self.reads[event.leg] = self.reads.get(event.leg, 0) + 1
            marker = self.traps[event.leg]
            if marker == "leg-fault" or reads == 3:
                del self.traps[event.leg]
                raise RuntimeError(f"injected fault: {marker}")
        self.inner.receive(event, now=now)
        if type(event) is ClientData and b"client-fault" in event.data:
            raise RuntimeError("injected fault: client-fault")


def _faulty_build_router(config: Any, *, now: float, env: Any = None, rid_prefix: str | None = None) -> Any:
    return FaultyRouter(Router(
        config, rid_source=RidSource(rid_prefix or secrets.token_hex(5)), authenticator=load_authenticator(config),
        wall_offset=time.time() - now, now=now, render_metrics=render,
    ))


def _stream(url: str, prompt: str, max_tokens: int) -> tuple[int, str, str]:
    with httpx.Client(timeout=15) as client:
        with client.stream("POST", url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        }) as answer:
            return answer.status_code, answer.headers["x-request-id"], answer.read().decode()


def _events(text: str) -> list[Any]:
    return [json.loads(p[6:]) if p != "data: [DONE]" else "[DONE]" for p in text.split("\n\n") if p]


def _scenario(router: RouterThread, log: LogCapture) -> dict[str, str]:
    """Drive the scenario; return the rid of each kind of request."""
    rids: dict[str, str] = {}
    url = router.url
    # A stream that runs while the faults happen.
    background: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: background.update(
        result=_stream(url, "An innocent bystander", 60)), daemon=True)
    runner.start()

    answer = httpx.post(url + "/v1/completions", json={"prompt": "leg-fault", "max_tokens": 4}, timeout=15)
    _assert_internal_error(answer)
    rids["leg-fault"] = answer.headers["x-request-id"]

    status, rid, text = _stream(url, "client-fault", 4)
    assert status == 500, text
    assert json.loads(text)["error"]["code"] == "internal_error", text
    rids["client-fault"] = rid

    status, rid, text = _stream(url, "stream-fault", 40)
    assert status == 200, text
    events = _events(text)
    assert events[-1] != "[DONE]" and "[DONE]" not in events, events
    assert events[-1]["error"]["code"] == "internal_error" and events[-1]["error"]["type"] == "server_error"
    assert len(events) >= 2, events  # it had begun
    rids["stream-fault"] = rid

    runner.join(15)
    status, rid, text = background["result"]
    assert status == 200 and text.endswith("data: [DONE]\n\n"), text[-300:]
    rids["bystander"] = rid
    # And the router goes on serving.
    after = httpx.post(url + "/v1/completions", json={"prompt": "Afterwards", "max_tokens": 3}, timeout=15)
    assert after.status_code == 200, after.text
    rids["after"] = after.headers["x-request-id"]
    return rids


def _assert_internal_error(answer: httpx.Response) -> None:
    assert answer.status_code == 500, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert (error["type"], error["code"]) == ("server_error", "internal_error"), error


def _run(runtime: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    monkeypatch.setattr(harness, "build_router", _faulty_build_router)
    journal = tmp_path / f"journal-{runtime}.jsonl"
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=1) as decode:
        config = make_config(journal, prefill=(prefill.url,), decode=(decode.url,),
                             health={"probe_interval_s": 600.0}, routing={"policy": "least_loaded"})
        with LogCapture() as log, RouterThread(config, runtime) as router:
            assert isinstance(router.server.serving.router, FaultyRouter)
            rids = _scenario(router, log)
            records = wait_for_terminals(journal, len(rids))
            router.wait_idle()
            stats = router.statistics()
            assert stats.inflight == 0 and stats.requests == 0, stats
        errors = [e for e in log.events() if e["event"] == "internal_error"]
        urls = {prefill.url: "prefill0", decode.url: "decode0"}

    terminals = {r["rid"]: r for r in records if r["terminal"] is not None}
    assert len(terminals) == len(rids), terminals
    for marker in MARKERS:
        record = terminals[rids[marker]]
        assert record["terminal"] == "failed", record
        assert record["error"]["code"] == "internal_error" and record["error"]["leg"] is None, record
        assert record["status"] == (200 if marker == "stream-fault" else 500), record
        assert all(leg["outcome"] in ("ok", "cancelled") for leg in record["legs"]), record["legs"]
    for ok in ("bystander", "after"):
        assert terminals[rids[ok]]["terminal"] == "completed", terminals[rids[ok]]
    # One line per fault, naming the request, with the traceback.
    assert sorted(e["rid"] for e in errors) == sorted(rids[m] for m in MARKERS), errors
    for line in errors:
        assert line["level"] == "error" and line["problem"].startswith("RuntimeError: injected fault"), line
        assert "Traceback (most recent call last)" in line["traceback"], line
        assert "injected fault" in line["traceback"]
    # Each request's records, masked on their own (the bystander's interleave differently on each run).
    journalled = read_journal(journal)
    return {kind: _masked([r for r in journalled if r["rid"] == rid], urls) for kind, rid in rids.items()}


def test_a_fault_in_the_core_ends_only_its_request_on_both_runtimes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    on_trio = _run("trio", tmp_path, monkeypatch)
    on_asyncio = _run("asyncio", tmp_path, monkeypatch)
    assert on_trio.keys() == on_asyncio.keys()
    for kind in on_trio:
        assert on_trio[kind] == on_asyncio[kind], kind
