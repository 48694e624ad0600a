"""Property tests of the PD legs (docs/contract.md, "Prefill and decode legs") and of answer normalisation
("Responses and errors").

Oracles are written from docs/contract.md: the prefill body is the client body
with exactly the prefill edits, the decode body the client body plus the
prefill's ``kv_transfer_params`` verbatim, and the relayed answer carries the
client-facing object name, the configured model, the prefill's
``cached_tokens`` and no engine-internal field.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from narwhal_core import wire
from narwhal_core.errors import NarwhalError
from narwhal_core.leg_bodies import (
    PrefillAnswerError,
    check_prefill_answer,
    decode_body,
    normalise_answer,
    prefill_body,
)
from narwhal_core.relay import SseRelay

from ..corebuild import examples
from ..helpers import CHAT, COMPLETIONS, MODEL, PREFILL_KV_REQUEST

ROUTES = st.sampled_from([COMPLETIONS, CHAT])
SETTINGS = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tagged(value: Any) -> Any:
    """A value comparable by ``==`` without Python's ``True == 1 == 1.0`` and with key order."""
    if isinstance(value, bool) or value is None:
        return (type(value).__name__, value)
    if isinstance(value, int):
        return ("int", int(value))
    if isinstance(value, float):
        return ("float", value.hex() if not math.isnan(value) else "nan", str(value))
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, list):
        return ("list", tuple(tagged(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, tagged(v)) for k, v in value.items()))
    raise AssertionError(f"not a JSON value: {value!r}")


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=10),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)

LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "min_completion_tokens")
DROPPED = ("min_completion_tokens", "stream_options")

REAL_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(0, 50000), max_size=5)),
    "messages": st.just([{"role": "user", "content": "hello"}]),
    "max_tokens": st.one_of(st.integers(0, 4096), st.none()),
    "max_completion_tokens": st.one_of(st.integers(0, 4096), st.none()),
    "min_tokens": st.integers(0, 100),
    "min_completion_tokens": st.integers(0, 100),
    "stream": st.one_of(st.booleans(), st.none()),
    "stream_options": st.one_of(st.just({"include_usage": True}), st.none()),
    "n": st.sampled_from([1, 0, None]),
    "best_of": st.sampled_from([1, None]),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "seed": st.integers(),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 5)),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "response_format": st.just({"type": "json_object"}),
    "user": st.text(max_size=8),
}
extra_keys = st.text(max_size=8).filter(lambda k: k != "kv_transfer_params")


