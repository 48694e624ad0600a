"""The KV-event routing benchmark's pieces that must be right for its figures to mean anything.

``benchmarks/kv_routing_bench.py`` re-encodes the simulator's events in the
layout vLLM Router reads (maps tagged by ``"type"``), and builds the tokenizer
both the engines and Narwhal load: four characters of the trace's text to a
token, never the unknown token.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack  # type: ignore[import-untyped]
import pytest

from narwhal_bench.trace import PromptSynth, TraceRequest
from narwhal_core.kv_events import decode_batch
from narwhal_sim.engine import AllBlocksCleared, BlockRemoved, BlockStored
from narwhal_sim.kv_events import encode_batch

from . import load_benchmark

kv_routing_bench = load_benchmark("kv_routing_bench", with_siblings=True)


def test_events_re_encoded_as_tagged_maps_carry_the_same_blocks() -> None:
    events = [
        BlockStored(block_hashes=(11, 12), parent_block_hash=None, token_ids=tuple(range(32)), block_size=16),
        BlockStored(block_hashes=(13,), parent_block_hash=12, token_ids=tuple(range(32, 48)), block_size=16),
        BlockRemoved(block_hashes=(11,)),
        AllBlocksCleared(),
    ]
    payload = encode_batch(events, ts=12.5)
    ts, original = decode_batch(payload)
    batch = msgpack.unpackb(kv_routing_bench.as_maps(payload), raw=False)
    assert batch[0] == ts == 12.5 and batch[2:] == [0]
    stored, child, removed, cleared = batch[1]
    assert [e["type"] for e in batch[1]] == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert stored == {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                      "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
                      "lora_name": None}  # fmt: skip
    assert child["parent_block_hash"] == original[1].parent_block_hash == 12
    assert removed == {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}
    assert cleared == {"type": "AllBlocksCleared"}


def test_the_tokenizer_cuts_trace_text_four_characters_to_a_token(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    directory = kv_routing_bench.build_tokenizer(tmp_path / "tok")
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    synth = PromptSynth()
    a = TraceRequest(index=0, arrival_s=0.0, input_length=2000, output_length=1, hash_ids=(7, 8, 9, 10))
    b = TraceRequest(index=1, arrival_s=0.0, input_length=2000, output_length=1, hash_ids=(7, 8, 11, 12))
    ids_a, ids_b = (tok.encode(synth.prompt(r)).ids for r in (a, b))
    assert 0 not in ids_a and 0 not in ids_b  # never the unknown token
    assert 2000 <= len(ids_a) <= 2000 * 1.02  # the trace's count, plus each block head's few extra tokens
    # the prompts share their first two blocks' text (1,024 trace tokens), and their ids that far and
    # through the next block head's common "[", "bloc", "k " (then its number differs)
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    head = tok.encode(synth.prompt(TraceRequest(index=2, arrival_s=0.0, input_length=1024, output_length=1,
                                                hash_ids=(7, 8)))).ids  # fmt: skip
    assert ids_a[: len(head)] == head and shared == len(head) + 3


def test_the_two_worker_targets_are_the_one_process_ones_with_two_workers(tmp_path: Path) -> None:
    import argparse

    import routing_bench

    kv_routing_bench.register_targets(argparse.Namespace(kv_port=5557), tmp_path / "tok")
    configs = routing_bench.NARWHAL_FLEET_CONFIGS
    assert configs["narwhal-kv-w2"](None) == {**configs["narwhal-kv"](None), "ingress": {"workers": 2}}
    assert configs["narwhal-prefix-w2"](None) == {**routing_bench.NARWHAL_CONFIGS["narwhal-prefix"],
                                                  "ingress": {"workers": 2}}  # fmt: skip
    assert configs["narwhal-kv"](None)["routing"]["policy"] == "kv"


def test_the_workers_journals_are_added_up() -> None:
    w0 = {"decided_by": {"kv": 3, "approximate": 1}, "matched_tokens": 100}
    w1 = {"decided_by": {"kv": 2}, "matched_tokens": 50}
    assert kv_routing_bench.merged([w0, w1]) == {"decided_by": {"kv": 5, "approximate": 1}, "matched_tokens": 150}


def test_router_cpu_counts_the_workers_of_a_supervisor() -> None:
    # A parent that starts a child burning CPU: the tree's CPU is the parent's plus the child's.
    import subprocess
    import time

    import router_bench

    code = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'while True: pass']); "
            "sys.stdin.read(); c.kill()")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while router_bench.tree_cpu_seconds(parent.pid) - router_bench.cpu_seconds(parent.pid) < 0.2:
            assert time.monotonic() < deadline, "the child's CPU never showed in the tree's"
            time.sleep(0.02)
    finally:
        assert parent.stdin is not None
        parent.stdin.close()
        parent.wait(10)


def test_the_two_worker_rows_get_their_own_verdict_line() -> None:
    def row(target: str, p90: float, goodput: float, hits: float) -> dict[str, object]:
        return {"target": target, "pressure": "high", "ttft_ms": {"p90": p90}, "goodput": goodput,
                "hit_over_bound": hits}  # fmt: skip

    text = kv_routing_bench.verdicts([row("narwhal-kv-w2", 900.0, 1.1, 0.8),
                                      row("narwhal-prefix-w2", 1000.0, 1.0, 0.5)], ["high"])  # fmt: skip
    assert "two workers: TTFT p90 kv / prefix 900 / 1000 ms = 0.90x, goodput 1.100 / 1.000 = 1.10x" in text
    assert "hit / bound 0.80 / 0.50" in text
