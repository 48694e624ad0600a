"""Tokenizing a large prompt off the event loop (docs/routing.md, "Tokenizing off the event loop").

Under ``routing.policy = "kv"`` a prompt larger than
``routing.tokenize_inline_max_bytes`` is not tokenized inside
``Router.receive``: admission emits ``TokenizePrompt`` and the request waits
in ``TOKENIZING`` until the runtime feeds ``PromptTokenized``; its plan is
then computed from the ids given. The driver holds each ``TokenizePrompt``
(``auto_tokenize=False``) so a test decides when, and with what, it is answered.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from narwhal_core import PromptTokenized, TokenizePrompt
from narwhal_core.config import Config, EngineConfig, ModelConfig, RoutingConfig
from narwhal_core.events import KvEventsReceived, KvStreamChanged
from narwhal_core.lifecycle import TRANSITIONS
from narwhal_core.states import Input, State

from .router_driver import CHAT, COMPLETIONS, PREFILL_URLS, Driver, chat_body, completion_body, make_config
from .test_kv_policy import BLOCK, LONG, OTHER, CharTokenizer, HeadTokenizer, kv_allowed, stored

#: A prompt well under the default bound (1024 bytes) with its body.
SHORT = "The narwhal's tusk is a tooth."


def offloop_driver(*, tokenizer: Any = None, **routing: Any) -> Driver:
    """Policy ``kv`` through the router, every TokenizePrompt held for the test to answer."""
    model = {"tokenizer": "tokenizer.json"} if "tokenizer" in attrs.fields_dict(ModelConfig) else {}
    engine = {"kv_events": "tcp://{host}:5557"} if "kv_events" in attrs.fields_dict(EngineConfig) else {}
    with kv_allowed():
        config: Config = make_config(routing={"policy": "kv", **routing}, model=model, engine=engine)
    return Driver(config, tokenizer=tokenizer or CharTokenizer(), auto_tokenize=False)


def held_by_last_engine(d: Driver) -> str:
    """Every stream live; the last prefill engine's events say it holds LONG."""
    holder = PREFILL_URLS[-1]
    for url in PREFILL_URLS:
        d.feed(KvStreamChanged(url, True, "connected"))
    d.feed(KvEventsReceived(holder, (stored(LONG),)))
    return holder


def test_the_default_bound_is_about_a_kilobyte_and_may_be_0() -> None:
    assert RoutingConfig().tokenize_inline_max_bytes == 1024
    assert RoutingConfig(tokenize_inline_max_bytes=0).tokenize_inline_max_bytes == 0
    with pytest.raises(Exception, match="tokenize_inline_max_bytes"):
        RoutingConfig(tokenize_inline_max_bytes=-1)


def test_the_table_has_a_tokenizing_state_that_ends_like_any_other_wait() -> None:
    handler, allowed = TRANSITIONS[(State.TOKENIZING, Input.TOKENIZED)]
    assert handler.__name__ == "tokenized"
    assert State.TOKENIZING not in allowed  # the ids are here: the first leg starts (or waits for a slot)
    assert State.TOKENIZING in TRANSITIONS[(State.QUEUED, Input.ADMIT)][1]
    assert State.TOKENIZING in TRANSITIONS[(State.DECODE, Input.LEG_OK)][1]  # a batch's next prompt
    for event, name in ((Input.CLIENT_GONE, "cancel"), (Input.DEADLINE, "expire"), (Input.ABANDON, "abandon")):
        assert TRANSITIONS[(State.TOKENIZING, event)][0].__name__ == name
    assert {key for key in TRANSITIONS if key[0] is State.TOKENIZING} == {
        (State.TOKENIZING, i) for i in (Input.TOKENIZED, Input.CLIENT_GONE, Input.DEADLINE, Input.ABANDON)
    }


def test_a_large_prompt_waits_for_its_ids_then_routes_by_them() -> None:
    tokenizer = CharTokenizer()
    d = offloop_driver(tokenizer=tokenizer)
    holder = held_by_last_engine(d)
    body = completion_body(LONG)
    client = d.post(COMPLETIONS, body)
    (req,) = d.router.requests.active.values()
    assert req.state is State.TOKENIZING and tokenizer.calls == 0  # nothing tokenized on the loop
    (cmd,) = d.tokenize_asked
    assert cmd == TokenizePrompt(f"{req.rid}:0", body, False)
    assert not d.leg_history and not d.records(req.rid)  # no leg, no progress record: no plan yet
    d.complete_tokenize(cmd.key, [ord(c) for c in LONG])
    assert req.state is State.PREFILL and d.leg("prefill").engine.url == holder
    assert [r["event"] for r in d.records(req.rid)] == ["admitted"]
    d.serve_until_done()
    assert client.last.status == 200
    routing = d.terminal(req.rid)["routing"]
    assert routing["index"] == "kv" and routing["prefill"] == holder
    assert routing["candidates"][0]["matched_tokens"] == len(LONG) // BLOCK * BLOCK
    assert tokenizer.calls == 0
    d.check_invariants(final=True)


