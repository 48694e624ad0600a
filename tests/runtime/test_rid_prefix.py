"""The process's request IDs (``narwhal_runtime.app.random_rid_prefix``) keep prefill answers on wire's fast path."""

from __future__ import annotations

import re
import secrets

import pytest

from narwhal_core import wire
from narwhal_core.ids import RidSource, backend_id
from narwhal_runtime.app import random_rid_prefix


def _prefill_answer(bid: str) -> bytes:
    """The part of a vLLM prefill answer that carries the leg's ID back (the engine adds its own suffix)."""
    return b'{"kv_transfer_params":{"remote_request_id":"%s-00000001","remote_block_ids":[0,1]}}' % bid.encode()


@pytest.mark.parametrize("draw", ["0123456789", "abcdef0123", "9876543210"])
def test_no_prefix_makes_a_rid_that_sends_prefill_answers_down_the_exact_path(
        monkeypatch: pytest.MonkeyPatch, draw: str) -> None:
    # The unluckiest draws of token_hex: ending in many decimal digits. A
    # counter whose hex digits are all decimal then made a run of 16 or more.
    monkeypatch.setattr(secrets, "token_hex", lambda nbytes=None: draw[: 2 * (nbytes or 16)])
    prefix = random_rid_prefix()
    assert re.fullmatch(r"[0-9a-f]{9}[a-f]", prefix)
    for start in (0, 0x1234567890, 0x0000999999):
        rid = RidSource(prefix, start)()
        assert not wire._scan(_prefill_answer(backend_id(rid, "prefill", 1))) & 1, rid


def test_the_prefix_stays_random() -> None:
    assert len({random_rid_prefix() for _ in range(50)}) > 40
