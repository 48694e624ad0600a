"""The seam between the router and an engine protocol (docs/design.md, "Engine protocols").

An engine protocol says how a PD request's legs talk to the engines: the
body of each leg, how a prefill answer is judged, and how KV nobody pulled
is released. The router holds one, chosen once at start by
``engine.protocol`` (:func:`~narwhal_core.protocols.engine_protocol`); the
parts that build legs, judge answers and release KV call it, and never ask
which protocol it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..errors import NarwhalError
    from ..leg_bodies import KvHandoff

__all__ = ["EngineProtocol"]


class EngineProtocol(Protocol):
    """What the router asks of an engine protocol (docs/design.md, "Engine protocols")."""

    @property
    def name(self) -> str:
        """Its name in ``engine.protocol``."""

    @property
    def legs_together(self) -> bool:
        """``False``: the decode leg starts once the prefill leg answered, with that answer's KV params.

        ``True``: both legs go out at once, a pair the router cancels
        together (no such protocol is driven yet).
        """

    def prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The prefill leg's body, from the accepted client body."""

    def decode_body(self, body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        """The decode leg's body: the client's body with the KV params the prefill handed off (``None``: none)."""

    def check_prefill_answer(
        self, body: bytes, backend_id: str, kv_host_allowed: Callable[[str], bool], *, require_request_id: bool = False
    ) -> KvHandoff:
        """A 2xx prefill answer judged: the KV it hands off, or :class:`~narwhal_core.leg_bodies.PrefillAnswerError`."""

    def refused_mode(self, params: dict[str, Any]) -> str | None:
        """The answer's KV transfer mode when this protocol does not drive it (the request then fails), else ``None``."""

    def mode_error(self, mode: str) -> NarwhalError:
        """The error a request gets when its prefill answered in the transfer mode ``mode`` this protocol refuses."""

    def release_body(self, body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
        """A ``decode_pull`` release's body: a decode request that reads the KV and answers one token."""
