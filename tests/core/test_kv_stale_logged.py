"""An engine falling back from its KV events is logged when it happens (docs/operate.md, "KV events").

Under ``routing.policy = "kv"`` an engine whose stream was lost is weighed
from the approximate index once ``routing.kv_events_stale_s`` has passed;
``kv_events_stale`` says so. The router finds that on time by itself (a
timer), with no request to route; and a statistics call (``/metrics``)
that finds an engine stale logs it at once, so the log never lags the
gauge.
"""

from __future__ import annotations

from typing import Any

from narwhal_core.contract import COMPLETIONS
from narwhal_core.events import KvEventsReceived, KvStreamChanged

from .router_driver import PREFILL_URLS, Driver, completion_body
from .test_kv_policy import LONG, kv_driver, stored


def stale_lines(d: Driver) -> list[dict[str, Any]]:
    return [log.fields for log in d.logs if log.event == "kv_events_stale"]


def test_a_lost_stream_falls_back_on_time_with_no_traffic() -> None:
    d = kv_driver(kv_events_stale_s=5.0)
    holder = PREFILL_URLS[-1]
    d.feed(KvStreamChanged(holder, True, "connected"))
    d.feed(KvEventsReceived(holder, (stored(LONG),)))
    d.feed(KvStreamChanged(holder, False, "disconnected"))
    d.advance(4.9)
    assert stale_lines(d) == [] and d.router.statistics().kv_events_live[holder] is True
    d.advance(0.1)
    assert stale_lines(d) == [{"level": "warning", "engine": holder, "reason": "lost", "index": "approximate",
                               "stale_s": 5.0}]  # fmt: skip
    assert d.router.statistics().kv_events_live[holder] is False
    assert d.router.fleet.policy.index.blocks(holder) == frozenset()  # type: ignore[attr-defined]


def test_a_stream_back_before_the_deadline_does_not_fall_back() -> None:
    d = kv_driver(kv_events_stale_s=5.0)
    holder = PREFILL_URLS[-1]
    d.feed(KvStreamChanged(holder, True, "connected"))
    d.feed(KvStreamChanged(holder, False, "disconnected"))
    d.advance(1.0)
    d.feed(KvStreamChanged(holder, True, "connected"))
    d.advance(10.0)
    assert stale_lines(d) == [] and d.router.statistics().kv_events_live[holder] is True


def test_a_statistics_call_that_finds_an_engine_silent_logs_it() -> None:
    d = kv_driver(kv_events_stale_s=5.0)
    for url in PREFILL_URLS:
        d.feed(KvStreamChanged(url, True, "connected"))
    d.post(COMPLETIONS, completion_body(LONG))  # a prefill is sent: its events should follow; none does
    d.serve_until_done()
    (chosen,) = {leg.engine.url for leg in d.legs.values() if leg.phase == "prefill"}
    d.advance(5.0)
    assert d.router.statistics().kv_events_live[chosen] is False
    d.feed(KvEventsReceived("http://elsewhere:1", ()))  # an event that changes nothing: drains the log
    assert [(f["engine"], f["reason"]) for f in stale_lines(d)] == [(chosen, "silent")]