@st.composite
def client_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Accepted client bodies: real-looking fields plus random ones, in a random order."""
    names = draw(st.lists(st.sampled_from(sorted(REAL_FIELDS)), unique=True))
    pairs = [(name, draw(REAL_FIELDS[name])) for name in names]
    pairs += draw(st.lists(st.tuples(extra_keys, json_values), max_size=4))
    body: dict[str, Any] = {}
    for key, value in draw(st.permutations(pairs)):
        body[key] = value
    return body


def subsequence(keys: list[str], of: list[str]) -> list[str]:
    wanted = set(keys)
    return [k for k in of if k in wanted]


@SETTINGS
@given(body=client_bodies())
@example(body={})
@example(body={"stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 9})
@example(body={"max_completion_tokens": None, "min_tokens": 3, "prompt": "x"})
def test_prefill_body_has_exactly_the_spec_edits(body: dict[str, Any]) -> None:
    before = tagged(copy.deepcopy(body))
    out = prefill_body(body)
    assert tagged(body) == before, "prefill_body must not change the client body"
    event(f"max_completion_tokens sent: {'max_completion_tokens' in body}")

    # What docs/contract.md, "Prefill and decode legs", changes.
    assert tagged(out["max_tokens"]) == ("int", 1)
    assert tagged(out["stream"]) == ("bool", False)
    assert tagged(out["kv_transfer_params"]) == tagged(PREFILL_KV_REQUEST)
    if "max_completion_tokens" in body:
        assert tagged(out["max_completion_tokens"]) == ("int", 1)
    else:
        assert "max_completion_tokens" not in out
    for key in DROPPED:
        assert key not in out
    # min_tokens: 1 when the client asked for at least one token, else gone
    # (the prefill's one token may end the sequence only if the client allowed it).
    min_tokens = body.get("min_tokens")
    wants_tokens = type(min_tokens) is int and min_tokens >= 1
    if wants_tokens:
        assert tagged(out["min_tokens"]) == ("int", 1)
    else:
        assert "min_tokens" not in out

    # Nothing else: every other key keeps its value and its relative order.
    edited = {"max_tokens", "max_completion_tokens", "stream", "kv_transfer_params", "min_tokens", *DROPPED}
    kept = [k for k in body if k not in edited]
    assert set(out) == set(kept) | {"max_tokens", "stream", "kv_transfer_params"} | (
        {"max_completion_tokens"} if "max_completion_tokens" in body else set()
    ) | ({"min_tokens"} if wants_tokens else set())
    for key in kept:
        assert tagged(out[key]) == tagged(body[key]), key
    assert subsequence(kept, list(out)) == kept
    # Edited keys the client sent stay where the client put them.
    sent = [k for k in body if k in ("max_tokens", "max_completion_tokens", "stream") or k in kept or (
        k == "min_tokens" and wants_tokens)]
    assert subsequence(sent, list(out)) == sent
    # The engine sees what we think: it survives encoding.
    assert json.loads(wire.dumps(out)) == json.loads(json.dumps(out))


def test_prefill_kv_request_is_a_fresh_object_each_time() -> None:
    first = prefill_body({"prompt": "a"})
    first["kv_transfer_params"]["remote_host"] = "evil"
    second = prefill_body({"prompt": "a"})
    assert second["kv_transfer_params"] == PREFILL_KV_REQUEST


usable_kv = st.fixed_dictionaries(
    {
        "do_remote_prefill": st.just(True),
        "do_remote_decode": st.booleans(),
        "remote_engine_id": st.text(min_size=1, max_size=12),
        "remote_block_ids": st.lists(st.integers(0, 10**6), max_size=6),
        "remote_host": st.sampled_from(["10.0.0.5", "prefill-0.fleet", "::1"]),
        "remote_port": st.integers(1, 65535),
    },
    optional={
        "remote_request_id": st.text(min_size=1, max_size=20),
        "tp_size": st.integers(1, 8),
        "remote_extra": json_values,
    },
)


@SETTINGS
@given(body=client_bodies(), kv=usable_kv)
def test_decode_body_is_the_client_body_plus_kv_params(body: dict[str, Any], kv: dict[str, Any]) -> None:
    before = tagged(copy.deepcopy(body))
    kv_before = tagged(copy.deepcopy(kv))
    out = decode_body(body, kv)
    assert tagged(body) == before, "decode_body must not change the client body"
    assert tagged(kv) == kv_before
    assert tagged(out["kv_transfer_params"]) == kv_before  # verbatim
    rest = {k: v for k, v in out.items() if k != "kv_transfer_params"}
    assert tagged(rest) == before  # every key, value and order; n/best_of/stream/limits as sent
    for key in ("n", "best_of", "stream", "stream_options", *LIMIT_FIELDS):
        assert (key in out) == (key in body)


ALLOWED_HOSTS = frozenset({"10.0.0.5", "prefill-0.fleet", "::1"})


def allowed(host: str) -> bool:
    return host in ALLOWED_HOSTS


def prefill_answer(kv: Any, *, cached: Any = 7, omit_kv: bool = False) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    }
    if cached is not None:
        answer["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
    if not omit_kv:
        answer["kv_transfer_params"] = kv
    return answer


@SETTINGS
@given(kv=usable_kv, cached=st.one_of(st.none(), st.integers(0, 10**6)), backend=st.sampled_from(["r1-p1", "r1-p2"]))
def test_usable_kv_params_are_accepted(kv: dict[str, Any], cached: int | None, backend: str) -> None:
    seen: list[str] = []

    def predicate(host: str) -> bool:
        seen.append(host)
        return allowed(host)

    handoff = check_prefill_answer(json.dumps(prefill_answer(kv, cached=cached)).encode(), backend, predicate)
    assert tagged(handoff.params) == tagged(kv)
    assert handoff.owner == kv.get("remote_request_id", backend)
    assert handoff.cached_tokens == cached
    assert seen == [kv["remote_host"]], "the SSRF guard must be asked about the host"


def _set(path: str, value: Any) -> Any:
    def edit(kv: dict[str, Any]) -> dict[str, Any]:
        kv[path] = value
        return kv

    return edit


def _drop(path: str) -> Any:
    def edit(kv: dict[str, Any]) -> dict[str, Any]:
        kv.pop(path, None)
        return kv

    return edit


UNUSABLE_EDITS: dict[str, Any] = {
    "do_remote_prefill missing": _drop("do_remote_prefill"),
    "do_remote_prefill false": _set("do_remote_prefill", False),
    "do_remote_prefill null": _set("do_remote_prefill", None),
    "do_remote_prefill 1": _set("do_remote_prefill", 1),
    "do_remote_prefill 'true'": _set("do_remote_prefill", "true"),
    "engine id missing": _drop("remote_engine_id"),
    "engine id null": _set("remote_engine_id", None),
    "engine id empty": _set("remote_engine_id", ""),
    "engine id number": _set("remote_engine_id", 3),
    "block ids missing": _drop("remote_block_ids"),
    "block ids null": _set("remote_block_ids", None),
    "block ids object": _set("remote_block_ids", {"0": 1}),
    "block ids string": _set("remote_block_ids", "[1,2]"),
    "block ids number": _set("remote_block_ids", 4),
    "host metadata service": _set("remote_host", "169.254.169.254"),
    "host elsewhere": _set("remote_host", "evil.example"),
    "host with port": _set("remote_host", "10.0.0.5:22"),
    "host case": _set("remote_host", "PREFILL-0.FLEET"),
    "host missing": _drop("remote_host"),
    "host null": _set("remote_host", None),
    "host empty": _set("remote_host", ""),
    "host list": _set("remote_host", ["10.0.0.5"]),
    "port missing": _drop("remote_port"),
    "port null": _set("remote_port", None),
    "port zero": _set("remote_port", 0),
    "port negative": _set("remote_port", -1),
    "port too big": _set("remote_port", 65536),
    "port huge": _set("remote_port", 10**30),
    "port string": _set("remote_port", "8000"),
    "port float": _set("remote_port", 8000.0),
    "port bool": _set("remote_port", True),
}


def _check(body: bytes) -> BaseException | None:
    try:
        check_prefill_answer(body, "r1-p1", allowed)
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def assert_failed_prefill(body: bytes) -> None:
    exc = _check(body)
    assert exc is not None, f"an unusable prefill answer was accepted: {body[:300]!r}"
    assert isinstance(exc, PrefillAnswerError), f"{type(exc).__name__}: {exc!r} for {body[:300]!r}"
    assert exc.status == 502 and exc.code == "prefill_failed" and exc.type == "server_error"


@SETTINGS
@given(kv=usable_kv, edit=st.sampled_from(sorted(UNUSABLE_EDITS)))
def test_each_unusable_kv_shape_is_a_failed_prefill(kv: dict[str, Any], edit: str) -> None:
    event(edit)
    bad = UNUSABLE_EDITS[edit](dict(kv))
    assert_failed_prefill(json.dumps(prefill_answer(bad)).encode())


@SETTINGS
@given(kv=st.one_of(st.booleans(), st.integers(), st.text(max_size=5), st.lists(json_values, max_size=2)))
def test_kv_params_not_an_object(kv: Any) -> None:
    assert_failed_prefill(json.dumps(prefill_answer(kv)).encode())


@pytest.mark.parametrize("omit", [False, True], ids=["null", "absent"])
@pytest.mark.parametrize("finish", ["stop", "length", None])
def test_null_kv_params_are_nothing_to_hand_off(omit: bool, finish: str | None) -> None:
    # vLLM's connector returns no params when the one-token prefill ended the
    # sequence (FINISHED_STOPPED): not a failure, a plain decode leg follows.
    answer = prefill_answer(None, omit_kv=omit)
    answer["choices"][0]["finish_reason"] = finish
    handoff = check_prefill_answer(json.dumps(answer).encode(), "r1-p1", allowed)
    assert handoff.params is None and handoff.owner == "r1-p1" and handoff.cached_tokens == 7
    assert handoff.finish_reason == finish
    assert handoff.reason is not None and "recomputes the prompt" in handoff.reason
    assert ("finish_reason stop" in handoff.reason) == (finish == "stop")
    # The decode leg is the client's body as it is: no kv_transfer_params at all.
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5}
    assert decode_body(body, handoff.params) == body


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b'{"kv_transfer_params": {"do_remote_prefill": true',  # truncated
        b'[{"kv_transfer_params": {}}]',
        b'"kv_transfer_params"',
        b"null",
        b'{"kv_transfer_params": {"do_remote_prefill": true, "remote_port": NaN}}',
        b'{"kv_transfer_params": {"remote_engine_id": "\\ud800"}}',
        b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"kv_transfer_params": null, "usage": {"prompt_tokens": ' + b"9" * 5000 + b"}}",
    ],
    ids=lambda b: repr(b[:40]),
)
def test_not_json_or_no_kv_is_a_failed_prefill(body: bytes) -> None:
    assert_failed_prefill(body)


@SETTINGS
@given(kv=usable_kv, cut=st.integers(min_value=1, max_value=10**6))
def test_truncated_answer_is_a_failed_prefill(kv: dict[str, Any], cut: int) -> None:
    body = json.dumps(prefill_answer(kv)).encode()
    assert_failed_prefill(body[: cut % len(body)])


# --------------------------------------------------------------------------
# normalise_answer
# --------------------------------------------------------------------------

messages = st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": st.sampled_from(["", None, "hello", " "])},
    optional={
        "tool_calls": st.sampled_from([
            [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}], [], None,
        ]),
        "reasoning_content": st.sampled_from(["thinking...", "", None]),
    },
)


@st.composite
def decode_answers(draw: st.DrawFn, route: str) -> dict[str, Any]:
    choice_count = draw(st.integers(0, 3))
    choices = []
    for i in range(choice_count):
        choice: dict[str, Any] = {"index": i, "finish_reason": draw(st.sampled_from(["stop", "length", None]))}
        if route == CHAT:
            choice["message"] = draw(messages)
        else:
            choice["text"] = draw(st.sampled_from(["", "hi", "\n"]))
        if draw(st.booleans()):
            choice["kv_transfer_params"] = {"do_remote_decode": False}
        choices.append(choice)
    answer: dict[str, Any] = {
        "id": "cmpl-9",
        "object": draw(st.sampled_from(["text_completion", "chat.completion", "whatever", None])),
        "created": 1700000000,
        "model": draw(st.sampled_from([MODEL, "served-name", "/models/llama"])),
        "choices": choices,
    }
    if draw(st.booleans()):
        usage: dict[str, Any] = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
        details = draw(st.sampled_from(["absent", "null", "with", "without"]))
        if details == "null":
            usage["prompt_tokens_details"] = None
        elif details == "with":
            usage["prompt_tokens_details"] = {"cached_tokens": 12, "audio_tokens": 0}
        elif details == "without":
            usage["prompt_tokens_details"] = {}
        answer["usage"] = usage
    if draw(st.booleans()):
        answer["kv_transfer_params"] = {"remote_engine_id": "e", "remote_block_ids": [1]}
    if draw(st.booleans()):
        answer["system_fingerprint"] = draw(json_values)
    return dict(draw(st.permutations(list(answer.items()))))


def carries_only_reasoning_or_tools(message: dict[str, Any]) -> bool:
    return bool(message.get("tool_calls")) or bool(message.get("reasoning_content"))


@SETTINGS
@given(
    case=ROUTES.flatmap(lambda r: st.tuples(st.just(r), decode_answers(r))),
    pd=st.booleans(),
    cached=st.one_of(st.none(), st.integers(0, 4096)),
)
def test_normalise_answer(case: tuple[str, dict[str, Any]], pd: bool, cached: int | None) -> None:
    route, answer = case
    original = copy.deepcopy(answer)
    out = normalise_answer(route, answer, MODEL, pd=pd, cached_tokens=cached)  # type: ignore[arg-type]

    assert out["object"] == ("chat.completion" if route == CHAT else "text_completion")
    assert out["model"] == MODEL
    assert "kv_transfer_params" not in out
    for key in original:
        if key not in ("object", "model", "kv_transfer_params", "choices", "usage"):
            assert tagged(out[key]) == tagged(original[key]), key

    assert len(out["choices"]) == len(original["choices"])
    for got, sent in zip(out["choices"], original["choices"]):
        assert "kv_transfer_params" not in got
        expected = {k: v for k, v in sent.items() if k != "kv_transfer_params"}
        if route == CHAT:
            message = dict(sent["message"])
            if message["content"] == "" and carries_only_reasoning_or_tools(message):
                message["content"] = None  # docs/contract.md, "Responses and errors": null, not ""
            expected["message"] = message
        assert tagged(got) == tagged(expected)

    if "usage" in original:
        usage = out["usage"]
        sent_usage = original["usage"]
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert usage[key] == sent_usage[key]
        details = usage.get("prompt_tokens_details")
        if not pd:
            assert tagged(usage) == tagged(sent_usage)
        elif cached is not None:
            # docs/contract.md, "Responses and errors": cached_tokens comes from the prefill leg.
            assert isinstance(details, dict) and details["cached_tokens"] == cached
        else:
            # The prefill leg gave none: the decode engine's figure must not be relayed;
            # Narwhal reports 0, never null (issue 21 item 7; docs/operate.md, "vLLM compatibility").
            assert isinstance(details, dict) and details["cached_tokens"] == 0


# --------------------------------------------------------------------------
# SseRelay
# --------------------------------------------------------------------------

pieces_of_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6)


@st.composite
def vllm_streams(draw: st.DrawFn, route: str) -> tuple[bytes, list[Any], bool]:
    """A decode leg's SSE stream as vLLM writes it: (bytes, payloads, has_done)."""
    engine_model = draw(st.sampled_from([MODEL, "served-name"]))
    obj_name = "chat.completion.chunk" if route == CHAT else "text_completion"
    compact = draw(st.booleans())
    seps = (",", ":") if compact else (", ", ": ")
    payloads: list[Any] = []
    out = bytearray()
    for i in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["chunk", "chunk", "chunk", "comment", "usage", "error"]))
        if kind == "comment":
            out += b": keep-alive\n\n"
            payloads.append(None)
            continue
        chunk: dict[str, Any] = {"id": "cmpl-1", "object": obj_name, "created": 1, "model": engine_model}
        if kind == "error":
            chunk = {"error": {"message": "boom", "type": "server_error", "param": None, "code": 500}}
        else:
            piece = draw(pieces_of_text)
            delta = {"delta": {"content": piece}} if route == CHAT else {"text": piece}
            chunk["choices"] = [] if kind == "usage" else [{"index": 0, **delta, "finish_reason": None}]
            if kind == "usage" or draw(st.integers(0, 4)) == 0:
                chunk["usage"] = {
                    "prompt_tokens": 5,
                    "completion_tokens": i,
                    "total_tokens": 5 + i,
                    "prompt_tokens_details": draw(st.sampled_from([{"cached_tokens": 5}, None, {}])),
                }
            if draw(st.integers(0, 3)) == 0:
                chunk["kv_transfer_params"] = {"remote_engine_id": "e", "remote_block_ids": [1, 2]}
        payloads.append(chunk)
        prefix = draw(st.sampled_from([b"data: ", b"data:"]))
        out += prefix + json.dumps(chunk, separators=seps, ensure_ascii=draw(st.booleans())).encode() + b"\n\n"
    done = draw(st.booleans())
    if done:
        out += b"data: [DONE]\n\n"
    return bytes(out), payloads, done


