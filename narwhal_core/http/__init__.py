"""Narwhal's HTTP/1.1 codec, sans-IO: the client-facing side, the engine side, and what they share.

* :mod:`.grammar` -- the events, limits, grammar and field reading both sides share;
* :mod:`.server` -- :class:`ServerConnection`, one client connection (Narwhal is the server);
* :mod:`.engine` -- :class:`EngineConnection`, one exchange with an engine (Narwhal is the client);
* :mod:`.codec` -- :class:`Codec`, which makes both for one router, and the protocols the router sees.

h11 is not used here: it is the oracle the codec is tested against byte
for byte, in ``tests/core/http_reference.py``.
"""

from narwhal_core.http.codec import Codec, CodecLike, EngineCodec, ServerCodec
from narwhal_core.http.engine import EngineConnection
from narwhal_core.http.grammar import (
    DEFAULT_ENGINE_MAX_BODY_BYTES,
    DEFAULT_ENGINE_MAX_HEADER_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_REQUEST_LINE_BYTES,
    NEED_DATA,
    PAUSED,
    BodyData,
    ConnectionClosed,
    ContinueExpected,
    EngineEvent,
    Headers,
    HttpRequest,
    LineMemory,
    ResponseEnd,
    ResponseHead,
    ServerEvent,
    Signal,
)
from narwhal_core.http.server import ServerConnection

__all__ = [
    "NEED_DATA", "PAUSED", "Signal", "Headers", "HttpRequest", "ContinueExpected", "ConnectionClosed",
    "ServerEvent", "ResponseHead", "BodyData", "ResponseEnd", "EngineEvent", "LineMemory",
    "Codec", "CodecLike", "ServerCodec", "EngineCodec", "ServerConnection", "EngineConnection",
    "DEFAULT_MAX_REQUEST_LINE_BYTES", "DEFAULT_MAX_HEADER_BYTES", "DEFAULT_MAX_HEADERS", "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_ENGINE_MAX_HEADER_BYTES", "DEFAULT_ENGINE_MAX_BODY_BYTES",
]
