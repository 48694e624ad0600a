"""The prefill answers vLLM sends, version by version, through leg_bodies (docs/operate.md, "vLLM compatibility")."""

from __future__ import annotations

import json

import pytest

from narwhal_core import wire
from narwhal_core.leg_bodies import (
    PrefillAnswerError,
    check_prefill_answer,
    decode_body,
    engine_error,
    normalise_answer,
    openai_error_type,
    unsupported_transfer_mode,
)
from narwhal_core.engine_config import EngineAddress
from narwhal_core.fleet import EngineState
from narwhal_core.inflight import Kv
from narwhal_core.protocols import engine_protocol
from narwhal_core.relay import SseRelay
from narwhal_core.contract import COMPLETIONS

MODEL = "m"

#: Each era's params, as its NIXL connector writes them (docs/simulator.md, "vLLM versions").
SHAPES = {
    "connector-1": '{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[3,4,5],'
                   '"remote_engine_id":"e1","remote_host":"10.0.0.5","remote_port":5600,"tp_size":1}',
    "connector-2": '{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[3,4,5],'
                   '"remote_engine_id":"e1","remote_request_id":"cmpl-r-p1-0-9c0e51a2","remote_host":"10.0.0.5",'
                   '"remote_port":5600,"tp_size":1}',
    "hma": '{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[3,4,5]],'
           '"remote_engine_id":"e1","remote_request_id":"cmpl-r-p1-0-9c0e51a2","remote_host":"10.0.0.5",'
           '"remote_port":5600,"tp_size":1}',
    "lease": '{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[3,4,5],[90,91]],'
             '"remote_engine_id":"e1","remote_request_id":"cmpl-r-p1-0-9c0e51a2","remote_host":"10.0.0.5",'
             '"remote_port":5600,"tp_size":2,"dcp_size":1,"pp_size":1,"remote_num_tokens":50,'
             '"remote_blocks_expiry_time":null,"transfer_mode":"pull"}',
}  # fmt: skip


def answer(params: str, details: str = '{"cached_tokens":7}') -> bytes:
    return (
        '{"id":"cmpl-r","object":"text_completion","model":"m","choices":[{"index":0,"text":"a",'
        '"finish_reason":"length"}],"usage":{"prompt_tokens":50,"completion_tokens":1,"total_tokens":51,'
        f'"prompt_tokens_details":{details}}},"kv_transfer_params":{params}}}'
    ).encode()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_era_is_accepted_and_passed_on_byte_for_byte(shape: str) -> None:
    handoff = check_prefill_answer(answer(SHAPES[shape]), "r-p1", lambda host: host == "10.0.0.5")
    assert handoff.params is not None
    out = wire.dumps(decode_body({"model": MODEL, "prompt": "hi"}, handoff.params))
    assert out.endswith(b'"kv_transfer_params":' + SHAPES[shape].encode() + b"}")
    assert handoff.owner == ("r-p1" if shape == "connector-1" else "cmpl-r-p1-0-9c0e51a2")


#: vLLM's push scheduler's answer (nixl/push_scheduler.py, NixlPushConnectorScheduler.request_finished).
PUSH = (
    '{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[3,4,5]],"remote_engine_id":"e1",'
    '"remote_request_id":"cmpl-r-p1-0-9c0e51a2","remote_host":"10.0.0.5","remote_port":5600,"tp_size":1,'
    '"pp_size":1,"remote_num_tokens":50,"transfer_mode":"push"}'
)


@pytest.mark.parametrize(
    ("params", "mode"),
    [*((SHAPES[shape], None) for shape in SHAPES), (PUSH, "push"), (PUSH.replace('"push"', '"' + "x" * 60 + '"'), "x" * 40),
     (PUSH.replace('"push"', "7"), "7"), (PUSH.replace('"remote_block_ids":[[3,4,5]],', ""), "push")],
)  # fmt: skip
def test_only_the_pull_mode_is_driven(params: str, mode: str | None) -> None:
    """A push answer names a mode Narwhal does not drive: handed back (for its owner) whatever else it holds."""
    handoff = check_prefill_answer(answer(params), "r-p1", lambda host: host == "10.0.0.5")
    assert handoff.params is not None
    assert unsupported_transfer_mode(handoff.params) == mode


def drop(text: str, key: str) -> str:
    params = json.loads(text)
    params.pop(key)
    return json.dumps(params, separators=(",", ":"))


