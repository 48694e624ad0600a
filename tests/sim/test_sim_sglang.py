"""The simulator's SGLang PD protocol (``--protocol sglang``): bootstrap rooms, their timeouts, faults and aborts.

Each test sends the prefill and the decode engine one request at once, as
SGLang's router does (docs/simulator.md, "SGLang PD"), over loopback, and
reads the engines' own counters (``/sim/stats``).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal_sim.cli import build_parser, config_from_args
from narwhal_sim.testing import SimProcess

#: Short SGLang timeouts (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT / _WAITING_TIMEOUT are 300 s).
TIMEOUT_S = 0.6


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SimProcess, SimProcess]]:
    prefill = SimProcess("prefill", speed=0, protocol="sglang", bootstrap_port=0, bootstrap_timeout_s=TIMEOUT_S)
    decode = SimProcess("decode", speed=0, protocol="sglang", waiting_timeout_s=TIMEOUT_S)
    with prefill, decode:
        yield prefill, decode


@pytest.fixture
def engines(pair: tuple[SimProcess, SimProcess]) -> Iterator[tuple[SimProcess, SimProcess]]:
    for engine in pair:
        _post(engine, "/sim/faults", {})
        engine.reset()
    yield pair


def _post(engine: SimProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, timeout=10)


def _body(prefill: SimProcess, room: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "tell me about rooms"}], "max_tokens": 5,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.startup["bootstrap_port"],
            "bootstrap_room": room, **extra}  # fmt: skip


def _both(prefill: SimProcess, decode: SimProcess, body: dict[str, Any],
          decode_delay_s: float = 0.0) -> tuple[httpx.Response, httpx.Response]:  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(_post, prefill, "/v1/chat/completions", body)
        time.sleep(decode_delay_s)
        d = pool.submit(_post, decode, "/v1/chat/completions", body)
        return p.result(10), d.result(10)


def test_a_pair_hands_the_room_over_and_both_answer(engines: tuple[SimProcess, SimProcess]) -> None:
    prefill, decode = engines
    p, d = _both(prefill, decode, _body(prefill, 11))
    assert p.status_code == 200 and d.status_code == 200
    assert p.json()["usage"]["completion_tokens"] == 1  # the prefill side decodes one token
    assert d.json()["usage"]["completion_tokens"] == 5
    ps, ds = prefill.stats(), decode.stats()
    assert (ps["rooms_registered"], ps["rooms_collected"], ps["rooms_held"]) == (1, 1, 0)
    assert (ds["decode_collected"], ds["decode_waiting"]) == (1, 0)


def test_the_decode_side_may_come_first(engines: tuple[SimProcess, SimProcess]) -> None:
    prefill, decode = engines
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        d = pool.submit(_post, decode, "/v1/chat/completions", _body(prefill, 12, stream=True))
        decode.wait_for(lambda s: s["decode_waiting"] == 1)
        p = pool.submit(_post, prefill, "/v1/chat/completions", _body(prefill, 12))
        assert p.result(10).status_code == 200
        answer = d.result(10)
    assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
    assert answer.text.count('"delta":{"content"') == 5
    assert prefill.stats()["rooms_collected"] == 1


def test_a_failed_prefill_leaves_the_decode_waiting_its_whole_timeout(engines: tuple[SimProcess, SimProcess]) -> None:
    prefill, decode = engines
    _post(prefill, "/sim/faults", {"prefill_fails": True})
    started = time.monotonic()
    p, d = _both(prefill, decode, _body(prefill, 13))
    waited = time.monotonic() - started
    assert p.status_code == 500 and p.json()["object"] == "error"
    assert d.status_code == 500 and "KVPoll.WaitingForInput" in d.json()["message"]
    assert waited >= TIMEOUT_S
    assert prefill.stats()["rooms_registered"] == 0
    ds = decode.stats()
    assert (ds["decode_timed_out"], ds["decode_collected"]) == (1, 0)


def test_a_dead_decode_leaves_the_room_held_until_the_bootstrap_timeout(engines: tuple[SimProcess, SimProcess]) -> None:
    prefill, decode = engines
    _post(decode, "/sim/faults", {"decode_dies": True})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(_post, prefill, "/v1/chat/completions", _body(prefill, 14))
        with pytest.raises(httpx.TransportError):
            _post(decode, "/v1/chat/completions", _body(prefill, 14))
        assert prefill.wait_for(lambda s: s["rooms_held"] == 1)["kv_leaked"] == 0
        answer = p.result(10)
    assert answer.status_code == 500 and "KVPoll.Bootstrapping" in answer.json()["message"]
    ps = prefill.stats()
    assert (ps["rooms_timed_out"], ps["kv_leaked"], ps["rooms_held"], ps["rooms_collected"]) == (1, 1, 0, 0)
    assert decode.stats()["faults_decode_dies"] == 1


def test_abort_request_on_the_prefill_fails_its_decode_side_at_once(engines: tuple[SimProcess, SimProcess]) -> None:
    prefill, decode = engines
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        p = pool.submit(_post, prefill, "/v1/chat/completions", _body(prefill, 16, rid="req-16"))
        prefill.wait_for(lambda s: s["rooms_held"] == 1)
        aborted = _post(prefill, "/abort_request", {"rid": "req-16"})
        assert aborted.status_code == 200 and aborted.content == b""
        answer = p.result(10)
    assert answer.status_code == 500 and "Abort request req-16" in answer.json()["message"]
    started = time.monotonic()
    late = _post(decode, "/v1/chat/completions", _body(prefill, 16, rid="req-16"))
    assert late.status_code == 500 and "Abort request req-16" in late.json()["message"]
    assert time.monotonic() - started < TIMEOUT_S  # told by the prefill side, not timed out
    ps, ds = prefill.stats(), decode.stats()
    assert (ps["rooms_aborted"], ps["rooms_held"], ps["aborts"]) == (1, 0, 1)
    assert (ds["decode_failed"], ds["decode_timed_out"]) == (1, 0)


def test_abort_request_on_the_decode_stops_its_wait(engines: tuple[SimProcess, SimProcess]) -> None:
    prefill, decode = engines
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        d = pool.submit(_post, decode, "/v1/chat/completions", _body(prefill, 17, rid="req-17"))
        decode.wait_for(lambda s: s["decode_waiting"] == 1)
        started = time.monotonic()
        assert _post(decode, "/abort_request", {"rid": "req-17"}).status_code == 200
        answer = d.result(10)
    assert answer.status_code == 500 and "Abort request req-17" in answer.json()["message"]
    assert time.monotonic() - started < TIMEOUT_S
    assert decode.stats()["decode_aborted"] == 1


def test_abort_all_concludes_every_room(engines: tuple[SimProcess, SimProcess]) -> None:
    prefill, _ = engines
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        legs = [pool.submit(_post, prefill, "/v1/chat/completions", _body(prefill, room)) for room in (21, 22)]
        prefill.wait_for(lambda s: s["rooms_held"] == 2)
        assert _post(prefill, "/abort_request", {"abort_all": True}).status_code == 200
        assert [leg.result(10).status_code for leg in legs] == [500, 500]
    assert prefill.stats()["rooms_aborted"] == 2


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/abort_request", {"rid": 5}, "rid must be a string"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "bootstrap_room is required"),
        ("/v1/chat/completions", {"messages": [], "bootstrap_room": 1}, "messages must be a non-empty array"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "bootstrap_room": -1},
         "bootstrap_room must be a non-negative integer"),
    ],
)
def test_bad_input_gets_a_400_in_sglang_error_shape(
    engines: tuple[SimProcess, SimProcess], path: str, body: dict[str, Any], needle: str
) -> None:
    prefill, _ = engines
    answer = _post(prefill, path, body)
    assert answer.status_code == 400
    error = answer.json()
    assert error["object"] == "error" and error["code"] == 400 and needle in error["message"]


def test_a_live_room_cannot_be_registered_twice(engines: tuple[SimProcess, SimProcess]) -> None:
    prefill, _ = engines
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(_post, prefill, "/v1/chat/completions", _body(prefill, 31))
        prefill.wait_for(lambda s: s["rooms_held"] == 1)
        again = _post(prefill, "/v1/chat/completions", _body(prefill, 31))
        assert again.status_code == 400 and "already in use" in again.json()["message"]
        assert first.result(10).status_code == 500  # its own bootstrap timeout


def test_the_flags_reach_the_config_and_bad_values_are_refused() -> None:
    parser = build_parser()
    args = parser.parse_args(["--protocol", "sglang", "--role", "prefill", "--bootstrap-port", "9100",
                              "--bootstrap-timeout-s", "2.5", "--waiting-timeout-s", "4"])  # fmt: skip
    config = config_from_args(args)
    assert (config.protocol, config.bootstrap_port, config.bootstrap_timeout_s, config.waiting_timeout_s) == (
        "sglang", 9100, 2.5, 4.0)
    with pytest.raises(ValueError, match="waiting_timeout_s must be > 0"):
        config_from_args(parser.parse_args(["--protocol", "sglang", "--waiting-timeout-s", "0"]))
    with pytest.raises(ValueError, match="bootstrap_port must be between 0 and 65535"):
        config_from_args(parser.parse_args(["--protocol", "sglang", "--bootstrap-port", "70000"]))