def test_the_plan_uses_the_ids_given_not_the_tokenizer() -> None:
    d = offloop_driver()
    holder = held_by_last_engine(d)
    d.post(COMPLETIONS, completion_body(LONG))
    (cmd,) = d.tokenize_asked
    d.complete_tokenize(cmd.key, [ord(c) for c in "x" * len(LONG)])  # ids no engine holds
    d.serve_until_done()
    (record,) = d.terminals()
    assert record["routing"]["prefill"] != holder
    assert all(c["matched_tokens"] == 0 and c["index"] == "kv" for c in record["routing"]["candidates"])


def test_a_small_prompt_is_tokenized_inline() -> None:
    tokenizer = CharTokenizer()
    d = offloop_driver(tokenizer=tokenizer)
    d.post(COMPLETIONS, completion_body(SHORT))
    assert not d.tokenize_asked and tokenizer.calls == 1
    assert d.leg("prefill")
    d.serve_until_done()
    assert d.terminals()[0]["terminal"] == "completed"


@pytest.mark.parametrize(("bound", "off_loop"), [(0, True), (10**9, False)])
def test_the_bound_decides(bound: int, off_loop: bool) -> None:
    d = offloop_driver(tokenize_inline_max_bytes=bound)
    d.post(COMPLETIONS, completion_body(SHORT if off_loop else LONG))
    assert bool(d.tokenize_asked) is off_loop
    assert bool(d.leg_history) is not off_loop


@pytest.mark.parametrize("policy", ["least_loaded", "prefix"])
def test_policies_without_a_tokenizer_never_ask(policy: str) -> None:
    d = Driver(routing={"policy": policy, "tokenize_inline_max_bytes": 0}, auto_tokenize=False)
    d.post(COMPLETIONS, completion_body(LONG))
    assert not d.tokenize_asked and d.leg("prefill")


def test_a_chat_request_is_asked_as_chat() -> None:
    d = offloop_driver()
    held_by_last_engine(d)
    body = chat_body(LONG)
    d.post(CHAT, body)
    (cmd,) = d.tokenize_asked
    assert cmd.chat is True and cmd.body == body
    d.complete_tokenize(cmd.key)
    d.serve_until_done()
    assert d.terminals()[0]["routing"]["index"] == "kv"


def test_a_problem_weighs_the_request_from_the_approximate_index() -> None:
    d = offloop_driver()
    held_by_last_engine(d)
    client = d.post(COMPLETIONS, completion_body(LONG))
    (cmd,) = d.tokenize_asked
    d.complete_tokenize(cmd.key, problem="PromptNotTokenizable: no template")
    d.serve_until_done()
    assert client.last.status == 200
    routing = d.terminals()[0]["routing"]
    assert routing["index"] == "approximate"
    assert {c["index"] for c in routing["candidates"]} == {"approximate"}


def test_the_client_leaving_while_tokenizing_ends_the_request_and_the_late_ids_are_ignored() -> None:
    d = offloop_driver()
    client = d.post(COMPLETIONS, completion_body(LONG))
    (cmd,) = d.tokenize_asked
    rid = cmd.key.partition(":")[0]
    client.leave()
    record = d.terminal(rid)
    assert record["terminal"] == "cancelled" and record["status"] == 499 and record["legs"] == []
    assert record["routing"] is None
    assert d.router.statistics().inflight == 0
    d.complete_tokenize(cmd.key)  # the worker finishes after all
    assert not d.leg_history and len(d.terminals()) == 1
    d.check_invariants(final=True)


def test_the_deadline_passing_while_tokenizing_answers_504() -> None:
    d = offloop_driver()
    client = d.post(COMPLETIONS, completion_body(LONG))
    (cmd,) = d.tokenize_asked
    d.advance(d.config.admission.request_timeout_s)
    assert client.last.status == 504
    assert d.terminals()[0]["error"]["code"] == "request_timeout"
    d.complete_tokenize(cmd.key)
    assert not d.leg_history
    d.check_invariants(final=True)


def test_shutdown_waits_for_the_ids_then_abandons_at_the_grace_end() -> None:
    d = offloop_driver()
    first = d.post(COMPLETIONS, completion_body(LONG))
    second = d.post(COMPLETIONS, completion_body(LONG + "!"))
    one, two = d.tokenize_asked
    d.shutdown()
    d.complete_tokenize(one.key)  # a request admitted before the drain goes on
    d.serve_until_done()
    assert first.last.status == 200 and not d.shutdown_complete
    d.advance(d.config.shutdown.grace_s)
    assert second.last.status == 503 and second.last.json()["error"]["code"] == "shutting_down"
    assert d.shutdown_complete
    d.complete_tokenize(two.key)  # too late: ignored
    assert len(d.started_legs()) == 2  # the first request's legs only
    d.check_invariants(final=True)


