"""``GET /metrics`` through the core (docs/design.md, "The parts of the core").

The clients part reads a scrape and leaves it in ``Clients.metrics_wanted``;
the router renders it from its counters and live statistics with the renderer
the adapter passed, after the event's own handling, so a scrape sees the
figures of the moment it is answered and keeps its place among a
connection's pipelined requests.
"""

from __future__ import annotations

from .router_driver import COMPLETIONS, Driver, SentRequest, completion_body, json_request

METRICS = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_scrape_shows_the_requests_in_flight_when_it_is_answered() -> None:
    d = Driver()
    busy = d.post(COMPLETIONS, completion_body(prompt="in flight"))
    scraper = d.connect()
    scraper.send(METRICS, requests=[SentRequest("GET", "/metrics", True)])
    (answer,) = scraper.complete_responses()
    assert answer.status == 200
    assert bytes(answer.body) == b"inflight 1\nqueued 0\nconnections 2\nterminal_records 0\n"
    d.serve(d.leg().bid)
    d.serve(d.leg("decode").bid)
    assert busy.last.status == 200
    scraper.send(METRICS, requests=[SentRequest("GET", "/metrics", True)])
    assert bytes(scraper.last.body) == b"inflight 0\nqueued 0\nconnections 2\nterminal_records 1\n"
    assert len(d.scrapes) == 2
    d.check_invariants(final=True)


def test_a_scrape_pipelined_behind_a_completion_waits_its_turn_and_sees_it_ended() -> None:
    d = Driver()
    client = d.connect()
    client.send(
        json_request(COMPLETIONS, completion_body(prompt="first")) + METRICS
        + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + METRICS,
        requests=[SentRequest("POST", COMPLETIONS, True), SentRequest("GET", "/metrics", True),
                  SentRequest("GET", "/health", True), SentRequest("GET", "/metrics", True)],
    )
    assert d.scrapes == []  # the completion is answered first
    d.serve(d.leg().bid)
    d.serve(d.leg("decode").bid)
    statuses = [(r.request, r.status) for r in client.responses]
    assert statuses == [(("POST", COMPLETIONS), 200), (("GET", "/metrics"), 200), (("GET", "/health"), 200),
                        (("GET", "/metrics"), 200)]
    assert d.scrapes == [(0, 0, 1, 1), (0, 0, 1, 1)]
    assert len({r.rid for r in client.responses}) == 4
    d.check_invariants(final=True)


def test_without_a_renderer_a_scrape_is_refused_in_the_envelope() -> None:
    d = Driver(render_metrics=None)
    client = d.connect()
    client.send(METRICS, requests=[SentRequest("GET", "/metrics", True)])
    answer = client.last
    assert answer.status == 503
    assert answer.json()["error"]["code"] == "no_metrics"
    d.check_invariants(final=True)
