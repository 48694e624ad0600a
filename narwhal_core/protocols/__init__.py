"""Engine protocols, one module each, and the choice of one by ``engine.protocol`` (docs/design.md, "Engine protocols")."""

from __future__ import annotations

from .seam import EngineProtocol
from .vllm_pull import VllmNixlPull
from .vllm_push import VllmNixlPush

__all__ = ["EngineProtocol", "VllmNixlPull", "VllmNixlPush", "engine_protocol"]


def engine_protocol(name: str) -> EngineProtocol:
    """The protocol ``engine.protocol`` names (the configuration refuses any name not driven here)."""
    if name == VllmNixlPull.name:
        return VllmNixlPull()
    if name == VllmNixlPush.name:
        return VllmNixlPush()
    raise ValueError(f"no engine protocol {name!r}")
