"""The pure engine model: no sockets, time passed in by hand."""

from __future__ import annotations

import pytest

from narwhal_sim.model import (
    Faults,
    FaultsError,
    KvLedger,
    Prompt,
    PromptError,
    fault_draw,
    generate_tokens,
    owner_key,
)


def test_token_count_approximation() -> None:
    assert Prompt(text="").num_tokens == 1
    assert Prompt(text="abcd").num_tokens == 1
    assert Prompt(text="abcde").num_tokens == 2
    assert Prompt(text="x" * 400).num_tokens == 100
    assert Prompt(token_ids=[1, 2, 3]).num_tokens == 3
    assert Prompt.from_completion([5, 6, 7, 8]).num_tokens == 4
    assert Prompt.from_completion(["only one"]).text == "only one"
    with pytest.raises(PromptError):
        Prompt.from_completion(["two", "prompts"])
    with pytest.raises(PromptError):
        Prompt.from_completion(7)


def test_chat_prompt_renders_messages_and_tools() -> None:
    plain = Prompt.from_chat([{"role": "user", "content": "hi"}])
    with_tools = Prompt.from_chat([{"role": "user", "content": "hi"}], [{"type": "function"}])
    parts = Prompt.from_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert plain.digest == parts.digest
    assert with_tools.num_tokens > plain.num_tokens
    with pytest.raises(PromptError):
        Prompt.from_chat([1, 2])


def test_block_keys_are_chained_full_blocks() -> None:
    a = Prompt(text="a" * 64 + "b" * 64 + "c" * 10)
    b = Prompt(text="a" * 64 + "z" * 64)
    assert len(a.block_keys(16)) == 2
    assert a.block_keys(16)[0] == b.block_keys(16)[0]
    assert a.block_keys(16)[1] != b.block_keys(16)[1]
    assert len(Prompt(token_ids=list(range(40))).block_keys(16)) == 2


def test_text_is_deterministic_from_seed_and_prompt() -> None:
    digest = Prompt(text="hello").digest
    assert generate_tokens(0, digest, 8) == generate_tokens(0, digest, 8)
    assert generate_tokens(0, digest, 8) != generate_tokens(1, digest, 8)
    assert generate_tokens(0, digest, 8) != generate_tokens(0, Prompt(text="other").digest, 8)
    # A prefill engine's one token is the decode engine's first token.
    assert generate_tokens(3, digest, 1) == generate_tokens(3, digest, 16)[:1]
    assert all(t.startswith(" ") for t in generate_tokens(0, digest, 5))
    assert not generate_tokens(0, digest, 5, chat=True)[0].startswith(" ")


def test_owner_key_is_request_id_plus_suffix() -> None:
    key = owner_key(0, "rid-p1", 1)
    assert key.startswith("rid-p1-") and len(key) == len("rid-p1-") + 8
    assert key == owner_key(0, "rid-p1", 1)
    assert key != owner_key(0, "rid-p1", 2)
    assert key != owner_key(1, "rid-p1", 1)


def test_ledger_outcomes_and_counters() -> None:
    ledger = KvLedger(lease_s=30.0)
    ledger.hold("a", [1, 2], now=0.0, prompt_tokens=20, prompt_digest="d")
    ledger.hold("b", [3], now=1.0, prompt_tokens=5, prompt_digest="d")
    ledger.hold("c", [4], now=2.0, prompt_tokens=5, prompt_digest="d")
    assert ledger.held_blocks == 4
    assert ledger.pull("a") is not None
    assert ledger.pull("a") is None
    assert ledger.release("b") is not None
    assert ledger.release("unknown") is None
    assert ledger.next_deadline() == 32.0
    assert ledger.expire_due(31.9) == []
    expired = ledger.expire_due(32.0)
    assert [e.owner for e in expired] == ["c"] and expired[0].outcome == "expired"
    assert ledger.counts == {"held": 3, "pulled": 1, "released": 1, "expired": 1}
    assert ledger.block_counts == {"held": 4, "pulled": 2, "released": 1, "expired": 1}
    assert ledger.held_blocks == 0 and len(ledger) == 0
    with pytest.raises(ValueError):
        ledger.hold("d", [], now=0.0, prompt_tokens=1, prompt_digest="d")
        ledger.hold("d", [], now=0.0, prompt_tokens=1, prompt_digest="d")