def relay(route: str, cached: int | None = 11, pd: bool = True) -> SseRelay:
    return SseRelay(route=route, model=MODEL, pd=pd, cached_tokens=cached)  # type: ignore[arg-type]


def feed_all(r: SseRelay, pieces: list[bytes]) -> bytes:
    return b"".join(r.feed(p) for p in pieces)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


@SETTINGS
@given(
    case=ROUTES.flatmap(lambda r: st.tuples(st.just(r), vllm_streams(r))),
    cuts=st.lists(st.integers(min_value=0, max_value=10**6), max_size=12),
)
def test_sse_any_split_gives_the_same_output(case: tuple[str, tuple[bytes, list[Any], bool]], cuts: list[int]) -> None:
    route, (stream, _, done) = case
    whole_relay = relay(route)
    whole = whole_relay.feed(stream)
    split_relay = relay(route)
    assert feed_all(split_relay, split(stream, cuts)) == whole
    byte_relay = relay(route)
    assert feed_all(byte_relay, [stream[i : i + 1] for i in range(len(stream))]) == whole
    for r in (whole_relay, split_relay, byte_relay):
        assert r.done is done
        assert r.events == whole_relay.events


@SETTINGS
@given(
    case=ROUTES.flatmap(lambda r: st.tuples(st.just(r), vllm_streams(r))),
    cached=st.one_of(st.none(), st.integers(0, 100)),
    pd=st.booleans(),
)
def test_sse_events_are_normalised(
    case: tuple[str, tuple[bytes, list[Any], bool]], cached: int | None, pd: bool
) -> None:
    route, (stream, payloads, done) = case
    r = relay(route, cached=cached, pd=pd)
    out = r.feed(stream)
    assert b"kv_transfer_params" not in out
    events = out.split(b"\n\n")
    assert events[-1] == b""
    events = events[:-1]
    assert len(events) == len(payloads) + (1 if done else 0)
    if done:
        assert events[-1] == b"data: [DONE]"
    last_usage = None
    for raw, sent in zip(events, payloads):
        if sent is None:
            assert raw == b": keep-alive"
            continue
        assert raw.startswith(b"data:")
        got = json.loads(raw[5:])
        if "error" in sent:
            assert got == sent and r.error == sent["error"]
            continue
        assert got["model"] == MODEL
        assert "kv_transfer_params" not in got
        assert got["choices"] == sent["choices"]
        if "usage" in sent:
            usage = got["usage"]
            last_usage = usage
            details = usage.get("prompt_tokens_details")
            if not pd:
                assert usage == sent["usage"]
            elif cached is not None:
                assert isinstance(details, dict) and details["cached_tokens"] == cached
            else:
                assert isinstance(details, dict) and details["cached_tokens"] == 0  # 0, never null (issue 21)
        else:
            assert "usage" not in got
    assert r.usage == last_usage


