"""Capacity after the storm: a finished request must leave nothing behind (docs/contract.md, "Admission,
capacity and retries").

The fault rows check the counters (``statistics()``); this checks the memory
behind them: once a request has its terminal record, the router holds no
reference to it — not even while the client keeps its keep-alive connection
open and more traffic flows (the soak run, ``benchmarks/soak.py``, shows
what happens otherwise: RSS grows with every request).
"""

from __future__ import annotations

import gc

import httpx

from narwhal_core.legs import Leg
from narwhal_core.requests import Request

from ..helpers import COMPLETIONS, only_terminals
from .support import assert_idle, body


def _live(cls: type) -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is cls)


def test_finished_requests_are_not_retained(start_router, fleet, journal_path) -> None:
    router = start_router()
    with httpx.Client(timeout=10) as client:  # one keep-alive connection, kept open
        for i in range(60):
            answer = client.post(router.url + COMPLETIONS, json=body(stream=i % 2 == 1, max_tokens=2))
            assert answer.status_code == 200, answer.text
        only_terminals(journal_path, 60)
        assert_idle(router)
        requests = router.call(lambda: _live(Request))
        legs = router.call(lambda: _live(Leg))
    assert (requests, legs) == (0, 0), (
        f"{requests} finished requests and {legs} finished legs are still referenced by the router"
    )
