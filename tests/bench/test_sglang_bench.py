"""benchmarks/sglang_bench.py's pieces: the trace, the summary of a replay, the table, the skip of a protocol Narwhal lacks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sglang_bench  # noqa: E402


def test_the_trace_gives_every_request_its_own_blocks(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    sglang_bench.write_trace(path, requests=3, prompt_tokens=600, output_tokens=4, first_block=10)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["hash_ids"] for line in lines] == [[10, 11], [12, 13], [14, 15]]  # 600 tokens: two blocks each
    assert {(line["timestamp"], line["input_length"], line["output_length"]) for line in lines} == {(0, 600, 4)}


def test_a_replay_is_summarised_with_its_failures_and_the_requests_never_recorded(tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    rows = [{"index": i, "scheduled_s": 0.0, "ok": True, "ttft_s": 0.01 * (i + 1), "e2e_s": 0.1, "output_tokens": 4} for i in range(4)]
    rows.append({"index": 4, "scheduled_s": 0.0, "ok": False, "error": "HTTP 502"})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = sglang_bench.summarise(out, sent=6)
    assert (summary["sent"], summary["answered"], summary["errors"]) == (6, 4, 2)  # one failed, one never recorded
    assert summary["error_kinds"] == {"HTTP 502": 1}
    assert (summary["ttft_p50_ms"], summary["ttft_p90_ms"], summary["e2e_p50_ms"]) == (25.0, 37.0, 100.0)


def test_the_table_and_ratios_put_narwhal_beside_the_peer_of_its_scenario() -> None:
    figures = {"sent": 2, "answered": 2, "errors": 0, "ttft_p50_ms": 10.0, "ttft_p90_ms": 12.0, "e2e_p50_ms": 20.0,
               "idle_cpu_pct": 0.0, "rss_mib": 40.0, "pd_requests": 2, "leaked": 0}  # fmt: skip
    rows = [{"scenario": "push", "target": "vllm-router", **figures, "cpu_us_per_req": 200.0,
             "net_cpu_us_per_req": 200.0},
            {"scenario": "push", "target": "narwhal-trio", **figures, "cpu_us_per_req": 100.0,
             "net_cpu_us_per_req": 50.0, "ttft_p50_ms": 5.0},
            {"scenario": "sglang", "target": "narwhal-asyncio", "error": "skipped: no protocol"}]  # fmt: skip
    text = sglang_bench.table(rows)
    assert "| push | narwhal-trio | 2 / 2 | 0 | 5.0 |" in text and "skipped: no protocol" in text
    assert sglang_bench.ratios(rows) == {"push/narwhal-trio": {
        "cpu_per_req_vs_peer": 0.5, "net_cpu_per_req_vs_peer": 0.25, "ttft_p50_vs_peer": 0.5}}


def test_a_protocol_narwhal_does_not_drive_is_named_and_one_it_drives_is_not() -> None:
    assert sglang_bench.narwhal_protocol_missing("vllm-nixl-push") is None
    reason = sglang_bench.narwhal_protocol_missing("no-such-protocol")
    assert reason is not None and '"no-such-protocol"' in reason