@SETTINGS
@given(case=ROUTES.flatmap(lambda r: st.tuples(st.just(r), vllm_streams(r))))
def test_sse_event_per_read_matches_byte_per_read(case: tuple[str, tuple[bytes, list[Any], bool]]) -> None:
    # One whole one-line event per read takes feed's short path; one byte
    # per read never does. Both must relay the same bytes and keep the same state.
    route, (stream, _, _) = case
    fast, slow = relay(route), relay(route)
    events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    assert feed_all(fast, events) == feed_all(slow, [stream[i : i + 1] for i in range(len(stream))])
    for name in ("done", "error", "usage", "events"):
        assert getattr(fast, name) == getattr(slow, name), name


SECRET = b"sk-engine-secret"
ONE_EVENTS = [
    b'data: {"model":"%s","choices":[]}\n\n' % MODEL.encode(),
    b'data:{"model":"served-name","choices":[]}\n\n',
    b'data: {"model":"%s","kv_transfer_params":{"remote_host":"10.0.0.5"}}\n\n' % MODEL.encode(),
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}\n\n',
    b'data: {"error":{"message":"boom","code":500}}\n\n',
    b'data: {"model":"%s","text":"' % MODEL.encode() + SECRET + b'"}\n\n',
    b"data: [DONE]\n\n",
    b"data:[DONE]\n\n",
    b": keep-alive\n\n",
    b"id: 7\n\n",
    b"data: not json\n\n",
    b"data: [1, 2]\n\n",
    b"data: " + SECRET + b"\n\n",
]


