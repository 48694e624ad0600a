"""The words of a request's lifecycle: its states, its inputs, and what the inputs carry.

:mod:`~narwhal_core.lifecycle` holds the table of (state, input) -> handler
and the handlers; this module only names things, so that every part can
import it (it imports no part).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import attrs

from .errors import NarwhalError
from .events import PromptTokenized

if TYPE_CHECKING:
    from .legs import Leg

__all__ = ["State", "Input", "LegAnswer", "LegRefusal", "LegFailure", "PromptTokenized", "InputData"]


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



@attrs.frozen
class LegAnswer:
    """``LEG_OK`` with a whole (not streamed) decode answer, normalised."""

    answer: dict[str, Any]


@attrs.frozen
class LegRefusal:
    """``LEG_REFUSED``: the engine judged the request itself bad (a 4xx that is the client's)."""

    error: NarwhalError
    leg: Leg


@attrs.frozen
class LegFailure:
    """``LEG_FAILED``: why the current leg failed, and, for an unusable prefill answer, the error."""

    reason: str
    leg: Leg
    error: NarwhalError | None = None
    #: Not worth a retry: every engine of the fleet would answer the same (the request fails with ``error``).
    final: bool = False


#: What an input carries to its handler (``TOKENIZED``: the :class:`~narwhal_core.events.PromptTokenized` itself).
InputData = LegAnswer | LegRefusal | LegFailure | PromptTokenized | None
