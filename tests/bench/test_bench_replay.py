"""narwhal bench against real sockets: a router in front of simulated engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal.cli import main as narwhal_main
from narwhal_bench.cli import main as bench_main
from narwhal_bench.stats import read_results
from narwhal_sim.testing import SimThread
from tests.harness import RouterThread, make_config

pytestmark = pytest.mark.timeout(120)


def write_trace(path: Path) -> Path:
    # Two groups of requests sharing 2-block prefixes, 50 ms apart.
    lines = []
    for i in range(12):
        group = i % 2
        ids = [1000 * group, 1000 * group + 1, 5000 + i]
        lines.append(json.dumps({"timestamp": 50 * i, "input_length": 1200 + i, "output_length": 6 + i % 3,
                                 "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_replay_through_the_router_reports_tokens_and_hits(tmp_path: Path, capsys) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    out = tmp_path / "out.jsonl"
    summary = tmp_path / "summary.json"
    with SimThread("prefill", speed=20) as p, SimThread("decode", speed=20) as d:
        with RouterThread(make_config(tmp_path / "j.log", prefill=(p.url,), decode=(d.url,))) as router:
            rc = narwhal_main(["bench", "--trace", str(trace), "--base-url", router.url, "--time-scale", "0.5",
                               "--engine-metrics", p.url, "--output", str(out), "--summary-json", str(summary),
                               "--slo-ttft-ms", "5000", "--slo-itl-ms", "1000", "--label", "pd"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "TTFT p50 / p90 / p99 (ms)" in captured.out and "goodput" in captured.out
    assert "12/12 done, 0 errors" in captured.err  # the progress bar
    results = read_results(out.read_bytes().splitlines())
    assert [r.index for r in results] == list(range(12))
    for r in results:
        assert r.ok and r.status == 200, r
        assert r.output_tokens == r.output_length  # every token streamed and counted
        assert len(r.itl_s) == r.output_tokens - 1
        assert 0 < r.ttft_s <= r.e2e_s  # type: ignore[operator]
        assert r.sent_s >= r.scheduled_s - 0.002  # timers may fire up to a clock tick early
    # The schedule is kept: the 12th request was sent 0.5 * 550 ms after the first.
    assert results[-1].sent_s == pytest.approx(0.275, abs=0.1)
    data = json.loads(summary.read_text())
    assert data["completed"] == 12 and data["good"] == 12 and data["label"] == "pd"
    # Requests 2..11 find their group's first two blocks (1024 of ~1200 tokens) cached.
    assert 0.5 < data["prefix_hit_rate"] < 0.9


def test_concurrency_cap_holds_requests_back(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    out = tmp_path / "out.jsonl"
    with SimThread("mixed", speed=20) as engine:
        rc = bench_main(["--trace", str(trace), "--base-url", engine.url, "--time-scale", "0.001",
                         "--concurrency", "1", "--output", str(out), "--no-progress"])
    assert rc == 0
    results = read_results(out.read_bytes().splitlines())
    assert all(r.ok for r in results)
    # One at a time: each is sent after the previous one ended.
    for before, after in zip(results, results[1:]):
        assert after.sent_s >= before.sent_s + before.e2e_s - 1e-3  # type: ignore[operator]


def test_errors_are_counted_not_fatal(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}) + "\n")
    out = tmp_path / "out.jsonl"
    with SimThread("mixed", speed=20, max_model_len=500) as engine:
        rc = bench_main(["--trace", str(trace), "--base-url", engine.url, "--output", str(out), "--no-progress"])
    assert rc == 0
    [r] = read_results(out.read_bytes().splitlines())
    assert not r.ok and r.status == 400 and "maximum context length" in (r.error or "")
    assert "(0 / 1)" in capsys.readouterr().out


def test_nothing_listening_is_an_error_per_request(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    out = tmp_path / "out.jsonl"
    rc = bench_main(["--trace", str(trace), "--base-url", "http://127.0.0.1:9", "--max-requests", "2",
                     "--time-scale", "0.01", "--output", str(out), "--no-progress"])
    assert rc == 0
    results = read_results(out.read_bytes().splitlines())
    assert [r.ok for r in results] == [False, False] and all("ConnectionRefused" in (r.error or "") for r in results)


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give --trace FILE or --generate"),
        (["--generate"], "exactly one of --base-url URL or --virtual"),
        (["--trace", "/nonexistent.jsonl", "--base-url", "http://127.0.0.1:9"], "cannot read trace"),
        (["--generate", "--base-url", "ftp://x"], "base URL must be"),
        (["--generate", "--turns", "0", "--base-url", "http://127.0.0.1:9"], "turns must be >= 1"),
        (["--plot", "x.png", "--results", "/nonexistent.jsonl"], "cannot read results"),
    ],
)
def test_bad_command_lines_exit_2_with_a_message(argv: list[str], message: str, capsys) -> None:
    assert bench_main(argv) == 2
    assert message in capsys.readouterr().err


def test_plot_of_several_result_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from tests.bench.test_bench_pure import result

    paths = []
    for name, ttft in (("fast", 0.1), ("slow", 0.4)):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(b"".join(result(i, sent=i * 0.1, ttft=ttft * (1 + i / 10), tokens=5, itl=0.01).to_json()
                                  + b"\n" for i in range(20)))
        paths.append(str(path))
    png = tmp_path / "cmp.png"
    assert bench_main(["--plot", str(png), "--results", *paths, "--slo-ttft-ms", "300"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path: Path, monkeypatch, capsys) -> None:
    import sys

    from tests.bench.test_bench_pure import result

    path = tmp_path / "run.jsonl"
    path.write_bytes(result(0, sent=0.0, ttft=0.1, tokens=3, itl=0.01).to_json() + b"\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert bench_main(["--plot", str(tmp_path / "x.png"), "--results", str(path)]) == 2
    assert "pip install 'narwhal[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "extra",
    [["--endpoint", "/v1/chat/completions"], ["--endpoint", "/v1/chat/completions", "--no-stream"], ["--token-ids"]],
)
def test_chat_whole_answers_and_token_ids(tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "out.jsonl"
    with SimThread("mixed", speed=20) as engine:
        rc = bench_main(["--generate", "--sessions", "3", "--turns", "2", "--session-rate", "20", "--think-s", "0.1",
                         "--output-tokens", "8", "--base-url", engine.url, "--no-progress", "--output", str(out),
                         *extra])
        seen = engine.requests()
    assert rc == 0
    results = read_results(out.read_bytes().splitlines())
    assert len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [r.output_length for r in results]
    if "--no-stream" in extra:
        assert all(r.ttft_s == r.e2e_s and set(r.itl_s) <= {0.0} for r in results)
    assert len(seen) == 6