@pytest.mark.parametrize("around", ["alone", "after-two", "before-one"])
@pytest.mark.parametrize("event", ONE_EVENTS)
def test_sse_one_line_events_short_path_matches_the_general_one(event: bytes, around: str) -> None:
    # The event alone in a read, or with others in the same read: the short
    # path relays (and on a bad event, keeps the good ones before it) exactly
    # as the general one does, fed a byte at a time.
    good = ONE_EVENTS[0] + ONE_EVENTS[3]
    event = {"alone": event, "after-two": good + event, "before-one": event + ONE_EVENTS[2]}[around]

    def run(pieces: list[bytes]) -> tuple[Any, ...]:
        # What reaches the client: each feed's events, then (when one fails)
        # the good events the failing feed had before the bad one.
        r = SseRelay(route=CHAT, model=MODEL, pd=True, cached_tokens=3, redact=SECRET)  # type: ignore[arg-type]
        relayed, failed = b"", None
        try:
            for piece in pieces:
                relayed += r.feed(piece)
        except NarwhalError as exc:
            relayed, failed = relayed + r.good_before_error, exc.code
        return relayed, failed, r.done, r.error, r.usage, r.events

    fast = run([event])
    assert fast == run([event[i : i + 1] for i in range(len(event))])
    assert SECRET.decode() not in repr(fast)