def test_a_renewal_extends_to_two_thirds_of_a_lease_in_place() -> None:
    # vLLM's _handle_heartbeat: expiry = max(old, now + kv_lease_duration * 2 // 3), position kept.
    ledger = KvLedger(lease_s=30.0)
    ledger.hold("a", [1], now=0.0, prompt_tokens=5, prompt_digest="d")
    assert ledger.renew("a", now=5.0) and ledger.get("a").expires_at == 30.0  # type: ignore[union-attr]
    assert ledger.renew("a", now=15.0) and ledger.get("a").expires_at == 35.0  # type: ignore[union-attr]
    assert not ledger.renew("unknown", now=15.0)


def test_the_lease_era_reaper_stops_at_the_first_live_entry() -> None:
    """vLLM issue 58222: an entry behind a renewed one is not freed; a full scan frees it."""
    for stops, due_at_40 in ((True, []), (False, ["b"])):
        ledger = KvLedger(lease_s=30.0, reaper_stops_at_first_live=stops)
        ledger.hold("a", [1], now=0.0, prompt_tokens=5, prompt_digest="d")
        ledger.hold("b", [2], now=1.0, prompt_tokens=5, prompt_digest="d")
        ledger.renew("a", now=25.0)  # a: 45.0, still first
        assert [e.owner for e in ledger.expire_due(40.0)] == due_at_40
        assert ledger.next_deadline() == (45.0 if stops else 45.0)
        if stops:
            assert len(ledger) == 2 and ledger.get("b").expires_at == 31.0  # type: ignore[union-attr]
            ledger.pull("a")
            assert [e.owner for e in ledger.expire_due(40.0)] == ["b"]


def test_an_expired_entry_stays_readable_by_a_late_pull() -> None:
    ledger = KvLedger(lease_s=1.0)
    ledger.hold("a", [7, 8], now=0.0, prompt_tokens=20, prompt_digest="d")
    ledger.expire_due(2.0)
    assert ledger.get("a") is None and ledger.held_blocks == 0
    assert ledger.expired_entry("a") is not None and ledger.find_blocks([7, 8], expired=True) is not None
    assert ledger.find_blocks([7, 8]) is None


def test_fault_decisions_are_pure_functions_of_seed_rid_and_name() -> None:
    faults = Faults(error_rate=0.5)
    plans = [faults.plan(7, f"rid-{i}") for i in range(200)]
    assert plans == [faults.plan(7, f"rid-{i}") for i in range(200)]
    fired = [p.error_status is not None for p in plans]
    assert fired == [fault_draw(7, f"rid-{i}", "error") < 0.5 for i in range(200)]
    assert 60 < sum(fired) < 140
    assert fired != [faults.plan(8, f"rid-{i}").error_status is not None for i in range(200)]
    assert not Faults().active and faults.active
    always = Faults(drop_rate=1.0, stall_after_chunks=2).plan(0, "x")
    assert always.drop and always.stall_after == 2


def test_faults_from_json_is_strict() -> None:
    assert Faults.from_json({"error_rate": 1, "error_status": 500}).error_rate == 1.0
    assert Faults.from_json({}) == Faults()
    for bad in ({"nope": 1}, {"error_rate": 2}, {"error_rate": True}, {"error_status": 200},
                {"stall_after_chunks": -1}, {"unhealthy": 1}, [1]):  # fmt: skip
        with pytest.raises(FaultsError):
            Faults.from_json(bad)
    assert Faults.from_json(Faults(unhealthy=True).to_json()) == Faults(unhealthy=True)
