"""The SSE relay and answer merging of a batch of prompts (docs/operate.md, "Batch prompts").

narwhal_core.relay's SseRelay and narwhal_core.leg_bodies's merges: a batch
prompt's relay rewrites every choice's ``index`` to the prompt's and every
``id`` to the batch's first, holds the usage-only event back, drops
``[DONE]`` but the last prompt's, and sends the summed usage just before it
-- whatever way the engine's bytes are split into reads.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal_core.contract import COMPLETIONS
from narwhal_core.leg_bodies import merge_answers, merge_usage
from narwhal_core.relay import SseRelay

MODEL = "m"


def events(leg: int, pieces: int = 2, usage: bool = True) -> bytes:
    out = []
    for k in range(pieces):
        out.append({"id": f"cmpl-{leg}", "object": "text_completion", "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "text": f"p{leg}w{k}", "finish_reason": None}]})
    if usage:
        out.append({"id": f"cmpl-{leg}", "object": "text_completion", "created": 1, "model": MODEL, "choices": [],
                    "usage": {"prompt_tokens": 10 + leg, "completion_tokens": pieces, "total_tokens": 10 + leg + pieces,
                              "prompt_tokens_details": {"cached_tokens": 9}}})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in out) + b"data: [DONE]\n\n"


def relay_batch(streams: list[bytes], cuts: list[list[int]] | None = None) -> tuple[bytes, Any]:
    """Relay each prompt's stream through its own relay, as the router does; the client's bytes."""
    out = b""
    usage = None
    response_id = None
    for i, data in enumerate(streams):
        relay = SseRelay(COMPLETIONS, MODEL, True, 4)
        relay.batch(i, i == len(streams) - 1, usage, response_id)
        points = sorted(set(cuts[i])) if cuts else []
        start = 0
        for point in [*points, len(data)]:
            out += relay.feed(data[start:point])
            start = point
        assert relay.done
        usage, response_id = relay.usage, relay.response_id
    return out, usage


def payloads(body: bytes) -> list[Any]:
    data = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    return [d if d == b"[DONE]" else json.loads(d) for d in data]


def test_batch_relay_rewrites_indexes_and_ids_and_sends_one_done() -> None:
    body, usage = relay_batch([events(0), events(1), events(2)])
    got = payloads(body)
    assert got[-1] == b"[DONE]" and got.count(b"[DONE]") == 1
    texts = [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in got[:-1] if e["choices"]]
    assert texts == [(i, f"p{i}w{k}") for i in range(3) for k in range(2)]
    (summed,) = [e for e in got[:-1] if not e["choices"]]
    assert got[-2] is summed and {e["id"] for e in got[:-1]} == {"cmpl-0"}
    # Each prompt's cached_tokens is the prefill's figure (4): summed like every count.
    assert summed["usage"] == usage == {"prompt_tokens": 33, "completion_tokens": 6, "total_tokens": 39,
                                        "prompt_tokens_details": {"cached_tokens": 12}}


def test_batch_relay_without_usage_events_sends_none() -> None:
    body, usage = relay_batch([events(0, usage=False), events(1, usage=False)])
    got = payloads(body)
    assert usage is None and all(e == b"[DONE]" or e["choices"] for e in got)
    assert got.count(b"[DONE]") == 1


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_batch_relay_output_does_not_depend_on_read_boundaries(data: st.DataObject) -> None:
    streams = [events(i, pieces=data.draw(st.integers(0, 3))) for i in range(data.draw(st.integers(1, 4)))]
    cuts = [data.draw(st.lists(st.integers(0, len(s)), max_size=8)) for s in streams]
    whole, usage = relay_batch(streams)
    split, split_usage = relay_batch(streams, cuts)
    assert split == whole and split_usage == usage


def test_a_single_prompt_relay_is_unchanged() -> None:
    relay = SseRelay(COMPLETIONS, MODEL, False, None)
    data = events(0, usage=False)
    assert relay.feed(data) == data  # nothing to fix: the engine's bytes as they are


def test_merge_answers_sets_index_and_sums_usage() -> None:
    answers = [
        {"id": f"cmpl-{i}", "object": "text_completion", "created": i, "model": MODEL,
         "choices": [{"index": 0, "text": f"t{i}", "finish_reason": "length"}],
         "usage": {"prompt_tokens": 5, "completion_tokens": i, "total_tokens": 5 + i,
                   "prompt_tokens_details": None if i == 1 else {"cached_tokens": 2}}}
        for i in range(3)
    ]
    merged = merge_answers(answers)
    assert (merged["id"], merged["created"]) == ("cmpl-0", 0)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "t0"), (1, "t1"), (2, "t2")]
    # One prompt did not report cached_tokens: the sum is unknown.
    assert merged["usage"] == {"prompt_tokens": 15, "completion_tokens": 3, "total_tokens": 18,
                               "prompt_tokens_details": {"cached_tokens": None}}


def test_merge_usage_absent_sides() -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    assert merge_usage(None, usage) == usage and merge_usage(usage, None) == usage
    assert merge_usage(None, None) is None
    assert merge_usage(usage, usage) == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