def test_a_late_answer_for_another_key_is_ignored() -> None:
    d = offloop_driver()
    d.post(COMPLETIONS, completion_body(LONG))
    (cmd,) = d.tokenize_asked
    rid = cmd.key.partition(":")[0]
    d.feed(PromptTokenized(f"{rid}:7", (1, 2, 3), None))
    d.feed(PromptTokenized("nobody:0", (1, 2, 3), None))
    assert d.router.requests.active[rid].state is State.TOKENIZING and not d.leg_history
    d.complete_tokenize(cmd.key)
    assert d.leg("prefill")


def test_batch_prompts_are_tokenized_one_by_one_off_the_loop_when_large() -> None:
    tokenizer = CharTokenizer()
    d = offloop_driver(tokenizer=tokenizer)
    holder = held_by_last_engine(d)
    prompts = [LONG, SHORT, "Q: " + LONG]
    client = d.post(COMPLETIONS, completion_body(prompts))
    (first,) = d.tokenize_asked
    rid = first.key.partition(":")[0]
    assert first.key == f"{rid}:0" and first.body["prompt"] == LONG
    d.complete_tokenize(first.key)
    assert d.leg("prefill").engine.url == holder
    d.serve(d.leg("prefill").bid)
    d.serve(d.leg("decode").bid)
    # The second prompt is small: tokenized inline, its legs start at once.
    assert len(d.tokenize_asked) == 1 and tokenizer.calls == 2
    d.serve(d.leg("prefill").bid)
    d.serve(d.leg("decode").bid)
    third = d.tokenize_asked[-1]
    assert third.key == f"{rid}:2" and third.body["prompt"] == "Q: " + LONG
    assert d.router.requests.active[rid].state is State.TOKENIZING and not d.open_legs()
    d.complete_tokenize(third.key)
    d.serve_until_done()
    assert client.last.status == 200 and len(client.last.json()["choices"]) == 3
    assert [leg["prompt"] for leg in d.terminal(rid)["legs"] if leg["phase"] == "prefill"] == [0, 1, 2]
    d.check_invariants(final=True)


def test_a_head_look_goes_to_its_own_prompt_plan_at_admission_and_for_a_batch_next_prompt() -> None:
    # (docs/routing.md, "Tokenizing only what can hit".) Two large prompts of one batch, each held nowhere
    # whole: each is weighed from what its own head look found, with no TokenizePrompt and no whole-prompt ids.
    tokenizer = HeadTokenizer()
    d = offloop_driver(tokenizer=tokenizer)
    first_holder, second_holder = PREFILL_URLS
    for url in PREFILL_URLS:
        d.feed(KvStreamChanged(url, True, "connected"))
    d.feed(KvEventsReceived(first_holder, (stored(LONG[: 2 * BLOCK]),)))
    d.feed(KvEventsReceived(second_holder, (stored(OTHER[: 3 * BLOCK], first_hash=5000),)))
    client = d.post(COMPLETIONS, completion_body([LONG, OTHER]))
    prefill = d.leg("prefill")
    assert prefill.engine.url == first_holder
    rid = prefill.rid
    d.serve(prefill.bid)
    d.serve(d.leg("decode").bid)
    assert d.leg("prefill").engine.url == second_holder
    d.serve_until_done()
    assert client.last.status == 200 and len(client.last.json()["choices"]) == 2
    assert not d.tokenize_asked and tokenizer.heads == tokenizer.calls == 2  # the heads only
    routing = d.terminal(rid)["routing"]
    assert routing["index"] == "kv" and routing["prefill"] == second_holder
    # The record's candidates are the admission's, weighed for the first prompt: its matched tokens are
    # that prompt's (the first holder's two blocks), not the later prompt's tokens minus them.
    best = routing["candidates"][0]
    assert best["engine"] == first_holder and best["matched_tokens"] == 2 * BLOCK
    assert all(c["matched_tokens"] >= 0 for c in routing["candidates"])
    d.check_invariants(final=True)


def test_a_batch_client_leaving_while_its_next_prompt_is_tokenized() -> None:
    d = offloop_driver()
    client = d.post(COMPLETIONS, completion_body([SHORT, LONG], stream=True))
    d.serve(d.leg("prefill").bid)
    d.serve(d.leg("decode").bid)
    (cmd,) = d.tokenize_asked
    assert cmd.key.endswith(":1")
    client.leave()
    rid = cmd.key.partition(":")[0]
    assert d.terminal(rid)["terminal"] == "cancelled"
    d.complete_tokenize(cmd.key)
    assert not d.open_legs()
    d.check_invariants(final=True)


def test_the_runtime_starts_a_tokenizer_thread_only_for_a_policy_that_tokenizes() -> None:
    from narwhal_runtime.tokenize_worker import make_tokenize_worker

    tokenizer = CharTokenizer()
    worker = make_tokenize_worker(offloop_driver(tokenizer=tokenizer).router)
    assert worker is not None and worker.tokenizer is tokenizer
    for policy in ("least_loaded", "prefix"):
        assert make_tokenize_worker(Driver(routing={"policy": policy}).router) is None
