"""The pure parts of narwhal bench: workloads, prompts, statistics, answer reading."""

from __future__ import annotations

import json
import os

import pytest

from narwhal_bench.reader import ResponseReader
from narwhal_bench.stats import RequestResult, parse_prometheus, percentile, prefix_hit_rate, summarize
from narwhal_bench.trace import (
    BLOCK_TOKENS,
    PromptSynth,
    SessionWorkload,
    TraceError,
    TraceRequest,
    generate_sessions,
    limit,
    load_mooncake,
    parse_mooncake_lines,
    scale_arrivals,
)
from narwhal_sim.model import Prompt

SHARED_TRACE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"


def line(ts: float, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def test_mooncake_lines_parse_sorted_and_indexed() -> None:
    reqs = parse_mooncake_lines([line(2000, 600, 5, [1, 2]), "", line(500, 100, 3, [7])])
    assert [(r.index, r.arrival_s, r.input_length, r.hash_ids) for r in reqs] == [
        (0, 0.5, 100, (7,)), (1, 2.0, 600, (1, 2))]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("not json", "not JSON"),
        ("[1]", "JSON object"),
        (line(-1, 10, 1, [1]), "timestamp"),
        (line(0, 0, 1, [1]), "input_length"),
        (line(0, 10, 1.5, [1]), "output_length"),  # type: ignore[arg-type]
        (line(0, 10, 1, []), "hash_ids"),
        (line(0, 10, 1, ["a"]), "hash_ids"),  # type: ignore[list-item]
        (line(0, 1025, 1, [1, 2]), "needs more than its 2 blocks"),
    ],
)
def test_bad_trace_lines_name_the_line_and_field(bad: str, message: str) -> None:
    with pytest.raises(TraceError, match=message) as info:
        parse_mooncake_lines([line(0, 10, 1, [1]), bad], source="t.jsonl")
    assert "t.jsonl:2" in str(info.value)


