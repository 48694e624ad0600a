"""Fixtures of the reliability fault matrix, on top of ``tests/conftest.py`` (``sims``...).

* ``make_fleet``: a fleet whose engines carry the given faults, tuned for a
  ``engine.kv_release`` mode: under ``decode_abort`` the decode engines watch
  their client for 200 ms before pulling (so a router's send-and-close counts
  as a release, docs/simulator.md), under ``lease`` the prefill engines hold
  unpulled KV for 0.6 s only (so the lease visibly expires it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from narwhal_sim.testing import SimThread

from ..harness import Fleet

#: Lease of the prefill engines under ``kv_release = "lease"``: short, so expiry shows within a test.
SHORT_LEASE_S = 0.6
#: The decode engines' pre-pull watch under ``kv_release = "decode_abort"`` (docs/simulator.md).
DECODE_ABORT_GRACE_MS = 200.0


@pytest.fixture
def make_fleet(sims: Callable[..., SimThread]) -> Callable[..., Fleet]:
    """``make_fleet(prefill=[faults, ...], decode=[faults, ...], mode=None, lease_s=None)``.

    One engine per faults mapping (``{}`` for a healthy one), in that order.
    """

    def make(
        prefill: Sequence[Mapping[str, Any]] = ({},),
        decode: Sequence[Mapping[str, Any]] = ({},),
        *,
        mode: str | None = None,
        lease_s: float | None = None,
        prefill_options: Mapping[str, Any] | None = None,
        decode_options: Mapping[str, Any] | None = None,
    ) -> Fleet:
        lease = lease_s if lease_s is not None else (SHORT_LEASE_S if mode == "lease" else 30.0)
        p_opts = {"lease_s": lease, **(prefill_options or {})}
        d_opts = dict(decode_options or {})
        if mode == "decode_abort":
            d_opts.setdefault("kv_pull_grace_ms", DECODE_ABORT_GRACE_MS)
        return Fleet(
            prefill=[sims("prefill", faults=dict(f), **p_opts) for f in prefill],
            decode=[sims("decode", faults=dict(f), **d_opts) for f in decode],
        )

    return make
