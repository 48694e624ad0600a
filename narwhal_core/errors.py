"""The one error family that escapes ``narwhal_core``.

Every error carries the HTTP status it implies and renders the OpenAI error
envelope (docs/contract.md, "Responses and errors"), so an adapter never has to invent an answer: it catches
:class:`NarwhalError` and sends ``error.body()`` with ``error.status``.
Anything else escaping the core is a bug, and a property test says so.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = [
    "NarwhalError",
    "ContractError",
    "ProtocolError",
    "RemoteProtocolError",
    "LocalProtocolError",
    "ConfigError",
    "TransitionError",
    "AuthError",
    "envelope",
]


def envelope(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The OpenAI error envelope: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class NarwhalError(Exception):
    """Base of every error ``narwhal_core`` raises on purpose."""

    #: HTTP status the error implies when it answers a client.
    status: int = 500
    #: OpenAI error ``type``.
    type: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.param = param
        self.code = code

    def envelope(self) -> dict[str, Any]:
        """This error as an OpenAI error envelope."""
        return envelope(self.message, type=self.type, param=self.param, code=self.code)

    def body(self) -> bytes:
        """The envelope encoded as a JSON response body."""
        return orjson.dumps(self.envelope())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, status={self.status}, "
            f"param={self.param!r}, code={self.code!r})"
        )


class ContractError(NarwhalError):
    """A request broke the request rules of docs/contract.md (400 or 404)."""

    status = 400
    type = "invalid_request_error"


class ProtocolError(NarwhalError):
    """An HTTP/1.1 protocol violation; ``status`` is the answer it calls for."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, status: int | None = None, reason: str = "malformed") -> None:
        super().__init__(message, status=status)
        #: ``"malformed"``, ``"too_large"`` or ``"dropped"`` (peer closed mid-message).
        self.reason = reason
        #: The request's method and target, when its head was parsed before the
        #: error (a body over the limit), else ``None``.
        self.method: str | None = None
        self.target: str | None = None


class RemoteProtocolError(ProtocolError):
    """The peer (client or engine) sent bytes that break HTTP/1.1."""


class LocalProtocolError(ProtocolError):
    """We were asked to send something HTTP/1.1 does not allow here: a bug in the caller."""

    status = 500
    type = "server_error"


class ConfigError(NarwhalError):
    """A configuration value is wrong; ``key`` names it, dotted (``engine.decode``)."""

    status = 500
    type = "server_error"

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key

    def line(self) -> str:
        """The one line an operator sees when start-up refuses the config."""
        return f"narwhal: bad config: {self.message}"


class TransitionError(NarwhalError):
    """An input arrived that a request's lifecycle table has no row for (fails closed)."""

    status = 500
    type = "server_error"


class AuthError(NarwhalError):
    """Ingress authentication refused the request (docs/security.md): 401, journal ``denied``."""

    status = 401
    type = "authentication_error"
