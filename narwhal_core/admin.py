"""The admin API: ``/admin/engines``, the fleet by hand (docs/operate.md, "Engines that come and go").

``GET`` lists every engine with its state (joining, in rotation, out of
rotation, draining), its legs in flight and the load it last reported;
``POST`` adds an engine and ``DELETE`` drains one, with the body
``{"url": "http://HOST:PORT", "phase": "prefill" | "decode"}``. The same
changes as discovery's (:class:`~narwhal_core.membership.Membership`).

Only with an admin key in the API keys file (``role = "admin"``,
docs/security.md); without one ``/admin/*`` answers 404, as any unknown
route. With ``engine.discovery`` ``dns`` or ``file`` the fleet is
discovery's: ``POST`` and ``DELETE`` answer 409 (the next lookup would undo
them). Errors come in the OpenAI envelope; none echoes the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from . import wire
from .config import EngineAddress, parse_engine_url
from .errors import AuthError, ConfigError
from .wire import JsonError
from .ids import DECODE, PREFILL, Phase

if TYPE_CHECKING:
    from .auth import Authenticator
    from .context import Context
    from .fleet import EngineState
    from .http import HttpRequest
    from .membership import Membership

__all__ = ["Admin", "ADMIN_ENGINES"]

#: The one admin route.
ADMIN_ENGINES: Final = "/admin/engines"

#: An answer: status, JSON body, extra headers.
Answer = tuple[int, bytes, tuple[tuple[bytes, bytes], ...]]


class _Refused(Exception):
    """A request refused with ``answer``."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer[0])
        self.answer = answer


def _error(status: int, message: str, code: str, type: str = "invalid_request_error") -> Answer:
    body = wire.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
    return status, body, ()


class Admin:
    """Answers ``/admin/engines``; see the module docstring."""

    __slots__ = ("ctx", "membership")

    def __init__(self, ctx: Context, membership: Membership) -> None:
        self.ctx: Final = ctx
        self.membership: Final = membership

    def answer(self, auth: Authenticator, path: str, request: HttpRequest) -> Answer:
        """The answer to a request for ``path`` under ``/admin/``."""
        if not auth.admin_enabled or path != ADMIN_ENGINES:
            shown = path if len(path) <= 200 else path[:200] + "..."
            return _error(404, f"Unknown route {shown}.", "not_found")
        try:
            admin = auth.authenticate_admin(request.headers)
        except AuthError as exc:
            return 401, exc.body(), ()
        method = request.method
        if method in ("GET", "HEAD"):
            return 200, wire.dumps({"object": "list", "data": [self.describe(e) for e in self.ctx.fleet.all()]}), ()
        if method not in ("POST", "DELETE"):
            return 405, _error(405, f"Method {method} is not allowed on {path}.", "method_not_allowed")[1], (
                (b"allow", b"GET, HEAD, POST, DELETE"),)
        mode = self.ctx.config.engine.discovery
        if mode != "static":
            return _error(409, f"The engines are found by discovery (engine.discovery = {mode!r}): change them "
                               "there; an engine added or removed here would come back or go at the next lookup.",
                          "discovery_in_charge")
        try:
            phase, address = self._target(request.body)
        except _Refused as refused:
            return refused.answer
        if self.ctx.draining:
            return _error(503, "Narwhal is shutting down.", "shutting_down", "server_error")
        source = f"admin:{admin}"
        if method == "POST":
            engine = self.membership.add(phase, address, source)
            if engine is None:
                engine = self.ctx.fleet.find(phase, address.url)
                assert engine is not None
                return 200, wire.dumps(self.describe(engine)), ()
            return 201, wire.dumps(self.describe(engine)), ()
        engine = self.ctx.fleet.find(phase, address.url)
        if engine is None:
            return _error(404, f"No {phase} engine {address.url} in the fleet.", "engine_not_found")
        if not engine.draining:
            self.membership.drain(engine, source)
        return 200, wire.dumps(self.describe(engine)), ()

    @staticmethod
    def _target(body: bytes) -> tuple[Phase, EngineAddress]:
        """The ``phase`` and parsed ``url`` of a POST or DELETE body; raises :class:`_Refused` (400)."""
        try:
            data = wire.loads(body)
        except JsonError:
            data = None
        if not isinstance(data, dict) or set(data) != {"url", "phase"}:
            raise _Refused(_error(400, 'The body must be a JSON object {"url": "http://HOST:PORT", '
                                       '"phase": "prefill" or "decode"}.', "invalid_body"))
        phase, url = data["phase"], data["url"]
        if phase not in (PREFILL, DECODE):
            raise _Refused(_error(400, 'phase must be "prefill" or "decode".', "invalid_phase"))
        if not isinstance(url, str):
            raise _Refused(_error(400, "url must be a string, http://HOST:PORT.", "invalid_url"))
        try:
            address = parse_engine_url(url, key="url")
        except ConfigError as exc:
            raise _Refused(_error(400, str(exc), "invalid_url")) from None
        return PREFILL if phase == PREFILL else DECODE, address

    def describe(self, engine: EngineState) -> dict[str, Any]:
        """One engine as ``GET /admin/engines`` shows it."""
        load = engine.reported
        return {
            "url": engine.url, "phase": engine.phase, "state": engine.state, "outstanding": engine.outstanding,
            "load": None if load is None else {
                "waiting": load.waiting, "running": load.running, "kv_usage": load.kv_usage,
                "kv_capacity_tokens": load.kv_capacity_tokens,
            },
            "load_age_s": None if load is None else round(self.ctx.now - engine.reported_at, 3),
        }
