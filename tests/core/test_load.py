"""The load engines report: scraping every engine's ``/metrics`` (narwhal_core/load.py)."""

from __future__ import annotations

from narwhal_core.engine_metrics import EngineLoad
from narwhal_core.load import METRICS_BODY_LIMIT, METRICS_PATH, stale_after

from .router_driver import DECODE_URLS, PREFILL_URLS, Driver, completion_body

METRICS = (b'vllm:num_requests_waiting{engine="0"} 4\nvllm:num_requests_running{engine="0"} 2\n'
           b'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
           b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n')


def scrapes(d: Driver) -> dict[str, str]:
    """Pending scrapes: engine URL -> control key."""
    return {c.cmd.engine.url: c.cmd.key for c in d.pending_controls("metrics")}


def engine(d: Driver, url: str, phase: str = "prefill"):  # type: ignore[no-untyped-def]
    return next(e for e in d.router.fleet.all() if e.url == url and e.phase == phase)


def test_every_engine_is_scraped_at_start_with_the_engine_credential() -> None:
    d = Driver(engine={"engine_api_key_env": "K"}, engine_api_key="s3cret")
    pending = d.pending_controls("metrics")
    assert sorted(c.cmd.engine.url for c in pending) == sorted(PREFILL_URLS + DECODE_URLS)
    for control in pending:
        cmd = control.cmd
        assert (cmd.method, cmd.target, cmd.body_limit) == ("GET", METRICS_PATH, METRICS_BODY_LIMIT)
        assert (b"authorization", b"Bearer s3cret") in cmd.headers


def test_an_answer_is_kept_on_the_engine_and_the_next_scrape_follows_an_interval_later() -> None:
    d = Driver(routing={"metrics_interval_s": 2.0}, now=100.0)
    url = PREFILL_URLS[0]
    d.complete_control(scrapes(d)[url], status=200, body=METRICS)
    e = engine(d, url)
    assert e.reported == EngineLoad(waiting=4, running=2, kv_usage=0.5, kv_capacity_tokens=16000)
    assert e.reported_at == 100.0
    assert url not in scrapes(d)
    d.advance(1.9)
    assert url not in scrapes(d)
    d.advance(0.2)
    assert url in scrapes(d)


def test_an_engine_without_metrics_is_logged_once_and_stays_in_rotation() -> None:
    d = Driver(routing={"metrics_interval_s": 1.0}, health={"unhealthy_after": 1})
    url = DECODE_URLS[0]
    for _ in range(3):
        d.complete_control(scrapes(d)[url], status=404)
        d.advance(1.0)
    assert d.log_events().count("engine_metrics_unavailable") == 1
    assert engine(d, url, "decode").healthy and engine(d, url, "decode").reported is None
    d.complete_control(scrapes(d)[url], status=200, body=METRICS)
    assert d.log_events().count("engine_metrics_available") == 1
    assert engine(d, url, "decode").reported is not None


def test_an_answer_without_load_figures_says_nothing() -> None:
    d = Driver()
    url = PREFILL_URLS[1]
    d.complete_control(scrapes(d)[url], status=200, body=b"# a /metrics of some other server\nup 1\n")
    assert engine(d, url).reported is None
    assert "engine_metrics_unavailable" in d.log_events()


def test_figures_too_old_are_dropped_and_routing_goes_on_its_own_view() -> None:
    interval = 1.0
    d = Driver(routing={"metrics_interval_s": interval}, health={"probe_timeout_s": 0.5})
    url = PREFILL_URLS[0]
    d.complete_control(scrapes(d)[url], status=200, body=METRICS)
    e = engine(d, url)
    seen_at = e.reported_at
    while d.now - seen_at <= stale_after(interval, 0.5):
        assert e.reported is not None
        d.advance(interval)
        d.complete_control(scrapes(d)[url], status=None, error="timeout")
    assert e.reported is None


def test_the_capacity_an_engine_reports_bounds_its_prefix_index() -> None:
    d = Driver(routing={"policy": "prefix", "kv_capacity_tokens": 10_000_000})
    url = PREFILL_URLS[0]
    policy = d.router.fleet.policy
    d.complete_control(scrapes(d)[url], status=200, body=METRICS)
    from narwhal_core.prefix import tokens_to_blocks

    assert policy.capacities[url] == tokens_to_blocks(16000) < tokens_to_blocks(10_000_000)


def assumed(d: Driver) -> dict[str, dict[str, object]]:
    """The ``kv_capacity_assumed`` lines logged, by engine."""
    return {str(log.fields["engine"]): dict(log.fields) for log in d.logs if log.event == "kv_capacity_assumed"}


def test_a_prefill_engine_that_does_not_report_its_capacity_is_logged_with_the_bound_used() -> None:
    d = Driver(routing={"kv_capacity_tokens": 123_456})  # the default policy: prefix
    silent, bare = PREFILL_URLS
    for _ in range(2):
        d.complete_control(scrapes(d)[silent], status=404)
        report(d, bare)  # load figures, but no vllm:cache_config_info
        for url in DECODE_URLS:  # a decode engine's capacity bounds no index: nothing to say
            d.complete_control(scrapes(d)[url], status=404)
        d.advance(1.0)
    logged = assumed(d)
    assert sorted(logged) == sorted(PREFILL_URLS), logged  # once per engine
    assert d.log_events().count("kv_capacity_assumed") == 2
    for url, line in logged.items():
        assert line["kv_capacity_tokens"] == 123_456 and "routing.kv_capacity_tokens" in str(line["fix"]), line
    assert "HTTP 404" in str(logged[silent]["reason"]), logged
    assert "vllm:cache_config_info" in str(logged[bare]["reason"]), logged
    policy = d.router.fleet.policy
    assert policy.capacities == {}  # both bounded by the configured figure
    # Engines that report their capacity, or a policy that keeps no index: nothing to say.
    told = Driver()
    for url in PREFILL_URLS + DECODE_URLS:
        told.complete_control(scrapes(told)[url], status=200, body=METRICS)
    assert assumed(told) == {}
    blind = Driver(routing={"policy": "least_loaded"})
    for url in PREFILL_URLS:
        blind.complete_control(scrapes(blind)[url], status=404)
    assert assumed(blind) == {}


def test_with_scraping_off_the_bound_is_logged_at_start() -> None:
    d = Driver(routing={"metrics_interval_s": 0})
    logged = assumed(d)
    assert sorted(logged) == sorted(PREFILL_URLS), logged
    assert all("metrics_interval_s = 0" in str(line["reason"]) for line in logged.values()), logged


def test_no_scrapes_when_turned_off_or_once_draining() -> None:
    assert not Driver(routing={"metrics_interval_s": 0}).pending_controls("metrics")
    d = Driver(routing={"metrics_interval_s": 1.0})
    url = PREFILL_URLS[0]
    d.complete_control(scrapes(d)[url], status=200, body=METRICS)
    d.shutdown()
    d.advance(5.0)
    assert url not in scrapes(d)


def report(d: Driver, url: str, *, waiting: int = 0, running: int = 0, usage: float = 0.0) -> None:
    """``url``'s pending scrape answers with these figures."""
    body = (f'vllm:num_requests_waiting{{engine="0"}} {waiting}\nvllm:num_requests_running{{engine="0"}} {running}\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} {usage}\n').encode()
    d.complete_control(scrapes(d)[url], status=200, body=body)


def test_a_prefill_engine_busy_with_other_routers_traffic_is_passed_over() -> None:
    d = Driver(routing={"policy": "least_loaded"})
    busy, idle = PREFILL_URLS
    # Narwhal's own legs have taught it a mean prompt length.
    d.post("/v1/completions", completion_body("x" * 4000))
    first = d.leg("prefill")
    report(d, busy, waiting=6, running=2)  # beyond Narwhal's one leg at most: other routers' requests
    report(d, idle)
    e = engine(d, busy)
    assert e.foreign == 8 - e.outstanding and e.foreign_tokens > 0
    for _ in range(3):
        d.post("/v1/completions", completion_body("y" * 4000))
    chosen = [leg.engine.url for leg in d.open_legs("prefill") if leg.bid != first.bid]
    assert chosen and set(chosen) == {idle}, chosen


def test_a_decode_engine_reporting_a_nearly_full_cache_comes_last() -> None:
    d = Driver(routing={"policy": "least_loaded", "mode": "never"})
    full, roomy = DECODE_URLS
    report(d, full, usage=0.95)
    report(d, roomy, running=3, usage=0.5)  # more sequences, but room for KV
    d.post("/v1/completions", completion_body("hello"))
    assert d.leg("decode").engine.url == roomy


def test_stale_figures_leave_the_load_view() -> None:
    d = Driver(routing={"metrics_interval_s": 1.0}, health={"probe_timeout_s": 0.5})
    url = DECODE_URLS[0]
    report(d, url, waiting=2, running=9, usage=0.97)
    e = engine(d, url, "decode")
    assert (e.foreign, e.kv_usage) == (11, 0.97)
    while e.reported is not None:
        d.advance(1.0)
        d.complete_control(scrapes(d)[url], status=503)
    assert (e.foreign, e.foreign_tokens, e.kv_usage) == (0, 0, 0.0)
