"""SGLang's own router (``sglang-router`` from PyPI, PD mode) in front of the simulated SGLang fleet.

Every request is answered through SGLang's router: that is what shows the
simulator speaks SGLang's bootstrap PD truly enough (docs/simulator.md,
"SGLang PD"). The simulators' own records say what the router sent: the same
body to both legs, the prefill engine's host and bootstrap port, a random
room below 2^63. sglang-router comes with the ``test`` extra.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from narwhal_sim.testing import SimProcess
from tests.helpers import free_port

MODEL = "sim-model"
#: The decode side's SGLANG_DISAGGREGATION_WAITING_TIMEOUT here (300 s in SGLang).
WAITING_S = 1.0


class Fleet:
    """One SGLang prefill simulator, one decode simulator and SGLang's router in front of them."""

    def __init__(self, prefill: SimProcess, decode: SimProcess, router_url: str) -> None:
        self.prefill, self.decode, self.router_url = prefill, decode, router_url

    def client(self, timeout: float = 10.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.router_url + "/v1", api_key="unused", timeout=timeout, max_retries=0)

    def legs(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Each completion's (prefill record, decode record), paired by bootstrap room."""
        prefill = {r["body"]["bootstrap_room"]: r for r in self.prefill.requests() if r["method"] == "POST"}
        decode = {r["body"]["bootstrap_room"]: r for r in self.decode.requests() if r["method"] == "POST"}
        return [(prefill[room], decode[room]) for room in prefill if room in decode]


def _wait_until_ready(url: str, router: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.poll() is not None:
            raise RuntimeError(f"sglang-router exited with {router.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError("sglang-router did not become ready")


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    prefill = SimProcess("prefill", speed=0, protocol="sglang", model=MODEL, bootstrap_port=0)
    decode = SimProcess("decode", speed=0, protocol="sglang", model=MODEL, waiting_timeout_s=WAITING_S)
    with prefill, decode:
        port = free_port()
        command = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                   "--prefill", prefill.url, str(prefill.startup["bootstrap_port"]), "--decode", decode.url,
                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "error",
                   # Its metrics port defaults to 29000: a free one, so parallel runs do not collide.
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
        router = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_until_ready(f"http://127.0.0.1:{port}", router)
            yield Fleet(prefill, decode, f"http://127.0.0.1:{port}")
        finally:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait(5)


@pytest.fixture
def clean(fleet: Fleet) -> Fleet:
    for engine in (fleet.prefill, fleet.decode):
        httpx.post(engine.url + "/sim/faults", json={}, timeout=5)
        engine.reset()
    return fleet


def test_completions_and_chats_streamed_and_not_are_answered_through_sglang_router(clean: Fleet) -> None:
    client = clean.client()
    completion = client.completions.create(model=MODEL, prompt="Hello world, how are you", max_tokens=5)
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert len(completion.choices[0].text.split()) == 5
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.content is not None and len(chat.choices[0].message.content.split()) == 4
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert len("".join(c.choices[0].delta.content or "" for c in chunks if c.choices).split()) == 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                                                    stream=True)]  # fmt: skip
    assert len(pieces) == 3
    # Hidden state, from the simulators' counters: each request's room was registered, handed over, let go.
    prefill, decode = clean.prefill.stats(), clean.decode.stats()
    assert (prefill["rooms_registered"], prefill["rooms_collected"], prefill["rooms_held"]) == (4, 4, 0)
    assert (decode["decode_collected"], decode["decode_timed_out"], decode["decode_waiting"]) == (4, 0, 0)


def test_sglang_router_sends_both_legs_the_same_body_with_the_prefill_bootstrap_fields(clean: Fleet) -> None:
    client = clean.client()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, stream=True).close()
    legs = clean.legs()
    assert len(legs) == 2
    for prefill, decode in legs:
        body = prefill["body"]
        assert decode["body"] == body  # one body, both legs: the prefill side caps its own tokens at one
        assert body["bootstrap_host"] == "127.0.0.1"
        assert body["bootstrap_port"] == clean.prefill.startup["bootstrap_port"]
        assert 0 <= body["bootstrap_room"] < 2**63
        assert "rid" not in body  # no request ID: each engine makes its own
        assert abs(prefill["at"] - decode["at"]) < 0.5  # sent at once, not one after the other
    assert legs[0][0]["body"]["bootstrap_room"] != legs[1][0]["body"]["bootstrap_room"]


def test_a_failed_prefill_leaves_sglang_router_waiting_for_the_decode_timeout(clean: Fleet) -> None:
    httpx.post(clean.prefill.url + "/sim/faults", json={"prefill_fails": True}, timeout=5)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as failed:
        clean.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    waited = time.monotonic() - started
    assert failed.value.status_code == 500
    # The router ignores the prefill's 500 and relays the decode's answer once its room times out.
    assert waited >= WAITING_S
    decode = clean.decode.stats()
    assert decode["decode_timed_out"] >= 1 and decode["decode_collected"] == 0
    assert clean.prefill.stats()["rooms_registered"] == 0
