"""What a leg's answer amounts to for its request: the verdicts the parts return and the lifecycle acts on.

:mod:`~narwhal_core.answers` and :mod:`~narwhal_core.legs` read the engines'
side of the legs and return a :data:`Verdict`; the router hands it to
:meth:`~narwhal_core.lifecycle.Lifecycle.judged`, which fires the input it
amounts to, carrying the verdict to the handler (docs/design.md, "The parts
of the core").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from .errors import NarwhalError
from .events import PromptTokenized
from .states import LegEnded

if TYPE_CHECKING:
    from .inflight import Leg

__all__ = ["LegAnswer", "LegRefusal", "LegFailure", "LegEnded", "Verdict", "InputData"]





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


#: What the engine's side of a leg amounts to for its request: the parts that read legs return it,
#: the lifecycle acts on it (:meth:`~narwhal_core.lifecycle.Lifecycle.judged`).
Verdict = LegAnswer | LegRefusal | LegFailure | LegEnded
