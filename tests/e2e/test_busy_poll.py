"""``ingress.busy_poll_us``: after each event the event loop polls instead of sleeping, then parks.

The counters read here (``Server.busy_polls``) count loop iterations (asyncio)
or scheduler batches (trio) spent polling. What must hold on both runtimes:
answers and journal are those of a router that sleeps; the loop does poll
after traffic; and it stops polling once the window after the last event is
over, so an idle router does not spin.
"""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from ..harness import RouterThread, make_config
from ..helpers import MODEL, terminals_by_rid, wait_for_terminals

#: Long enough that the polling is easy to see, short enough to wait out.
WINDOW_US = 20_000
#: Health probes are events too: the test config's fast ones would keep reopening the window.
QUIET_PROBES = {"probe_interval_s": 60.0}


def _polls(router: RouterThread) -> int:
    return int(router.call(lambda: router.server.serving.busy_polls))


def _wait_parked(router: RouterThread, timeout: float = 10.0) -> None:
    """Until the poll count stays still for ten windows."""
    deadline = time.monotonic() + timeout
    while True:
        before = _polls(router)
        time.sleep(10 * WINDOW_US / 1e6)
        if _polls(router) == before:
            return
        assert time.monotonic() < deadline, "the event loop never stopped busy polling"


def _serve_three(router: RouterThread, journal_path: Any) -> None:
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        rids = []
        for i in range(2):
            completion = client.completions.with_raw_response.create(model=MODEL, prompt=f"poll {i}", max_tokens=4)
            assert completion.parse().choices[0].text
            rids.append(completion.headers["x-request-id"])
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "poll"}], max_tokens=4, stream=True,
        ))  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    terminals = terminals_by_rid(wait_for_terminals(journal_path, 3))
    assert len(terminals) == 3
    assert all(t["terminal"] == "completed" for t in terminals.values()), terminals
    for rid in rids:
        assert [leg["phase"] for leg in terminals[rid]["legs"]] == ["prefill", "decode"]


def test_busy_polling_serves_polls_and_parks(start_router, journal_path) -> None:
    router = start_router(ingress={"busy_poll_us": WINDOW_US}, health=QUIET_PROBES)
    _serve_three(router, journal_path)
    assert _polls(router) > 0, "no loop iteration was spent polling"
    _wait_parked(router)
    # Traffic opens the window again.
    parked = _polls(router)
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        assert client.completions.create(model=MODEL, prompt="again", max_tokens=2).choices[0].text
    assert _polls(router) > parked
    _wait_parked(router)
    stats = router.wait_idle()
    assert stats.inflight == 0 and stats.legs == 0


def test_no_busy_polling_by_default(start_router, journal_path) -> None:
    router = start_router(health=QUIET_PROBES)
    assert router.config.ingress.busy_poll_us == 0
    _serve_three(router, journal_path)
    assert _polls(router) == 0


def test_busy_polling_on_uvloop(fleet, journal_path) -> None:
    """The loop `narwhal serve --runtime asyncio` runs (uvloop where installed) polls and parks the same way."""
    pytest.importorskip("uvloop")
    config = make_config(journal_path, prefill=fleet.prefill_urls, decode=fleet.decode_urls,
                         ingress={"busy_poll_us": WINDOW_US}, health=QUIET_PROBES)  # fmt: skip
    with RouterThread(config, "asyncio", uvloop=True) as router:
        assert router.call(lambda: type(router.server._loop).__module__).startswith("uvloop")
        _serve_three(router, journal_path)
        assert _polls(router) > 0
        _wait_parked(router)