def test_sse_done_sets_done() -> None:
    r = relay(CHAT)
    assert r.feed(b"data: [DON") == b""
    assert not r.done
    assert r.feed(b"E]\n\n") == b"data: [DONE]\n\n"
    assert r.done


# Valid SSE beyond vLLM's exact framing (WHATWG HTML "Server-sent events"):
# CRLF line ends, several fields per event, extra blank lines between events.
@st.composite
def general_sse_streams(draw: st.DrawFn) -> bytes:
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    out = bytearray()
    for i in range(draw(st.integers(1, 4))):
        chunk = {"id": f"c{i}", "model": "served-name", "choices": [{"index": 0, "text": "x"}],
                 "kv_transfer_params": {"remote_engine_id": "e"}}
        lines = [b"data: " + json.dumps(chunk).encode()]
        if draw(st.booleans()):
            lines.insert(0, draw(st.sampled_from([b"id: 7", b"event: message", b": ping", b"retry: 100"])))
        out += eol.join(lines) + eol + eol
        if draw(st.booleans()):
            out += eol  # an extra blank line: dispatches nothing
    out += b"data: [DONE]" + eol + eol
    return bytes(out)


@settings(max_examples=examples(100), deadline=None)
@given(stream=general_sse_streams(), cuts=st.lists(st.integers(0, 10**6), max_size=8))
@example(stream=b'data: {"model":"m"}\n\n\ndata: [DONE]\n\n', cuts=[len(b'data: {"model":"m"}\n\n\n')])
def test_sse_any_valid_stream_split_invariance(stream: bytes, cuts: list[int]) -> None:
    whole = relay(COMPLETIONS).feed(stream)
    assert feed_all(relay(COMPLETIONS), split(stream, cuts)) == whole