def test_missing_trace_file_is_a_trace_error(tmp_path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_mooncake(str(tmp_path / "nope.jsonl"))


def test_shared_block_ids_become_shared_prefixes_the_simulator_caches() -> None:
    synth = PromptSynth(seed=3)
    a = TraceRequest(index=0, arrival_s=0, input_length=3 * BLOCK_TOKENS, output_length=1, hash_ids=(10, 11, 12))
    b = TraceRequest(index=1, arrival_s=0, input_length=2 * BLOCK_TOKENS + 100, output_length=1,
                     hash_ids=(10, 11, 99))
    c = TraceRequest(index=2, arrival_s=0, input_length=2 * BLOCK_TOKENS, output_length=1, hash_ids=(11, 10))
    pa, pb, pc = (synth.prompt(r) for r in (a, b, c))
    assert isinstance(pa, str) and isinstance(pb, str) and isinstance(pc, str)
    # Lengths follow the simulator's 4-characters-per-token count.
    assert [Prompt(text=p).num_tokens for p in (pa, pb, pc)] == [a.input_length, b.input_length, c.input_length]
    assert len(os.path.commonprefix([pa, pb])) < 2 * BLOCK_TOKENS * 4 + 64 <= len(pa)
    assert pb.startswith(pa[: 2 * BLOCK_TOKENS * 4])
    # The simulator's 16-token block keys agree exactly on the shared blocks, and only there.
    ka, kb, kc = (Prompt(text=p).block_keys(16) for p in (pa, pb, pc))
    shared = 2 * BLOCK_TOKENS // 16
    assert ka[:shared] == kb[:shared] and ka[shared] != kb[shared]
    assert ka[0] != kc[0]  # same ids in another order: another prefix
    # Deterministic across instances (another process computes the same text).
    assert PromptSynth(seed=3).prompt(b) == pb
    assert PromptSynth(seed=4).prompt(b) != pb


def test_token_id_prompts_share_blocks_too() -> None:
    synth = PromptSynth(token_ids=True)
    a = TraceRequest(index=0, arrival_s=0, input_length=BLOCK_TOKENS + 7, output_length=1, hash_ids=(1, 2))
    b = TraceRequest(index=1, arrival_s=0, input_length=BLOCK_TOKENS + 7, output_length=1, hash_ids=(1, 3))
    pa, pb = synth.prompt(a), synth.prompt(b)
    assert isinstance(pa, list) and len(pa) == a.input_length and all(100 <= t < 32100 for t in pa)
    assert pa[:BLOCK_TOKENS] == pb[:BLOCK_TOKENS] and pa[BLOCK_TOKENS:] != pb[BLOCK_TOKENS:]


def test_generator_is_seeded_sorted_and_histories_grow() -> None:
    spec = SessionWorkload(sessions=8, turns=3, system_prompts=2, system_tokens=600, seed=5)
    reqs = generate_sessions(spec)
    assert reqs == generate_sessions(spec)
    assert reqs != generate_sessions(SessionWorkload(sessions=8, turns=3, system_prompts=2, system_tokens=600, seed=6))
    assert len(reqs) == 24
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    by_session: dict[int, list[TraceRequest]] = {}
    for r in reqs:
        assert r.input_length <= BLOCK_TOKENS * len(r.hash_ids)
        by_session.setdefault(r.session, []).append(r)  # type: ignore[arg-type]
    system_firsts = set()
    for turns in by_session.values():
        assert len(turns) == 3
        system_firsts.add(turns[0].hash_ids[0])
        for before, after in zip(turns, turns[1:]):
            # The next turn's prompt extends the previous one (its blocks are a prefix).
            assert after.hash_ids[: len(before.hash_ids)] == before.hash_ids
            assert after.input_length > before.input_length + before.output_length
    assert len(system_firsts) == 2  # sessions share the two system prompts


def test_generator_rejects_bad_settings() -> None:
    with pytest.raises(TraceError, match="turns"):
        generate_sessions(SessionWorkload(turns=0))
    with pytest.raises(TraceError, match="session_rate"):
        generate_sessions(SessionWorkload(session_rate=0))


def test_scaling_and_limits() -> None:
    reqs = parse_mooncake_lines([line(1000, 10, 1, [1]), line(3000, 10, 1, [2]), line(5000, 10, 1, [3])])
    assert [r.arrival_s for r in scale_arrivals(reqs, time_scale=0.5)] == [0.0, 1.0, 2.0]
    assert [r.arrival_s for r in scale_arrivals(reqs, rate_scale=4)] == [0.0, 0.5, 1.0]
    assert len(limit(scale_arrivals(reqs), duration_s=4.0)) == 2
    assert len(limit(reqs, max_requests=1)) == 1
    with pytest.raises(TraceError):
        scale_arrivals(reqs, time_scale=0)


@pytest.mark.skipif(not os.path.exists(SHARED_TRACE), reason="the shared trace is not on this machine")
def test_the_shared_trace_loads() -> None:
    reqs = load_mooncake(SHARED_TRACE)
    assert len(reqs) == 3993 and reqs[-1].arrival_s == pytest.approx(1022.025)


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert percentile(list(map(float, range(101))), 90) == pytest.approx(90.0)


def result(index: int, *, sent: float, ttft: float | None, tokens: int, itl: float, ok: bool = True,
           error: str | None = None) -> RequestResult:
    gaps = [itl] * (tokens - 1)
    e2e = (ttft or 0.0) + sum(gaps)
    return RequestResult(index=index, scheduled_s=sent, sent_s=sent, input_length=100, output_length=tokens,
                         status=200 if ok else 503, ok=ok, error=error, ttft_s=ttft, e2e_s=e2e,
                         output_tokens=tokens if ok else 0, itl_s=gaps if ok else [])


def test_summary_goodput_counts_requests_meeting_both_slos() -> None:
    results = [
        result(0, sent=0.0, ttft=0.1, tokens=11, itl=0.01),   # good
        result(1, sent=1.0, ttft=0.5, tokens=11, itl=0.01),   # TTFT too slow
        result(2, sent=2.0, ttft=0.1, tokens=11, itl=0.05),   # TPOT too slow
        result(3, sent=3.0, ttft=0.2, tokens=1, itl=0.0),     # one token: no TPOT, TTFT ok: good
        result(4, sent=4.0, ttft=None, tokens=0, itl=0.0, ok=False, error="HTTP 503: full"),
    ]
    s = summarize(results, slo_ttft_s=0.3, slo_itl_s=0.02)
    # The run: first send (0) to last answer (request 2 ends at 2.6, request 4 at 4.0).
    assert s.duration_s == pytest.approx(4.0)
    assert (s.requests, s.completed, s.errors, s.good) == (5, 4, 1, 2)
    assert s.goodput == pytest.approx(2 / 4.0)
    assert s.request_throughput == pytest.approx(4 / 4.0)
    assert s.ttft_p50_s == pytest.approx(0.15)
    assert s.error_kinds == {"HTTP 503": 1}
    assert s.itl_p50_s == pytest.approx(0.01)
    no_slo = summarize(results)
    assert no_slo.good == 4


def test_results_round_trip_json() -> None:
    r = result(7, sent=1.5, ttft=0.25, tokens=3, itl=0.01)
    assert RequestResult.from_json(json.loads(r.to_json())) == r


METRICS_BEFORE = """# HELP vllm:prefix_cache_hits_total x
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="m"} 100.0
vllm:prefix_cache_queries_total{model_name="m"} 1000.0
vllm:prompt_tokens_total{model_name="m"} 900.0
"""
METRICS_AFTER = METRICS_BEFORE.replace(" 100.0", " 400.0").replace(" 1000.0", " 2000.0")


def test_prefix_hit_rate_from_two_scrapes() -> None:
    before = {"a": parse_prometheus(METRICS_BEFORE)}
    after = {"a": parse_prometheus(METRICS_AFTER)}
    rate = prefix_hit_rate(before, after)
    assert rate.exact and rate.rate == pytest.approx(300 / 1000)
    # Without the queries counter (older simulators): hits + computed prompt tokens.
    old_before = {"a": {"vllm:prefix_cache_hits_total": 0.0, "vllm:prompt_tokens_total": 0.0}}
    old_after = {"a": {"vllm:prefix_cache_hits_total": 30.0, "vllm:prompt_tokens_total": 70.0}}
    rate = prefix_hit_rate(old_before, old_after)
    assert not rate.exact and rate.rate == pytest.approx(0.3)


def sse(payload: dict | bytes) -> bytes:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return b"data: " + data + b"\n\n"


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_reader_times_each_streamed_token_across_reads() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    tok = lambda t: sse({"choices": [{"index": 0, "text": t}]})  # noqa: E731
    chat_role = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    usage = sse({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 64}}})
    stream = chat_role + tok(" a") + tok(" b") + tok(" c") + usage + b"data: [DONE]\n\n"
    body = chunked(stream[:10]) + chunked(stream[10:120]) + chunked(stream[120:]) + b"0\r\n\r\n"
    reader = ResponseReader()
    # Split the bytes at awkward places, each read at a later time.
    cuts = [0, 50, 150, 190, len(head + body)]
    data = head + body
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        reader.feed(data[a:b], float(i))
    assert reader.complete and reader.status == 200 and reader.error is None
    assert len(reader.token_times) == 3
    assert reader.token_times == sorted(reader.token_times)
    assert reader.cached_tokens == 64


def test_reader_whole_answers_and_errors() -> None:
    body = json.dumps({"choices": [{"text": "abc"}], "usage": {"completion_tokens": 5}}).encode()
    reader = ResponseReader()
    reader.feed(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
                + body, 2.0)
    assert reader.complete and reader.token_times == [2.0] * 5
    err = json.dumps({"error": {"message": "too long", "type": "BadRequestError", "param": None, "code": 400}})
    reader = ResponseReader()
    reader.feed(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(err), err.encode()), 1.0)
    assert reader.error == "HTTP 400: too long" and not reader.token_times
    reader = ResponseReader()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    reader.feed(head + chunked(sse({"error": {"message": "engine died"}})) + b"0\r\n\r\n", 1.0)
    assert reader.complete and reader.error is not None and "engine died" in reader.error
    reader = ResponseReader()
    with pytest.raises(ValueError, match="bad HTTP"):
        reader.feed(b"NOT HTTP AT ALL\r\n\r\n", 0.0)
