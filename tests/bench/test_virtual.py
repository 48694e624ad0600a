"""The virtual fleet: the router core and modelled engines on one virtual clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal_bench.cli import main as bench_main
from narwhal_bench.client import Target
from narwhal_bench.stats import read_results
from narwhal_bench.trace import PromptSynth, TraceRequest, parse_mooncake_lines
from narwhal_bench.virtual import FleetError, VirtualFleet, parse_fleet, run_virtual
from narwhal_sim.engine import StepConfig
from narwhal_sim.model import Prompt

pytestmark = pytest.mark.timeout(120)

TARGET = Target(base_url="http://virtual")


def req(index: int, at: float, n_in: int, n_out: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index=index, arrival_s=at, input_length=n_in, output_length=n_out, hash_ids=ids)


def test_fleet_specs() -> None:
    assert parse_fleet("4P2D") == parse_fleet("4p2d")
    assert (parse_fleet("4P2D").prefill, parse_fleet("4P2D").decode) == (4, 2)
    assert parse_fleet("2M").mixed == 2
    for bad in ("", "4P", "P2D", "4X2D", "4P2D!"):
        with pytest.raises(FleetError):
            parse_fleet(bad)


def test_a_plain_request_takes_exactly_the_modelled_steps() -> None:
    # One mixed engine, whole requests: a 1,000-token prefill step, then one decode step per token.
    step = StepConfig()
    [r] = run_virtual([req(0, 0.5, 1000, 5, (1, 2))], TARGET, synth=PromptSynth(), fleet="1M").results
    assert r.ok and r.sent_s == 0.5 and r.output_tokens == 5
    assert r.ttft_s == pytest.approx(step.step_s(1000, 0))
    assert r.itl_s == pytest.approx([step.step_s(0, 1)] * 4)
    assert r.e2e_s == pytest.approx(step.step_s(1000, 0) + 4 * step.step_s(0, 1))
    assert r.cached_tokens == 0


def test_a_pd_request_adds_the_kv_transfer_and_one_decode_step() -> None:
    step = StepConfig()
    outcome = run_virtual([req(0, 0.0, 1000, 3, (1, 2))], TARGET, synth=PromptSynth(), fleet="1P1D")
    [r] = outcome.results
    blocks = step.blocks_for(1000)
    assert r.ttft_s == pytest.approx(step.step_s(1000, 0) + step.transfer_s(blocks) + step.step_s(0, 1))
    assert r.itl_s == pytest.approx([step.step_s(0, 1)] * 2)
    prefill = next(e for e in outcome.engines.values() if e["role"] == "prefill")
    assert (prefill["pulls"], prefill["released"], prefill["expired"]) == (1, 0, 0)


def test_shared_prefixes_hit_the_cache_and_load_queues() -> None:
    step = StepConfig()
    first = req(0, 0.0, 2048, 2, (1, 2, 3, 4))
    again = req(1, 1.0, 2048, 2, (1, 2, 3, 9))  # 3 of 4 blocks shared
    outcome = run_virtual([first, again], TARGET, synth=PromptSynth(), fleet="1M")
    a, b = outcome.results
    assert a.cached_tokens == 0 and b.cached_tokens == 1536
    assert b.ttft_s == pytest.approx(step.step_s(2048 - 1536, 0))
    assert outcome.hit_rate.rate == pytest.approx(1536 / 4096)
    # Two long prompts at once on one engine: the second waits for budget (chunked prefill).
    both = run_virtual([req(0, 0.0, 8000, 2, tuple(range(16))), req(1, 0.0, 8000, 2, tuple(range(100, 116)))],
                       TARGET, synth=PromptSynth(), fleet="1M").results
    assert both[1].ttft_s > both[0].ttft_s >= step.step_s(8000, 0) - 1e-9


def test_virtual_keys_hit_exactly_where_the_simulator_hashes_do() -> None:
    fleet = VirtualFleet(fleet="1M")
    synth = PromptSynth()
    a = synth.prompt(req(0, 0, 1500, 1, (1, 2, 3)))
    b = synth.prompt(req(0, 0, 1300, 1, (1, 2, 7)))
    assert isinstance(a, str) and isinstance(b, str)
    pa, pb = Prompt(text=a), Prompt(text=b)
    va, vb = fleet.prompt_hashes(pa), fleet.prompt_hashes(pb)
    sa, sb = pa.block_hashes(16), pb.block_hashes(16)
    assert len(va) == len(sa) and len(vb) == len(sb)
    assert [x == y for x, y in zip(va, vb)] == [x == y for x, y in zip(sa, sb)]
    ids = PromptSynth(token_ids=True).prompt(req(0, 0, 700, 1, (1, 2)))
    assert len(fleet.prompt_hashes(Prompt(token_ids=ids))) == len(Prompt(token_ids=ids).block_hashes(16)) == 43


def test_a_generated_workload_replays_deterministically() -> None:
    from narwhal_bench.trace import SessionWorkload, generate_sessions

    requests = generate_sessions(SessionWorkload(sessions=12, turns=3, session_rate=4, think_s=1, output_tokens=16))
    one = run_virtual(requests, TARGET, synth=PromptSynth(), fleet="2P1D")
    two = run_virtual(requests, TARGET, synth=PromptSynth(), fleet="2P1D")
    assert all(r.ok for r in one.results)
    assert [r.output_tokens for r in one.results] == [r.output_length for r in requests]
    assert [(r.ttft_s, r.e2e_s) for r in one.results] == [(r.ttft_s, r.e2e_s) for r in two.results]
    assert one.hit_rate.rate is not None and one.hit_rate.rate > 0.3  # histories and system prompts are reused
    assert sum(e["pulls"] for e in one.engines.values()) == len(requests)


def test_concurrency_cap_in_virtual_time() -> None:
    requests = [req(i, 0.0, 500, 3, (i,)) for i in range(4)]
    results = run_virtual(requests, TARGET, synth=PromptSynth(), fleet="1M", concurrency=1).results
    for before, after in zip(results, results[1:]):
        assert after.sent_s == pytest.approx(before.sent_s + before.e2e_s)  # type: ignore[operator]


def test_bad_requests_become_errors_not_crashes() -> None:
    # Longer than the engines' max_model_len: 400 from the engine, relayed by the router.
    outcome = run_virtual([req(0, 0.0, 600, 2, (1, 2)), req(1, 0.1, 100, 2, (5,))], TARGET, synth=PromptSynth(),
                          fleet="1P1D", engine_options=["max_model_len=500"])
    bad, good = outcome.results
    assert not bad.ok and bad.status == 400 and "maximum context length" in (bad.error or "")
    assert good.ok


def test_cli_virtual_run_and_its_errors(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 900, "output_length": 4,
                                         "hash_ids": [1, 2]}) + "\n" for i in range(6)))
    out = tmp_path / "out.jsonl"
    summary = tmp_path / "s.json"
    assert bench_main(["--trace", str(trace), "--virtual", "--fleet", "1P1D", "--output", str(out),
                       "--summary-json", str(summary), "--engine-option", "prefill_per_token_ms=0.2"]) == 0
    text = capsys.readouterr().out
    assert "virtual 1P1D" in text and "trace s per wall s" in text
    assert len(read_results(out.read_bytes().splitlines())) == 6
    data = json.loads(summary.read_text())
    assert data["completed"] == 6 and data["virtual_seconds"] > 0.5 and data["prefix_hit_rate"] > 0.4
    assert bench_main(["--trace", str(trace), "--virtual", "--fleet", "9Q"]) == 2
    assert "fleet must look like" in capsys.readouterr().err
    assert bench_main(["--trace", str(trace), "--virtual", "--engine-option", "nope=1"]) == 2
    assert "engine option must be NAME=VALUE" in capsys.readouterr().err
    assert bench_main(["--trace", str(trace), "--virtual", "--engine-option", "step_base_ms=x"]) == 2
    assert "is not a float" in capsys.readouterr().err


def test_run_relay_measures_what_token_relay_measures() -> None:
    """Handing a run of decode steps to the router in one read changes no figure a client measures."""
    from narwhal_bench.trace import SessionWorkload, generate_sessions

    requests = generate_sessions(SessionWorkload(sessions=16, turns=3, session_rate=6, think_s=0.5,
                                                 output_tokens=40, system_tokens=3000))
    by_run = run_virtual(requests, TARGET, synth=PromptSynth(), fleet="2P1D", relay="run")
    by_token = run_virtual(requests, TARGET, synth=PromptSynth(), fleet="2P1D", relay="token")
    assert all(r.ok for r in by_run.results) and all(r.ok for r in by_token.results)
    for a, b in zip(by_run.results, by_token.results):
        assert a.output_tokens == b.output_tokens == a.output_length
        assert a.ttft_s == pytest.approx(b.ttft_s, abs=1e-9)
        assert a.e2e_s == pytest.approx(b.e2e_s, abs=1e-9)
        assert a.itl_s == pytest.approx(b.itl_s, abs=1e-9)
    assert by_run.hit_rate == by_token.hit_rate
    # The same engine steps, but runs reached the router in far fewer reads.
    assert sum(e["steps"] for e in by_run.engines.values()) == sum(e["steps"] for e in by_token.engines.values())
    assert by_run.leg_reads < by_token.leg_reads / 2, (by_run.leg_reads, by_token.leg_reads)
