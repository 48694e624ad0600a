"""One request's lifecycle, as a table (STYLE: transitions are data).

``TRANSITIONS[(state, input)]`` names the router method that handles the
input in that state and the states it may leave the request in. A pair that
is not in the table fails closed: the router raises
:class:`~narwhal_core.errors.TransitionError` naming both, after ending the
request with a terminal record so that nothing is lost.

States::

    QUEUED ──ADMIT──▶ PREFILL ──LEG_OK──▶ DECODE ──FIRST_BYTES──▶ STREAMING
       │                 │  ▲                │  ▲                     │
       │           LEG_FAILED│WAKE     LEG_FAILED│WAKE               LEG_OK / LEG_FAILED
       │                 ▼  │                ▼  │                     ▼
       │             PREFILL_WAIT        DECODE_WAIT               RELEASING ──RELEASED──▶ DONE
       └──────────── any of CLIENT_GONE, DEADLINE, ABANDON, QUEUE_TIMEOUT ──▶ RELEASING / DONE

``RELEASING``: the client has its answer (or is gone) and KV releases are
still in flight; the terminal record waits for their outcome.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["State", "Input", "TRANSITIONS"]


class State(enum.Enum):
    """Where a completion request is."""

    # Members are singletons: identity hashing is correct and skips Enum's
    # Python-level __hash__ on every table lookup.
    __hash__ = object.__hash__

    QUEUED = "queued"
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
    #: The current leg's answer is complete and good.
    LEG_OK = "leg_ok"
    #: The engine refused the leg with a 4xx (relayed, never retried).
    LEG_REFUSED = "leg_refused"
    #: The current leg failed (5xx, connection, timeout, unusable answer).
    LEG_FAILED = "leg_failed"
    #: The first bytes of a streamed answer went to the client.
    FIRST_BYTES = "first_bytes"
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


S = State
I = Input
_END: Final = frozenset({S.RELEASING, S.DONE})
_LIVE: Final = (S.PREFILL, S.PREFILL_WAIT, S.DECODE, S.DECODE_WAIT, S.STREAMING)
#: Where a batch request goes when one prompt is answered and the next begins.
_NEXT_PROMPT: Final = frozenset({S.PREFILL, S.PREFILL_WAIT, S.DECODE, S.DECODE_WAIT})

TRANSITIONS: Final[dict[tuple[State, Input], tuple[str, frozenset[State]]]] = {
    (S.QUEUED, I.ADMIT): ("_begin", frozenset({S.PREFILL, S.DECODE, S.PREFILL_WAIT, S.DECODE_WAIT}) | _END),
    (S.QUEUED, I.QUEUE_TIMEOUT): ("_queue_timeout", _END),
    (S.QUEUED, I.CLIENT_GONE): ("_cancel", _END),
    (S.QUEUED, I.DEADLINE): ("_expire", _END),
    (S.QUEUED, I.ABANDON): ("_abandon", _END),
    (S.PREFILL, I.LEG_OK): ("_prefill_ok", frozenset({S.DECODE, S.DECODE_WAIT}) | _END),
    (S.PREFILL, I.LEG_REFUSED): ("_refused", _END),
    (S.PREFILL, I.LEG_FAILED): ("_leg_failed", frozenset({S.PREFILL_WAIT}) | _END),
    (S.PREFILL_WAIT, I.WAKE): ("_resume", frozenset({S.PREFILL, S.PREFILL_WAIT}) | _END),
    # (A batch prompt's answer starts the next prompt's legs: docs/operate.md, "Batch prompts".)
    (S.DECODE, I.LEG_OK): ("_decode_ok", _NEXT_PROMPT | _END),
    (S.DECODE, I.LEG_REFUSED): ("_refused", _END),
    (S.DECODE, I.LEG_FAILED): ("_leg_failed", frozenset({S.PREFILL_WAIT, S.DECODE_WAIT}) | _END),
    (S.DECODE, I.FIRST_BYTES): ("_first_bytes", frozenset({S.STREAMING})),
    # (PREFILL/PREFILL_WAIT: the KV's lease ran short before a decode engine had room: prefilled again.)
    (S.DECODE_WAIT, I.WAKE): ("_resume", frozenset({S.DECODE, S.DECODE_WAIT, S.PREFILL, S.PREFILL_WAIT}) | _END),
    (S.STREAMING, I.LEG_OK): ("_decode_ok", _NEXT_PROMPT | _END),
    (S.STREAMING, I.LEG_FAILED): ("_stream_failed", _END),
    (S.RELEASING, I.RELEASED): ("_released", frozenset({S.DONE})),
    (S.RELEASING, I.CLIENT_GONE): ("_ignore", frozenset({S.RELEASING})),
    (S.RELEASING, I.DEADLINE): ("_ignore", frozenset({S.RELEASING})),
    (S.RELEASING, I.ABANDON): ("_abandon_releases", frozenset({S.DONE})),
}
for _state in _LIVE:
    TRANSITIONS[(_state, I.CLIENT_GONE)] = ("_cancel", _END)
    TRANSITIONS[(_state, I.DEADLINE)] = ("_expire", _END)
    TRANSITIONS[(_state, I.ABANDON)] = ("_abandon", _END)
del _state
