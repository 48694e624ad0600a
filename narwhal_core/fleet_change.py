"""The router's command that says the fleet's membership changed.

An engine joined the fleet or was forgotten (discovery, the admin API:
docs/operate.md, "Engines that come and go"). What follows the fleet
outside the core acts on this value, not on the ``engine_added`` and
``engine_removed`` log lines beside it: the KV-event subscriber reads the
prefill engines' streams (docs/operate.md, "KV events").
"""

from __future__ import annotations

from typing import Literal

import attrs

from .engine_config import EngineAddress

__all__ = ["FleetChanged"]


@attrs.frozen(kw_only=True)
class FleetChanged:
    """The engines of one phase, as they are now that one joined or was forgotten."""

    #: The phase whose membership changed (:data:`narwhal_core.ids.Phase`).
    phase: Literal["prefill", "decode"]
    #: Every engine of that phase now, draining ones included (they still hold KV), in the fleet's order.
    engines: tuple[EngineAddress, ...]
