"""``[routing]`` end to end (docs/configure.md, ``[routing]``; docs/operate.md, "The journal"), on both runtimes.

Real sockets, the simulator as the fleet, the ``openai`` client as the
client. What an engine did is read from the simulators' own counters and
request records, not only from the journal: a ``single`` request must
reach no prefill engine and move no KV.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from narwhal_core.config import parse_config
from narwhal_sim.testing import SimThread

from ..harness import Fleet, RouterThread
from ..helpers import MODEL, completion_records, journal_terminal, read_journal

#: A prompt of about 5,000 tokens at 4 bytes a token: past disaggregate_min_uncached_tokens (512),
#: and ten blocks of the prefix index.
LONG = "The narwhal's tusk is a canine tooth with millions of nerve endings. " * 300
SHORT = "The narwhal"


def client_of(router: RouterThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10)


def prefill_legs(fleet: Fleet) -> list[dict[str, Any]]:
    return completion_records(fleet.prefill)


def routing_of(journal_path: Any, rid: str) -> dict[str, Any]:
    record = journal_terminal(journal_path, rid)
    assert record["terminal"] == "completed", record
    return record


# ------------------------------------------------------------------ mode


def test_mode_never_sends_no_prefill_leg_and_moves_no_kv(start_router, fleet, journal_path) -> None:
    router = start_router(routing={"policy": "least_loaded", "mode": "never"})
    (prefill,), (decode,) = fleet.prefill, fleet.decode
    with client_of(router) as client:
        whole = client.completions.create(model=MODEL, prompt=LONG, max_tokens=5)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": SHORT}], max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )
        streamed_rid = stream.response.headers["x-request-id"]
        chunks = list(stream)
    assert whole.choices[0].text and whole.usage is not None and whole.usage.completion_tokens == 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The engines' side: no prefill request at all, no KV held, pulled or released anywhere.
    assert prefill_legs(fleet) == []
    p, d = prefill.stats(), decode.stats()
    assert (p["completions"], p["kv_held_total"], p["kv_releases_sent"]) == (0, 0, 0), p
    assert (d["completions"], d["kv_pulls"], d["kv_held_total"]) == (2, 0, 0), d
    for leg in completion_records(fleet.decode):
        assert "kv_transfer_params" not in leg["body"], leg["body"]  # the client's request, whole
    for rid in (whole._request_id, streamed_rid):
        assert rid is not None
        record = routing_of(journal_path, rid)
        assert record["mode"] == "single"
        assert [(leg["phase"], leg["kv"]) for leg in record["legs"]] == [("decode", None)]
        assert record["routing"] == {
            "policy": "least_loaded", "mode": "single", "reason": "configured",
            "prefill": None, "decode": decode.url, "candidates": [],
        }
        progress = [r for r in read_journal(journal_path) if r["rid"] == rid and r["terminal"] is None]
        assert [r["mode"] for r in progress] == ["single"]


def test_mode_always_is_disaggregated_as_before(start_router, fleet, journal_path) -> None:
    router = start_router(routing={"policy": "least_loaded"})  # the routing before prefix became the default
    (prefill,), (decode,) = fleet.prefill, fleet.decode
    with client_of(router) as client:
        completion = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=3)
    assert completion._request_id is not None
    record = routing_of(journal_path, completion._request_id)
    assert record["mode"] == "pd"
    assert [leg["phase"] for leg in record["legs"]] == ["prefill", "decode"]
    assert record["legs"][0]["kv"]["outcome"] == "pulled"
    assert record["routing"] == {
        "policy": "least_loaded", "mode": "pd", "reason": "configured",
        "prefill": prefill.url, "decode": decode.url, "candidates": [],
    }
    assert prefill.stats()["kv_pulled"] == 1 and decode.stats()["kv_pulls"] == 1


def test_mode_auto_runs_short_prompts_whole_and_long_ones_disaggregated(start_router, fleet, journal_path) -> None:
    router = start_router(routing={"mode": "auto", "disaggregate_min_uncached_tokens": 512})
    (prefill,), (decode,) = fleet.prefill, fleet.decode
    with client_of(router) as client:
        short = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=3)
        long = client.completions.create(model=MODEL, prompt=LONG, max_tokens=3)
    assert short._request_id is not None and long._request_id is not None
    short_record = routing_of(journal_path, short._request_id)
    assert (short_record["mode"], short_record["routing"]["reason"]) == ("single", "short_prompt")
    assert [leg["phase"] for leg in short_record["legs"]] == ["decode"]
    (candidate,) = short_record["routing"]["candidates"]
    assert candidate["engine"] == prefill.url and 0 < candidate["uncached_tokens"] < 512
    assert candidate["queued_tokens"] == 0
    long_record = routing_of(journal_path, long._request_id)
    assert (long_record["mode"], long_record["routing"]["reason"]) == ("pd", "long_prompt")
    assert [leg["phase"] for leg in long_record["legs"]] == ["prefill", "decode"]
    assert long_record["routing"]["candidates"][0]["uncached_tokens"] >= len(LONG) // 4
    # One prefill (the long prompt's) reached the engines, and its KV was pulled.
    assert prefill.stats()["completions"] == 1 and decode.stats()["kv_pulls"] == 1


# ---------------------------------------------------------------- policy


@pytest.fixture
def two_prefills() -> Iterator[Fleet]:
    with SimThread(role="prefill", speed=0) as p1, SimThread(role="prefill", speed=0) as p2, SimThread(
        role="decode", speed=0
    ) as d:
        yield Fleet(prefill=[p1, p2], decode=[d])


@pytest.mark.parametrize(("policy", "spread"), [("round_robin", True), ("least_loaded", True), ("prefix", False)])
def test_the_policy_switch_changes_the_choice(
    start_router: Callable[..., RouterThread], two_prefills: Fleet, journal_path: Any, policy: str, spread: bool
) -> None:
    """The same prompt three times, one after another: blind policies take turns, ``prefix`` returns to its cache."""
    router = start_router(fleet_=two_prefills, routing={"policy": policy})
    with client_of(router) as client:
        rids = [
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": LONG}, {"role": "user", "content": "Why?"}],
                max_tokens=2,
            )._request_id
            for _ in range(3)
        ]
    records = [routing_of(journal_path, str(rid)) for rid in rids]
    chosen = [record["routing"]["prefill"] for record in records]
    counts = [p.stats()["completions"] for p in two_prefills.prefill]
    urls = [p.url for p in two_prefills.prefill]
    legs = [[(leg["phase"], leg["engine"], leg["outcome"], leg["status"]) for leg in r["legs"]] for r in records]
    if spread:
        assert chosen == [urls[0], urls[1], urls[0]] and counts == [2, 1], (chosen, counts, urls, legs)
    else:
        assert chosen == [chosen[0]] * 3 and sorted(counts) == [0, 3], (chosen, counts)
        # The engine it returned to had the prompt cached: the simulator's prefix cache says so.
        holder = two_prefills.prefill[urls.index(chosen[0])]
        assert holder.stats()["prefix_cache_hits"] > 0
        record = routing_of(journal_path, str(rids[-1]))
        first = record["routing"]["candidates"][0]
        assert first["engine"] == chosen[0] and first["uncached_tokens"] < len(LONG) // 4 // 2
    for rid in rids:
        assert routing_of(journal_path, str(rid))["routing"]["policy"] == policy


def test_a_config_without_routing_routes_by_prefix(runtime: str, two_prefills: Fleet, journal_path: Any) -> None:
    """Only ``[model]`` and ``[engine]`` (and where to listen and journal): ``prefix``, disaggregated.

    The same long prompt three times returns to the engine that cached it;
    ``policy = "least_loaded"``, one line away, takes turns instead
    (``test_the_policy_switch_changes_the_choice``).
    """
    toml = (
        f'[model]\nname = "{MODEL}"\n'
        f"[engine]\nprefill = {list(two_prefills.prefill_urls)!r}\ndecode = {list(two_prefills.decode_urls)!r}\n"
        '[ingress]\nlisten = "127.0.0.1:0"\n'
        f'[journal]\npath = "{journal_path}"\nfsync = "never"\n'
    ).replace("'", '"')
    config = parse_config(toml, env={})
    with RouterThread(config, runtime).start() as router, client_of(router) as client:
        rids = [client.completions.create(model=MODEL, prompt=LONG, max_tokens=2)._request_id for _ in range(3)]
    records = [routing_of(journal_path, str(rid))["routing"] for rid in rids]
    urls = [p.url for p in two_prefills.prefill]
    chosen = records[0]["prefill"]
    assert [r["prefill"] for r in records] == [chosen] * 3, records
    assert all((r["policy"], r["mode"], r["reason"]) == ("prefix", "pd", "configured") for r in records), records
    # Both engines weighed each time; by the last request the chosen one holds the prompt.
    assert all(sorted(c["engine"] for c in r["candidates"]) == sorted(urls) for r in records), records
    last = records[-1]["candidates"][0]
    assert last["engine"] == chosen and last["uncached_tokens"] < len(LONG) // 4 // 2, records[-1]
    # The engines' own counters: every prefill on the holder, and it served the repeats from its cache.
    holder = two_prefills.prefill[urls.index(chosen)]
    assert sorted(p.stats()["completions"] for p in two_prefills.prefill) == [0, 3]
    assert holder.stats()["prefix_cache_hits"] > 0