@pytest.mark.parametrize("key", ["remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                                 "remote_block_ids"])  # fmt: skip
@pytest.mark.parametrize("shape", ["hma", "lease"])
def test_a_missing_field_is_refused(shape: str, key: str) -> None:
    with pytest.raises(PrefillAnswerError, match=key):
        check_prefill_answer(answer(drop(SHAPES[shape], key)), "r-p1", lambda host: True)


def test_remote_request_id_is_required_once_the_engine_sent_it_and_must_be_a_string() -> None:
    flat_v1 = SHAPES["connector-1"]
    check_prefill_answer(answer(flat_v1), "r-p1", lambda host: True)  # connector 1: fine
    with pytest.raises(PrefillAnswerError, match="remote_request_id"):
        check_prefill_answer(answer(flat_v1), "r-p1", lambda host: True, require_request_id=True)
    bad = SHAPES["connector-2"].replace('"cmpl-r-p1-0-9c0e51a2"', "17")
    with pytest.raises(PrefillAnswerError, match="remote_request_id"):
        check_prefill_answer(answer(bad), "r-p1", lambda host: True)
    with pytest.raises(PrefillAnswerError, match="remote_block_ids"):
        check_prefill_answer(answer(SHAPES["hma"].replace("[[3,4,5]]", '[[3,"4"]]')), "r-p1", lambda host: True)


def test_missing_cached_tokens_is_zero() -> None:
    handoff = check_prefill_answer(answer(SHAPES["lease"], "null"), "r-p1", lambda host: True)
    assert handoff.cached_tokens is None
    decoded = {"usage": {"prompt_tokens": 50, "completion_tokens": 2, "total_tokens": 52,
                         "prompt_tokens_details": None}, "choices": []}  # fmt: skip
    out = normalise_answer(COMPLETIONS, decoded, MODEL, pd=True, cached_tokens=handoff.cached_tokens)
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_vllm_error_types_become_openai_types() -> None:
    assert openai_error_type("BadRequestError") == "invalid_request_error"
    assert openai_error_type("invalid_request_error") == "invalid_request_error"
    flat = b'{"object":"error","message":"bad","type":"BadRequestError","param":"max_tokens","code":400}'
    nested = b'{"error":{"message":"bad","type":"BadRequestError","param":"max_tokens","code":400}}'
    for body in (flat, nested):
        error = engine_error(400, body)
        assert (error.type, error.message, error.param) == ("invalid_request_error", "bad", "max_tokens")
    relay = SseRelay(route=COMPLETIONS, model=MODEL, pd=True, cached_tokens=None)
    out = relay.feed(b'data: {"error":{"message":"bad","type":"BadRequestError","param":"n","code":400}}\n\n')
    event = json.loads(out[6:])
    assert event["error"] == {"message": "bad", "type": "invalid_request_error", "param": "n", "code": 400}
    assert relay.error is not None and relay.error["type"] == "invalid_request_error"


# -- engine.protocol = "vllm-nixl-push" (docs/operate.md, "vLLM compatibility") -------------


def test_the_push_protocol_hands_the_decode_leg_the_prefill_engines_coordinates_and_no_blocks() -> None:
    # As vLLM's push proxy does (toy_push_proxy_server.py): the decode engine registers its own blocks.
    push = engine_protocol("vllm-nixl-push")
    handoff = push.check_prefill_answer(answer(PUSH), "r-p1", lambda host: host == "10.0.0.5")
    assert (handoff.owner, handoff.shared_id) == ("cmpl-r-p1-0-9c0e51a2", True)
    assert handoff.params is not None and push.refused_mode(handoff.params) is None
    out = wire.dumps(push.decode_body({"model": MODEL, "prompt": "hi"}, handoff.params))
    assert out == (
        b'{"model":"m","prompt":"hi","kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,'
        b'"remote_engine_id":"e1","remote_request_id":"cmpl-r-p1-0-9c0e51a2","remote_host":"10.0.0.5",'
        b'"remote_port":5600,"tp_size":1,"pp_size":1}}'
    )
    release = push.release_body({"model": MODEL, "prompt": "hi", "max_tokens": 9}, handoff.params)
    assert release["max_tokens"] == 1 and "remote_block_ids" not in release["kv_transfer_params"]
    # Every decode request carrying it goes with the prefill leg's X-Request-Id (the engines pair by it).
    engine = EngineState(address=EngineAddress(url="http://127.0.0.1:8100", host="127.0.0.1", port=8100,
                                               authority=b"127.0.0.1:8100"), phase="prefill", index=0)
    assert Kv(handoff=handoff, engine=engine, leg="r-p1").decode_request_id() == "r-p1"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_push_protocol_refuses_a_pull_answer_and_pull_refuses_a_push_answer(shape: str) -> None:
    push, pull = engine_protocol("vllm-nixl-push"), engine_protocol("vllm-nixl")
    params = push.check_prefill_answer(answer(SHAPES[shape]), "r-p1", lambda host: True).params
    assert params is not None and push.refused_mode(params) == "pull"
    assert "push mode on every engine" in push.mode_error("pull").message
    pushed = pull.check_prefill_answer(answer(PUSH), "r-p1", lambda host: True).params
    assert pushed is not None and pull.refused_mode(pushed) == "push"


@pytest.mark.parametrize("key", ["tp_size", "remote_request_id", "remote_host", "remote_engine_id"])
def test_a_push_answer_without_what_the_decode_engine_reads_is_refused(key: str) -> None:
    with pytest.raises(PrefillAnswerError, match=key):
        engine_protocol("vllm-nixl-push").check_prefill_answer(answer(drop(PUSH, key)), "r-p1", lambda host: True)