@settings(max_examples=examples(100), deadline=None)
@given(stream=general_sse_streams())
@example(stream=b'id: 1\ndata: {"model":"x","kv_transfer_params":{"remote_host":"10.0.0.5"}}\n\ndata: [DONE]\n\n')
@example(stream=b'data: {"model":"x","kv_transfer_params":{}}\r\n\r\ndata: [DONE]\r\n\r\n')
def test_sse_any_valid_stream_is_relayed_normalised(stream: bytes) -> None:
    r = relay(COMPLETIONS)
    out = r.feed(stream)
    assert r.done, f"[DONE] not seen in {stream!r}; relayed {out!r}"
    assert b"kv_transfer_params" not in out, out
    assert b"served-name" not in out, out


def test_sse_event_too_large_is_a_narwhal_error() -> None:
    r = SseRelay(route=CHAT, model=MODEL, pd=True, cached_tokens=None, max_event_bytes=64)
    with pytest.raises(NarwhalError):
        r.feed(b"data: " + b"x" * 100)


@pytest.mark.parametrize(
    "payload",
    [b"[" * 5000 + b"]" * 5000, b'{"usage": ' + b"9" * 5000 + b"}", b'{"usage": {}, "x": "\\ud800"}'],
    ids=["deep", "huge-int", "lone-surrogate"],
)
def test_sse_hostile_payloads_never_escape_as_non_narwhal_errors(payload: bytes) -> None:
    r = relay(CHAT)
    try:
        r.feed(b"data: " + payload + b"\n\n")
    except NarwhalError:
        pass
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"SseRelay.feed raised {type(exc).__name__}: {exc!r}")
