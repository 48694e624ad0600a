"""narwhal_core: the pure, I/O-free heart of Narwhal.

Validation, ID derivation, leg planning, admission and capacity bookkeeping,
KV ownership, journal records, the config model and the HTTP/1.1 protocol
objects, driven like h11: feed events to :class:`Router` with the current
time, drain the commands it returns, and re-arm one timer at
:meth:`Router.get_deadline`. Nothing in this package does I/O, reads a clock
or draws a random number; time and IDs are injected.
"""

from .auth import ApiKeys, Authenticator, api_key_digest, parse_api_keys
from .config import Config, EngineAddress, config_from_dict, parse_config
from .contract import AcceptedRequest, check_request
from .errors import (
    AuthError,
    ConfigError,
    ContractError,
    LocalProtocolError,
    NarwhalError,
    ProtocolError,
    RemoteProtocolError,
    TransitionError,
)
from .events import (
    CONTROL_BODY_LIMIT,
    AuthenticatorChanged,
    CancelLeg,
    ClientConnected,
    ClientData,
    ClientGone,
    ClientStalled,
    CloseClient,
    Command,
    ControlDone,
    Event,
    FinishLeg,
    EnginesChanged,
    KvEventsReceived,
    KvStreamChanged,
    JournalHealth,
    LegData,
    LegFailed,
    Log,
    PromptTokenized,
    ShutdownComplete,
    ShutdownRequested,
    StartControl,
    StartLeg,
    TokenizePrompt,
    Transmit,
    WriteJournal,
    local_failure,
)
from .fleet_change import FleetChanged
from .http import Codec, CodecLike
from .ids import RidSource, backend_id, parse_backend_id
from .router import Router, RouterStatistics

__all__ = [
    "CONTROL_BODY_LIMIT", "AcceptedRequest", "ApiKeys", "AuthError", "Authenticator", "AuthenticatorChanged",
    "CancelLeg", "ClientConnected", "ClientData", "ClientGone", "ClientStalled", "CloseClient", "Codec", "CodecLike",
    "Command", "Config", "ConfigError", "ContractError", "ControlDone", "EngineAddress",
    "EnginesChanged", "FleetChanged", "KvEventsReceived", "KvStreamChanged", "Event", "FinishLeg", "JournalHealth", "LegData", "LegFailed",
    "LocalProtocolError", "Log", "NarwhalError", "PromptTokenized", "ProtocolError", "RemoteProtocolError",
    "RidSource", "Router", "RouterStatistics", "ShutdownComplete", "ShutdownRequested",
    "StartControl", "StartLeg", "TokenizePrompt", "TransitionError", "Transmit", "WriteJournal",
    "api_key_digest", "backend_id", "check_request", "config_from_dict", "parse_api_keys",
    "parse_backend_id", "parse_config", "local_failure",
]
