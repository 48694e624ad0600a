"""The words of a request's lifecycle: its states, its inputs, and the follow-up work an event leaves.

:mod:`~narwhal_core.lifecycle` holds the table of (state, input) -> handler
and the handlers; this module only names things, so that every part can
import it (it imports no part). What the inputs carry is in
:mod:`~narwhal_core.verdicts`, but for :class:`LegEnded`, the verdict that
carries nothing: it is here because compiled code reads an enum member
defined in a compiled module as a constant (docs/operate.md, "Compiled core").
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from .ids import DECODE, PREFILL

__all__ = ["State", "Input", "FollowUp", "WAKE", "LegEnded"]


class State(enum.Enum):
    """Where a completion request is."""

    # Members are singletons: identity hashing is correct and skips Enum's
    # Python-level __hash__ on every table lookup.
    __hash__ = object.__hash__

    QUEUED = "queued"
    #: Admitted; its prompt's token ids are computed off the event loop before it is routed.
    TOKENIZING = "tokenizing"
    PREFILL = "prefill"
    PREFILL_WAIT = "prefill_wait"
    DECODE = "decode"
    DECODE_WAIT = "decode_wait"
    STREAMING = "streaming"
    RELEASING = "releasing"
    DONE = "done"


class Input(enum.Enum):
    """What can happen to a completion request."""

    # Members are singletons: identity hashing is correct and skips Enum's
    # Python-level __hash__ on every table lookup.
    __hash__ = object.__hash__

    #: A global admission slot was granted to a queued request.
    ADMIT = "admit"
    #: The prompt's token ids came back from the runtime's tokenizer (or why they did not).
    TOKENIZED = "tokenized"
    #: The current leg's answer is complete and good.
    LEG_OK = "leg_ok"
    #: The engine refused the leg with a 4xx (relayed, never retried).
    LEG_REFUSED = "leg_refused"
    #: The current leg failed (5xx, connection, timeout, unusable answer).
    LEG_FAILED = "leg_failed"
    #: The first bytes of a streamed answer went to the client.
    FIRST_BYTES = "first_bytes"
    #: The decode leg has not read the prefilled KV, and nothing renews its hold, which is ending.
    KV_HOLD_ENDING = "kv_hold_ending"
    #: A retry's backoff ended, or an engine slot freed up.
    WAKE = "wake"
    #: The request waited in the admission queue too long.
    QUEUE_TIMEOUT = "queue_timeout"
    #: The whole-request deadline passed.
    DEADLINE = "deadline"
    #: The client disconnected.
    CLIENT_GONE = "client_gone"
    #: Every pending KV release finished.
    RELEASED = "released"
    #: Shutdown's grace period ran out.
    ABANDON = "abandon"


class FollowUp(enum.Enum):
    """Work an event leaves for other requests, queued and done once the event is handled (docs/design.md).

    The router does each one (the lifecycle fires the inputs it amounts to)
    when it drains the queue, in the order queued: never inside the handler
    of the request whose event caused it.
    """

    __hash__ = object.__hash__

    #: A slot freed up on a prefill engine: the oldest request waiting for one takes it.
    WAKE_PREFILL = "wake_prefill"
    #: A slot freed up on a decode engine: the oldest request waiting for one takes it.
    WAKE_DECODE = "wake_decode"
    #: The decode backlog may be gone: start the prefills held back behind it.
    WAKE_PREFILLS = "wake_prefills"
    #: An admission slot freed up: admit queued requests while slots are free.
    ADMIT = "admit"


#: The follow-up of a slot freed on an engine of each phase.
WAKE: Final[Mapping[str, FollowUp]] = MappingProxyType({
    PREFILL: FollowUp.WAKE_PREFILL, DECODE: FollowUp.WAKE_DECODE,
})


class LegEnded(enum.Enum):
    """A leg's verdict that carries nothing (the others are :class:`LegAnswer`, :class:`LegRefusal`, :class:`LegFailure`)."""

    __hash__ = object.__hash__

    #: The leg's answer is good and complete (``LEG_OK``; a whole decode answer is a :class:`LegAnswer`).
    OK = "ok"
    #: An orphaned prefill (its client went away) ended: one of its request's releases is settled.
    SETTLED = "settled"
    #: No input but ``FIRST_BYTES``, if the stream's first bytes just went to the client.
    RELAYED = "relayed"
