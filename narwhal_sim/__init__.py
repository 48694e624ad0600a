"""Narwhal's engine simulator: a vLLM-compatible OpenAI engine speaking the PD protocol (docs/simulator.md).

* :mod:`narwhal_sim.engine` — the pure, steppable engine core (scheduler
  steps under a token budget, the KV block pool with its prefix cache, KV events).
* :mod:`narwhal_sim.model` — prompts, text, KV leases, fault decisions.
* :mod:`narwhal_sim.tokens` — block hashes, pseudo token ids, the tokenizer.
* :mod:`narwhal_sim.protocol` — OpenAI request/answer shapes as vLLM writes them.
* :mod:`narwhal_sim.config` — :class:`SimConfig`, every setting of one engine.
* :mod:`narwhal_sim.server` — :class:`SimEngine`, the HTTP engine on asyncio: a dispatcher
  over one module per flow (completion, prefill, decode, KV pull, control; docs/simulator.md).
* :mod:`narwhal_sim.testing` — :class:`SimThread` and :class:`SimProcess` for tests,
  the demo and benchmarks.
* :mod:`narwhal_sim.cli` — ``narwhal sim`` / ``python -m narwhal_sim``.

See ``docs/simulator.md``.
"""

from typing import Any

__all__ = ["EngineCore", "StepConfig", "Faults", "SimConfig", "SimEngine", "KV_PULL_PATH", "ABORT_PATH",
           "DEFAULT_MODEL"]  # fmt: skip

_HOMES = {
    "EngineCore": "narwhal_sim.engine",
    "StepConfig": "narwhal_sim.engine",
    "Faults": "narwhal_sim.model",
    "SimConfig": "narwhal_sim.config",
    "SimEngine": "narwhal_sim.server",
    "KV_PULL_PATH": "narwhal_sim.server",
    "ABORT_PATH": "narwhal_sim.server",
    "DEFAULT_MODEL": "narwhal_sim.config",
}


def __getattr__(name: str) -> Any:
    # Lazy, so the pure modules (engine, tokens, model) import without the server.
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'narwhal_sim' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)
